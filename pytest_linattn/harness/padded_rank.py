"""What a rank of the padded-batch check runs: build the client's layer, load its weights, then
every call in order, each from the state the previous one returned (None first). The test
process (`pytest_linattn.harness.padded`) judges. No pytest."""

from __future__ import annotations

import dataclasses

import torch

from .placement import Placement
from .sharded_parity_rank import load_shard, run_device

__all__ = ["PaddedCall", "RankPadded", "run_padded_on_rank"]


@dataclasses.dataclass(frozen=True)
class PaddedCall:
    """One call: kind "prefill" or "decode", its columns start..stop-1, the input `[B, T, hidden]`,
    the attention mask `[B, T]` bool, and each column's token in its row (-1: a pad)."""

    kind: str
    start: int
    stop: int
    x: torch.Tensor
    mask: torch.Tensor
    position: torch.Tensor


@dataclasses.dataclass(frozen=True)
class RankPadded:
    """What every rank gets: the client's path, the placement, the replicated weights, the calls, the dtype."""

    path: object
    placement: Placement
    weights: dict
    calls: list
    dtype: torch.dtype


def run_padded_on_rank(case: RankPadded) -> list:
    """Rank function (for spawn): per call its outputs `y` `[B, T, hidden]` and the state it returned."""
    import torch.distributed as dist

    p, path, device = case.placement, case.path, run_device()
    tp_rank = dist.get_rank() % p.tp
    module = path.layer.build(p, path.layer.process_groups(p), case.dtype, device)
    if path.layer.shard is not None:
        load_shard(module, path.layer.shard(case.weights, p, tp_rank))
    state, out = None, []
    with torch.no_grad():
        for call in case.calls:
            y, state = path.forward(module, call.x.to(device, case.dtype), call.mask.to(device), state, p)
            fields = [t.detach().cpu() for t in state]
            out.append(dict(y=y.detach().cpu(),
                            state=type(state)(*fields) if hasattr(state, "_fields") else type(state)(fields)))
    return out
