"""What a rank of a pipeline check runs: its stage's module (the client's, holding the stage's
layers), loaded with its shard, then forward and backward over the hand-offs between stages
(`linattn.parallel.pipeline`), or a prefill and decode steps; the test process
(`pytest_linattn.harness.pipeline`) puts the results together. This module imports no pytest.

Ranks (`placement`'s docstring): global rank = tp_rank + tp * (cp_rank + cp * stage); every stage
holds the same tokens on its (tp_rank, cp_rank), so a rank hands its stage's output for those
tokens to the rank at its position in the next stage.
"""

from __future__ import annotations

import dataclasses

import torch

from .cases import PipelineStack
from .placement import Placement, rank_token_index
from .sharded_parity_rank import load_shard, run_device, whole

__all__ = ["RankPipeline", "run_pipeline_on_rank", "stage_coordinates", "stage_layers"]


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The global indices of the layers stage `stage` of `pp` holds: contiguous ranges in stage
    order, sizes differing by at most one (the later stages hold the extra layers)."""
    return range(stage * num_layers // pp, (stage + 1) * num_layers // pp)


def stage_coordinates(placement: Placement, rank: int) -> tuple[int, int, int]:
    """(tp_rank, cp_rank, stage) of global rank `rank`."""
    tp, cp = placement.tp, placement.cp
    return rank % tp, rank // tp % cp, rank // (tp * cp)


@dataclasses.dataclass(frozen=True)
class RankPipeline:
    """What every rank gets. kind "train": x, dy the whole batch `[1, T, hidden]`, cu_seqlens its
    boundaries. kind "decode": x every token of the batch, cu_seqlens the prompts' boundaries,
    prompt_tokens the prompts' tokens (indices into x, in the prompts' packed order), steps per
    decode step (its sequences, their tokens: indices into x)."""

    kind: str
    stack: PipelineStack
    placement: Placement
    weights: dict
    cu_seqlens: torch.Tensor
    x: torch.Tensor
    dtype: torch.dtype
    dy: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None
    steps: tuple = ()


def run_pipeline_on_rank(cases):
    """Rank function (for spawn): per case this rank's stage and results (`_train`, `_decode`).
    Groups are made once per (process_groups, tp, cp, pp), collectively."""
    import torch.distributed as dist

    from linattn.parallel import new_pipeline_group

    rank, device = dist.get_rank(), run_device()
    client_groups, pipeline_groups, results = {}, {}, []
    for case in cases:
        p = case.placement
        at = (case.stack.process_groups, p.tp, p.cp, p.pp)
        if at not in client_groups:
            client_groups[at] = case.stack.process_groups(p)
            pipeline_groups[at] = new_pipeline_group(p.tp, p.cp, p.pp)
        run = _train if case.kind == "train" else _decode
        results.append(run(case, client_groups[at], pipeline_groups[at], rank, device))
    return results


def _stage_module(case: RankPipeline, groups, rank: int, device):
    p, stack = case.placement, case.stack
    tp_rank, cp_rank, stage = stage_coordinates(p, rank)
    layers = stage_layers(stack.num_layers, p.pp, stage)
    module = stack.build(p, groups, layers, case.dtype, device)
    load_shard(module, stack.shard(case.weights, p, tp_rank, layers), "PipelineStack")
    return module, tp_rank, cp_rank, stage


def _receive_or_take(x_first, shape, case, stage, pp_group, device):
    """Stage 0's input (`x_first`, a leaf that requires grad where grad is on), or the previous
    stage's output."""
    from linattn.parallel.pipeline import receive_from_previous_stage

    if stage == 0:
        return x_first.to(device, case.dtype).requires_grad_(torch.is_grad_enabled())
    return receive_from_previous_stage(shape, case.dtype, device, pp_group)


def _hand_on(y, x, stage, case, pp_group, what):
    """Send a stage's output `y` to the next stage (a handle whose backward waits for its
    gradient), after checking it is what the next stage receives: x's shape and the case's dtype."""
    from linattn.parallel.pipeline import send_to_next_stage

    if tuple(y.shape) != tuple(x.shape) or y.dtype != case.dtype:
        raise ValueError(f"PipelineStack.{what} of stage {stage} returned y of shape {tuple(y.shape)}, {y.dtype}; "
                         f"the next stage receives its input's, {tuple(x.shape)}, {case.dtype}")
    return send_to_next_stage(y, pp_group)


def _train(case: RankPipeline, groups, pp_group, rank: int, device) -> dict:
    """One forward and backward: (stage, output y, input gradient dx, parameter gradients)."""
    p, stack = case.placement, case.stack
    module, tp_rank, cp_rank, stage = _stage_module(case, groups, rank, device)
    index = rank_token_index(case.cu_seqlens, p, tp_rank, cp_rank)
    shape = (1, index.numel(), case.x.shape[-1])
    cu = case.cu_seqlens.to(device)
    with torch.enable_grad():
        x = _receive_or_take(case.x[:, index], shape, case, stage, pp_group, device)
        y = stack.forward(module, x, cu, p) if stack.forward else module(x, cu)
        if stage == p.pp - 1:
            (y * case.dy[:, index].to(device, case.dtype)).sum().backward()
        else:
            _hand_on(y, x, stage, case, pp_group, "forward").backward()
    return dict(stage=stage, y=y.detach().cpu(), dx=None if x.grad is None else x.grad.detach().cpu(),
                grads={n: None if q.grad is None else whole(q.grad).detach().cpu()
                       for n, q in module.named_parameters()})


def _decode(case: RankPipeline, groups, pp_group, rank: int, device) -> dict:
    """The prefill of every prompt, then each decode step, through the stages: (stage, each call's
    output on this rank, the stage's caches after the last call)."""
    p, stack = case.placement, case.stack
    module, tp_rank, cp_rank, stage = _stage_module(case, groups, rank, device)
    hidden = case.x.shape[-1]
    last = stage == p.pp - 1
    outputs = []
    with torch.no_grad():
        index = rank_token_index(case.cu_seqlens, p, tp_rank, cp_rank)
        x = _receive_or_take(case.x[:, case.prompt_tokens][:, index], (1, index.numel(), hidden), case, stage,
                             pp_group, device)
        cu = case.cu_seqlens.to(device)
        y = stack.prefill(module, x, cu, p) if stack.prefill else module.prefill(x, cu)
        if not last:
            _hand_on(y, x, stage, case, pp_group, "prefill")
        outputs.append(y.cpu())
        for sequences, tokens in case.steps:
            x = _receive_or_take(case.x[:, tokens], (1, len(sequences), hidden), case, stage, pp_group, device)
            y = stack.decode(module, x, list(sequences), p) if stack.decode else module.decode(x, list(sequences))
            if not last:
                _hand_on(y, x, stage, case, pp_group, "decode")
            outputs.append(y.cpu())
        caches = stack.caches(module, p) if stack.caches else module.caches()
    if not isinstance(caches, dict):
        raise ValueError(f"PipelineStack.caches must return a dict {{layer index: state}}, got {type(caches).__name__}")
    return dict(stage=stage, outputs=outputs,
                caches={i: type(s)(*(t.detach().cpu() for t in s)) if hasattr(s, "_fields")
                        else tuple(t.detach().cpu() for t in s) for i, s in caches.items()})
