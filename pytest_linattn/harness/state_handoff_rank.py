"""What the ranks of the state handoff check run. The prefill placement's ranks prefill every
prompt whole, from zero, and return their outputs and final states (each in its TP rank's
layout). A target placement's ranks each get every source rank's final state, call the client's
`handoff` for their own TP rank, keep a copy of what it returned (judged before any decode step:
it is what locates a bug), then run the decode steps from it. The test process
(`pytest_linattn.harness.state_handoff`) judges. This module imports no pytest."""

from __future__ import annotations

import dataclasses

import torch

from .continuation_rank import decode_in_layout, default_decode, default_prefill, rank_coordinates
from .placement import Placement
from .sharded_parity_rank import load_shard, run_device
from .state_pool_rank import rebuild_state

__all__ = ["RankDecode", "RankPrefill", "run_decode_on_rank", "run_prefill_on_rank"]


@dataclasses.dataclass(frozen=True)
class RankPrefill:
    """What a source rank gets: the client's path, the prefill placement, the replicated weights,
    the prompts packed `[1, T, hidden]` and their boundaries, the ranks' dtype."""

    path: object
    placement: Placement
    weights: dict
    x: torch.Tensor
    cu_seqlens: torch.Tensor
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class RankDecode:
    """What a target rank gets: the path, both placements, the weights, the source ranks' final
    states (TP rank order, each in its rank's layout and dtype), every decode step's tokens
    `[steps, N, hidden]`, and per target TP rank each state field's shape in its layout (the
    reference's state through `shard_state`)."""

    path: object
    source: Placement
    placement: Placement
    weights: dict
    states: list
    x: torch.Tensor
    shapes: list
    dtype: torch.dtype


def _layer(path, placement, tp_rank, weights, dtype, device):
    module = path.layer.build(placement, path.layer.process_groups(placement), dtype, device)
    if path.layer.shard is not None:
        load_shard(module, path.layer.shard(weights, placement, tp_rank))
    return module


def _kept(state):
    """A CPU copy of a state (a client may go on updating the tensors it returned)."""
    return rebuild_state(state, [t.detach().to("cpu", copy=True) for t in state])


def run_prefill_on_rank(case: RankPrefill) -> dict:
    """Rank function (for spawn): the prompts' outputs `[1, T, hidden]` and this rank's final state."""
    p, path, device = case.placement, case.path, run_device()
    tp_rank, _ = rank_coordinates(p)
    module = _layer(path, p, tp_rank, case.weights, case.dtype, device)
    with torch.no_grad():
        y, state = (path.prefill or default_prefill)(module, case.x.to(device, case.dtype),
                                                     case.cu_seqlens.to(device), None, p)
    return dict(y=y.detach().to("cpu", copy=True), state=_kept(state))


def _layout_problem(handed, shapes) -> str:
    """'' when `handed` is a state of `shapes` (one floating-point tensor per field), else what is off."""
    if not isinstance(handed, tuple) or len(handed) != len(shapes):
        return (f"handoff returned {type(handed).__name__} of {len(handed) if isinstance(handed, tuple) else '?'} "
                f"field(s); the target rank's state has {len(shapes)}")
    for i, (t, shape) in enumerate(zip(handed, shapes)):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == tuple(shape)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            name = handed._fields[i] if hasattr(handed, "_fields") else f"state[{i}]"
            return (f"handoff returned field {name} of shape {got}; the target rank's layout (shard_state of the "
                    f"reference's state) has {tuple(shape)}")
    return ""


def run_decode_on_rank(case: RankDecode) -> dict:
    """Rank function (for spawn): the state the handoff gave this rank (a copy, before decoding) or
    why it is unusable ('problem': then no rank decodes), each decode step's outputs `[steps, N,
    hidden]` and the state after the last step (this rank's layout)."""
    import torch.distributed as dist

    p, path, device = case.placement, case.path, run_device()
    tp_rank, _ = rank_coordinates(p)
    module = _layer(path, p, tp_rank, case.weights, case.dtype, device)
    states = [rebuild_state(s, [t.to(device) for t in s]) for s in case.states]
    handed, problem = None, ""
    try:
        with torch.no_grad():
            handed = path.handoff(states, case.source, p, tp_rank)
        problem = _layout_problem(handed, case.shapes[tp_rank])
    except Exception as exc:  # noqa: BLE001 - the client's handoff failing is a finding, reported by rank
        problem = f"handoff raised {type(exc).__name__}: {exc}"
    kept = _kept(handed) if isinstance(handed, tuple) and all(isinstance(t, torch.Tensor) for t in handed) else None
    # the TP ranks decode together (the layer's collectives): every rank skips when one cannot
    unusable = torch.tensor([1.0 if problem else 0.0], device=device)
    dist.all_reduce(unusable)
    if float(unusable) > 0:
        return dict(handed=kept, problem=problem, y=None, final=None)
    decode = path.decode or default_decode
    state, ys = handed, []
    with torch.no_grad():
        for step in range(case.x.shape[0]):
            x = case.x[step].unsqueeze(0).to(device, case.dtype)
            y, state = decode_in_layout(decode, module, x, state, p, path.decode_layout)
            ys.append(y.detach().to("cpu", copy=True)[0])
    return dict(handed=kept, problem="", y=torch.stack(ys), final=_kept(state))
