"""transformers' tensor-parallel plan described for pytest-linattn's harness, and the rank functions.

The "layer" is a whole CausalLM loaded with `from_pretrained(checkpoint, dtype=torch.float64,
distributed_config=DistributedConfig(tp_size=2, tp_plan="auto"))`: transformers shards it itself
(DTensor parameters, its own device mesh over the spawned world), and the reference is the same
checkpoint loaded unsharded. Every callable is module-level (the harness pickles them by
reference to the ranks):

    load            the model from a checkpoint, unsharded or with transformers' TP plan
    build           the TP model on a rank (the harness's ShardedLayer.build)
    forward         x `[1, T, hidden]` fed as `inputs_embeds`, the logits back (so lm_head's
                    colwise_gather_output is in the check; output size = vocabulary)
    unshard         TP rank 0's dict: the harness hands DTensor gradients and parameters over whole
    process_groups  none of the harness's: transformers makes its own mesh over the world
    adamw           the training step's optimizer (AdamW, eps 1e-4: see its docstring)

`transformers_tp_layer(checkpoint, replicated)` puts them together as a `pytest_linattn.ShardedLayer`;
`parameter_placements` (a rank function) tells which parameters the plan leaves replicated.
"""

from __future__ import annotations

import functools

from . import fla_mode  # first: fixes fla absent / emulated before transformers is imported

import torch
from transformers import AutoModelForCausalLM
from transformers.distributed.configuration_utils import DistributedConfig

from pytest_linattn import ShardedLayer

__all__ = ["adamw", "build", "fla_mode", "forward", "load", "parameter_placements", "process_groups",
           "reference_forward", "transformers_tp_layer", "unshard"]


def load(checkpoint: str, *, tp_size: int = 1, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The CausalLM at `checkpoint` in `dtype`, in training mode; tp_size > 1: sharded by
    transformers' own plan over the default process group (its world size must be tp_size).

    The input embedding is frozen: the harness feeds `inputs_embeds`, so it gets no gradient."""
    kwargs = {"dtype": dtype}
    if tp_size > 1:
        kwargs["distributed_config"] = DistributedConfig(tp_size=tp_size, tp_plan="auto")
    if getattr(_config(checkpoint), "num_local_experts", None):
        kwargs["experts_implementation"] = "eager"  # the default grouped_mm refuses float64 on a CPU
    model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
    model.get_input_embeddings().weight.requires_grad_(False)
    return model.train()


@functools.lru_cache(maxsize=None)
def _config(checkpoint):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint)


def process_groups(placement):
    """Nothing: `from_pretrained` makes transformers' own device mesh over the whole world."""
    return None


def build(placement, groups, dtype, device, *, checkpoint: str):
    if placement.cp != 1 or placement.sequence_parallel:
        raise ValueError(f"transformers' TP plan is TP only, got {placement.name}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"this example runs on the CPU (gloo), got device {device}")
    return load(checkpoint, tp_size=placement.tp, dtype=dtype)


def forward(module, x, cu_seqlens, placement):
    """x `[1, T, hidden]` as `inputs_embeds`; the logits `[1, T, vocab]`. The packing
    (cu_seqlens) is not given to the model: the batch is one sequence to it. The reference gets the
    same call (`reference_forward`), so the comparison is consistent; what is checked is the
    sharding, not transformers' packed-sequence support. use_cache=False: no cache in training
    (linear-attention-only models refuse one: `get_seq_length can only be called on Attention layers`)."""
    return module(inputs_embeds=x, use_cache=False).logits


def reference_forward(module, x, cu_seqlens):
    return forward(module, x, cu_seqlens, None)


def unshard(local_grads, placement):
    """TP rank 0's dict of gradients (or parameters): the harness converts DTensors with
    `.full_tensor()` on the rank, and the names are the reference's (one checkpoint for both)."""
    return dict(local_grads[0])


def adamw(params):
    """The training step's optimizer: the harness's default AdamW(lr=1e-2, weight_decay=0.1) with eps=1e-4
    instead of 1e-8. AdamW's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps it
    multiplies a gradient difference by up to lr / (4 eps). These models compute parts in float32 whatever
    the dtype (q_norm / k_norm, the gated norms, KDA's gate), so TP and the reference differ by about 1e-9
    absolute in a gradient; with eps=1e-8, one element of Kimi Linear's v_proj gradient of 2.3e-8 turned
    that into a 2.8e-4 weight difference (4.3e-5 relative, layer 0, fla emulated). With 1e-4 the gain is at
    most 25, every weight still moves by up to lr, and a wrong gradient (an O(1) error) still shows."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


def parameter_placements(checkpoint: str) -> dict:
    """Rank function (spawn, world = TP size 2): {parameter name: its DTensor placements, e.g.
    "(Shard(dim=0),)", or None where transformers' plan left a plain tensor (replicated)}."""
    import torch.distributed as dist

    model = load(checkpoint, tp_size=dist.get_world_size())
    return {n: str(tuple(p.placements)) if hasattr(p, "placements") else None for n, p in model.named_parameters()}


def transformers_tp_layer(checkpoint: str, replicated=()) -> ShardedLayer:
    """The harness's client for the checkpoint's model under transformers' TP plan.

    shard=None: build loads the checkpoint the reference is loaded from. replicated: the
    parameters the plan leaves plain tensors (None in `parameter_placements`): each TP rank
    holds them whole, so the harness checks their gradients and values are equal on every TP rank
    and counts them once in the gradient norm (DTensor ones it takes whole itself)."""
    return ShardedLayer(build=functools.partial(build, checkpoint=str(checkpoint)), shard=None, unshard=unshard,
                        replicated=frozenset(replicated), process_groups=process_groups, forward=forward)
