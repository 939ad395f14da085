"""What a client gives the harness: its sharded layer (`ShardedLayer`), the cases to check
(`ParityCase`), the trainer around the layer (`TrainingStep`), how the layer carries state
from call to call (`StatePath`) and a stack of layers split into pipeline stages
(`PipelineStack`). All are checked when made, so bad input fails before any rank runs. This module
imports no pytest."""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable, Collection

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .placement import Placement, as_cu_seqlens, check_fits, check_one_stage, default_process_groups
from .recompute import check_recompute

__all__ = ["DECODE_LAYOUTS", "ParityCase", "PipelineStack", "ShardedLayer", "StatePath", "TrainingStep",
           "default_optimizer", "require_linattn_config", "require_module_level"]


def require_linattn_config(obj, what: str) -> None:
    """ValueError unless `obj.config` is None or a `linattn.layers.LinearAttentionConfig` (what a
    report reads sections and heads from; `what`: the layout the client's tensors follow)."""
    from linattn.layers import LinearAttentionConfig

    if obj.config is not None and not isinstance(obj.config, LinearAttentionConfig):
        raise ValueError(f"{type(obj).__name__}.config must be a linattn.layers.LinearAttentionConfig (the layer's, "
                         f"{what}) or None, got {type(obj.config).__name__}")


def require_module_level(obj) -> None:
    """ValueError unless `obj` (a client's path or layer description) pickles: spawn sends its
    callables to the ranks by reference, so they must be module-level. Fails here, not inside spawn."""
    try:
        pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - reported as bad input
        raise ValueError(f"{type(obj).__name__}'s callables must be module-level (spawn pickles them by reference): "
                         f"{exc}") from None

# how a decode call lays out its N tokens (one per sequence), input and output alike
DECODE_LAYOUTS = {
    "packed": "[1, N, hidden]: the N tokens side by side on the token dim, as a prefill call packs them (linattn's step)",
    "batched": "[N, 1, hidden]: one batch row per sequence (fla's and transformers' decode)",
}

# a required field placed before optional ones (`shard` is positional, `unshard` after it optional)
_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class ShardedLayer:
    """A client's sharded layer: how to make it on a rank, shard its weights, unshard gradients.

    Every callable must be module-level (or a functools.partial of one): it is pickled by
    reference to spawn's ranks.

    build(placement, groups, dtype, device) -> nn.Module
        On every rank: the sharded layer for `placement`, parameters in `dtype` on `device`
        (values are overwritten by `shard`'s). `groups` is what `process_groups` returned.
    shard(full_state_dict, placement, tp_rank) -> dict, or None
        The TP rank's parameters (named as the built module's `named_parameters()`, exactly
        those) from the replicated layer's weights (named as the reference's parameters).
        None: `build` already gives the module the reference's weights (both loaded from one
        checkpoint, say), and the harness loads nothing.
    unshard(local_grads, placement) -> dict, or None
        The replicated layer's gradient dict (reference names) from the TP ranks' gradient
        dicts, in TP rank order (each already summed over CP; see the module's gradient rule).
        Needed by the parity harness and the training-step check; the continuation check
        compares states and input gradients only, and takes None.
    replicated
        Names of the built module's parameters that every TP rank holds whole: their gradients
        must be equal on every TP rank after `after_backward`.
    process_groups(placement) -> groups
        Collective, on every rank, once per distinct (process_groups, tp, cp) of a spawn call,
        before those placements' layers are built (a client with global parallel state re-initialises it
        here). Default: `default_process_groups`.
    forward(module, x_local, cu_seqlens, placement) -> y_local
        How to call the layer; x_local and y_local are `[1, T_local, hidden]`, cu_seqlens the
        whole batch's (on the rank's device). Default: `module(x_local, cu_seqlens)`. A padded
        placement (`Placement.padded`) also passes `cu_seqlens_padded=` (keyword, both calls).
    after_backward(module, placement)
        The client's own gradient reduction after backward (a trainer's finalize step), if any.
    describe_grad_element(name, index, placement) -> str | None
        In the test process, for a failing parameter gradient: where element `index` (a tuple
        into the replicated layer's parameter `name`) lies, in the layer's words ("value head 5,
        channel 2 (TP rank 1)"), so the report needs no arithmetic; None: row/col or multi-index.
    """

    build: Callable
    shard: Callable | None = _REQUIRED
    unshard: Callable | None = None
    replicated: Collection[str] = frozenset()
    process_groups: Callable = default_process_groups
    forward: Callable | None = None
    after_backward: Callable | None = None
    describe_grad_element: Callable | None = None

    def __post_init__(self):
        if self.shard is _REQUIRED:
            raise ValueError("ShardedLayer.shard is required: a callable, or None when build already loads the "
                             "reference's weights")
        for field in ("build", "process_groups"):
            if not callable(getattr(self, field)):
                raise ValueError(f"ShardedLayer.{field} must be callable, got {getattr(self, field)!r}")
        for field in ("shard", "unshard", "forward", "after_backward", "describe_grad_element"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ValueError(f"ShardedLayer.{field} must be callable or None, got {getattr(self, field)!r}")
        if isinstance(self.replicated, str) or not all(isinstance(n, str) for n in self.replicated):
            raise ValueError(f"ShardedLayer.replicated must be a collection of parameter names, got {self.replicated!r}")
        object.__setattr__(self, "replicated", frozenset(self.replicated))
        require_module_level(self)

    def require_unshard(self, check: str) -> None:
        """ValueError unless `unshard` is given: `check` compares parameter gradients."""
        __tracebackhide__ = True
        if self.unshard is None:
            raise ValueError(f"ShardedLayer.unshard is required by {check}: it puts the TP ranks' parameter gradients "
                             "back together as the replicated layer's (only the continuation check runs without it)")


@dataclasses.dataclass(frozen=True, eq=False)
class ParityCase:
    """One placement of one sharded layer on one packed batch, and the replicated layer it must match.

    reference: the replicated layer (an nn.Module, float64 as a rule), run in the test process;
        its named parameters are the full weights every rank shards, its dtype the reference's.
    cu_seqlens: the packed batch's sequence boundaries. x, dy: the whole batch's input and output
        cotangent `[1, T, hidden]` (seeded random values, never zeros); a padded placement's
        ranks get the pads too (`padded_batch`), the reference never.
    dtype: the sharded layer's parameter and input dtype. rtol: the tolerance of every comparison.
    reference_forward(reference, x, cu_seqlens) -> y: how to call the reference (default
        `reference(x, cu_seqlens)`). Cases sharing reference, x, dy and cu_seqlens share one run.
    recompute: False, "reentrant" or "non-reentrant" (True: "non-reentrant"): the layer's forward
        on the ranks runs under torch.utils.checkpoint, and the run must equal the same run
        without recompute bitwise, its replay issuing the forward's collectives
        (`pytest_linattn.harness.recompute`).
    """

    layer: ShardedLayer
    placement: Placement
    reference: torch.nn.Module
    cu_seqlens: torch.Tensor
    x: torch.Tensor
    dy: torch.Tensor
    rtol: float
    dtype: torch.dtype = torch.float64
    name: str = ""
    reference_forward: Callable | None = None
    recompute: bool | str = False

    def __post_init__(self):
        object.__setattr__(self, "recompute", check_recompute(self.recompute, "ParityCase.recompute"))
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"ParityCase.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        self.layer.require_unshard("the parity harness (ParityCase.layer)")
        if not isinstance(self.placement, Placement):
            raise ValueError(f"ParityCase.placement must be a Placement, got {type(self.placement).__name__}")
        if not isinstance(self.reference, torch.nn.Module):
            raise ValueError(f"ParityCase.reference must be a torch.nn.Module, got {type(self.reference).__name__}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"ParityCase.dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "rtol", check_rtol(self.rtol))
        cu = as_cu_seqlens(self.cu_seqlens)
        object.__setattr__(self, "cu_seqlens", cu)
        T = int(cu[-1])
        for field in ("x", "dy"):
            t = getattr(self, field)
            if not isinstance(t, torch.Tensor) or t.dim() < 3 or t.shape[0] != 1 or t.shape[1] != T:
                raise ValueError(f"ParityCase.{field} must be a [1, T={T}, ...] tensor (T = cu_seqlens[-1]), "
                                 f"got {getattr(t, 'shape', type(t).__name__)}")
        if self.dy.shape != self.x.shape:
            raise ValueError(f"ParityCase.dy must have x's shape {tuple(self.x.shape)}, got {tuple(self.dy.shape)}")
        check_fits([int(b) for b in cu.tolist()], self.placement, padded_ok=True)
        check_one_stage(self.placement, "the parity harness (ParityCase)")
        if not self.name:
            object.__setattr__(self, "name", self.placement.name)


def default_optimizer(params):
    """AdamW(lr=1e-2, weight_decay=0.1, eps=1e-4): a step large enough that a wrong gradient moves
    a weight. AdamW divides by sqrt(v) + eps, which multiplies the rounding of a gradient element
    near eps by up to lr / (4 eps) in the weight: 25 with eps 1e-4, 2.5e5 with torch's 1e-8 (a
    float32 rounding inside a float64 model then fails a 1e-10 bound)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


@dataclasses.dataclass(frozen=True)
class TrainingStep:
    """The trainer around a sharded layer, for `assert_training_parity`. Callables module-level
    (the ranks get them pickled by reference); None means the harness's own, correct, version.

    steps: optimizer steps, each over every micro-batch (gradients accumulating between them).
    max_norm: clip the gradients to this global norm (None: no clipping).
    optimizer(params) -> torch.optim.Optimizer; on the ranks and for the reference.
    loss(y, dy, tokens, micro_batches) -> scalar tensor: a rank's part of one micro-batch's loss
        (`y`, `dy` its tokens; `tokens` the micro-batch's whole count): the micro-batch's loss is
        the sum of the parts over the ranks holding different tokens. On the reference (the
        whole batch) it is the loss. Default `(y * dy).sum() / (tokens * micro_batches)`: a
        token mean over the whole micro-batch, averaged over the micro-batches (the step's
        whole count, over every data-parallel rank).
    finalize_grads(module, placement, groups): the trainer's reduction once all micro-batches'
        backwards are done (Megatron's finalize_model_grads). Default: every gradient summed
        over the CP group (each CP rank holds the partial sum over its tokens) and, with
        data-parallel replicas, over their DP ranks too (each holds its micro-batches' part).
    grad_norm(module, placement, groups) -> 0-dim tensor: the global gradient norm, the same on
        every rank. Default: every parameter counted once: TP-sharded squares summed over the TP
        group, TP-replicated ones (`ShardedLayer.replicated`; in a module holding DTensors, every
        plain parameter) once, DTensor gradients whole.
    clip(params, max_norm, total_norm): scale the gradients; default
        `torch.nn.utils.clip_grads_with_norm_`.
    zero_grads(module, optimizer): at each step's start, before the first micro-batch (Megatron's
        train_step zeroes its DDP grad buffers here); default `optimizer.zero_grad(set_to_none=True)`.
    """

    steps: int = 2
    max_norm: float | None = None
    optimizer: Callable = default_optimizer
    loss: Callable | None = None
    finalize_grads: Callable | None = None
    grad_norm: Callable | None = None
    clip: Callable | None = None
    zero_grads: Callable | None = None

    def __post_init__(self):
        positive_int(self.steps, "TrainingStep.steps")
        if self.max_norm is not None and (isinstance(self.max_norm, bool) or not isinstance(self.max_norm, (int, float))
                                          or not math.isfinite(self.max_norm) or self.max_norm <= 0):
            raise ValueError(f"TrainingStep.max_norm must be None or a positive finite number, got {self.max_norm!r}")
        if not callable(self.optimizer):
            raise ValueError(f"TrainingStep.optimizer must be callable, got {self.optimizer!r}")
        for field in ("loss", "finalize_grads", "grad_norm", "clip", "zero_grads"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ValueError(f"TrainingStep.{field} must be callable or None, got {getattr(self, field)!r}")
        require_module_level(self)


@dataclasses.dataclass(frozen=True)
class StatePath:
    """How a client's layer carries state from one call to the next, for `assert_continuation_parity`.
    Callables module-level (pickled by reference to the ranks); None means the default, which is
    linattn's layer convention.

    A state is a tuple (a NamedTuple, say) of tensors, each with one row per sequence on dim 0
    (conv state, recurrent state, ...); the state the client's calls take and return, in the
    client's layout. Every call gets the rows of the sequences it runs, in their order.

    layer: the ShardedLayer (build, shard, process_groups; its unshard is not used here and may be None).
    prefill(module, x_local, cu_seqlens, state, placement) -> (y_local, state)
        One chunk of every sequence of a packed call from `state`: x_local the rank's tokens
        `[1, T_local, hidden]` (under CP its contiguous piece of the call), cu_seqlens the call's
        whole boundaries; returns the rank's outputs and every sequence's state after its chunk
        (whole on every CP rank). Default `module(x_local, cu_seqlens, state, output_final_state=True)`.
    decode(module, x, state, placement) -> (y, state)
        One decode step: x the next token of each of N sequences, laid out as `decode_layout`
        says (y likewise), on every rank (no CP split). Default `module.step(x, state)`.
    decode_layout: "packed" (x `[1, N, hidden]`, the default) or "batched" (x `[N, 1, hidden]`,
        fla's and transformers' decode).
    shard_state(state, placement, tp_rank) -> state
        The TP rank's part of the replicated layer's state (the heads it holds). Needed for tp > 1.
    unshard_state(states, placement) -> state
        The replicated layer's state from the TP ranks' states, in TP rank order (also used for
        state gradients, which have the state's layout). Needed for tp > 1.
    differentiable: the calls are differentiable: gradients through the initial and final states
        (dh0, dht) and the inputs are checked too.
    no_decode: the layer has no decode path; the check runs chunks only.
    """

    layer: ShardedLayer
    prefill: Callable | None = None
    decode: Callable | None = None
    shard_state: Callable | None = None
    unshard_state: Callable | None = None
    differentiable: bool = True
    no_decode: bool = False
    decode_layout: str = "packed"

    def __post_init__(self):
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"StatePath.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        if self.decode_layout not in DECODE_LAYOUTS:
            raise ValueError(f"StatePath.decode_layout must be one of {sorted(DECODE_LAYOUTS)} "
                             f"({'; '.join(f'{k}: {v}' for k, v in DECODE_LAYOUTS.items())}), got {self.decode_layout!r}")
        for field in ("prefill", "decode", "shard_state", "unshard_state"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ValueError(f"StatePath.{field} must be callable or None, got {getattr(self, field)!r}")
        for field in ("differentiable", "no_decode"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"StatePath.{field} must be a bool, got {getattr(self, field)!r}")
        if (self.shard_state is None) != (self.unshard_state is None):
            raise ValueError("StatePath.shard_state and unshard_state are given together (or neither: tp = 1 only)")
        require_module_level(self)


@dataclasses.dataclass(frozen=True)
class PipelineStack:
    """A client's stack of `num_layers` layers split into pipeline stages by contiguous layer
    ranges (`pipeline.stage_layers`), for `assert_pipeline_parity` (forward and backward) and
    `assert_pipeline_decode_parity` (prefill, then decode steps with per-layer caches). Callables
    module-level (pickled by reference to the ranks); None means the default.

    The replicated stack (the reference) names layer i's parameters `layers.{i}.<name>`; the
    harness runs the stages in order, handing each stage's output to the next one
    (`linattn.parallel.pipeline`), and the gradient back.

    build(placement, groups, layers, dtype, device) -> nn.Module
        On every rank of a stage: the stage's module, holding the stack's layers `layers` (a range
        of global layer indices); its parameters are overwritten by `shard`'s.
    shard(full_state_dict, placement, tp_rank, layers) -> dict
        The stage's parameters for its TP rank (the built module's names, exactly those) from the
        replicated stack's weights.
    unshard(grads_in_tp_rank_order, placement, layers) -> dict
        The replicated stack's gradients of the stage's layers (reference names), from its TP
        ranks' (each summed over CP). Also given the TP ranks' shards of the weights.
    replicated: names of a stage module's parameters every TP rank holds whole.
    process_groups(placement) -> groups: collective, on every rank; default `default_process_groups`
        (TP and CP groups inside each stage).
    forward(module, x_local, cu_seqlens, placement) -> y_local: default `module(x_local, cu_seqlens)`.
    prefill(module, x_local, cu_seqlens, placement) -> y_local
        The decode check's first call: every sequence's prompt, packed, from empty caches; the
        stage keeps its layers' caches. Default `module.prefill(x_local, cu_seqlens)`.
    decode(module, x, sequences, placement) -> y
        One decode step: x `[1, N, hidden]`, the next token of each sequence in `sequences` (the
        batch's rows, in order; it changes as sequences finish), whole on every rank. Default
        `module.decode(x, sequences)`.
    caches(module, placement) -> {layer index: state}
        The stage's caches after the last call, keyed by global layer index: each a tuple of
        tensors (the reference layer's final-state fields), one row per sequence in sequence order,
        this TP rank's heads. Default `module.caches()`.
    unshard_state(states, placement) -> state
        The replicated layer's state from the TP ranks' (TP rank order). Needed for tp > 1 in the
        decode check.
    describe_grad_element(name, index, placement) -> str | None
        For a failing gradient: where element `index` of the reference's parameter `name` lies, in
        the layer's words (as `ShardedLayer.describe_grad_element`); None: row/col or multi-index.
    """

    num_layers: int
    build: Callable
    shard: Callable
    unshard: Callable
    replicated: Collection[str] = frozenset()
    process_groups: Callable = default_process_groups
    forward: Callable | None = None
    prefill: Callable | None = None
    decode: Callable | None = None
    caches: Callable | None = None
    unshard_state: Callable | None = None
    describe_grad_element: Callable | None = None

    def __post_init__(self):
        positive_int(self.num_layers, "PipelineStack.num_layers")
        for field in ("build", "shard", "unshard", "process_groups"):
            if not callable(getattr(self, field)):
                raise ValueError(f"PipelineStack.{field} must be callable, got {getattr(self, field)!r}")
        for field in ("forward", "prefill", "decode", "caches", "unshard_state", "describe_grad_element"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ValueError(f"PipelineStack.{field} must be callable or None, got {getattr(self, field)!r}")
        if isinstance(self.replicated, str) or not all(isinstance(n, str) for n in self.replicated):
            raise ValueError(f"PipelineStack.replicated must be a collection of parameter names, got "
                             f"{self.replicated!r}")
        object.__setattr__(self, "replicated", frozenset(self.replicated))
        require_module_level(self)
