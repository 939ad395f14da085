"""What a rank of the padded-batch check runs: build the client's layer, load its weights, then
every call in order, each from the state the previous one returned (None first); under CP a
prefill call with this CP rank's share of its tokens (`held`). The test process
(`pytest_linattn.harness.padded`) judges. No pytest."""

from __future__ import annotations

import dataclasses

import torch

from .continuation_rank import rank_coordinates
from .placement import Placement
from .sharded_parity_rank import load_shard, run_device

__all__ = ["PaddedCall", "RankPadded", "run_padded_on_rank"]


@dataclasses.dataclass(frozen=True)
class PaddedCall:
    """One call: kind "prefill" or "decode", its columns start..stop-1, the input `[B, T, hidden]`,
    the attention mask `[B, T]` bool, and each column's token in its row (-1: a pad). Under CP a
    prefill call's `shares`: per CP rank (its input `[B, T, hidden]`, the tokens it holds `[B, T]`)."""

    kind: str
    start: int
    stop: int
    x: torch.Tensor
    mask: torch.Tensor
    position: torch.Tensor
    shares: tuple | None = None


@dataclasses.dataclass(frozen=True)
class RankPadded:
    """What every rank gets: the client's path, the placement, the replicated weights, the calls, the dtype."""

    path: object
    placement: Placement
    weights: dict
    calls: list
    dtype: torch.dtype


def run_padded_on_rank(case: RankPadded) -> list:
    """Rank function (for spawn): per call its outputs `y` `[B, T, hidden]`, the tokens this rank
    held (`[B, T]` bool under CP for a prefill call; None: the whole call) and the state it returned."""
    p, path, device = case.placement, case.path, run_device()
    tp_rank, cp_rank = rank_coordinates(p)
    module = path.layer.build(p, path.layer.process_groups(p), case.dtype, device)
    if path.layer.shard is not None:
        load_shard(module, path.layer.shard(case.weights, p, tp_rank))
    state, out = None, []
    with torch.no_grad():
        for call in case.calls:
            x, held = (call.x, None) if call.shares is None else call.shares[cp_rank]
            keywords = {} if held is None else dict(held=held.to(device))
            y, state = path.forward(module, x.to(device, case.dtype), call.mask.to(device), state, p, **keywords)
            fields = [t.detach().cpu() for t in state]
            out.append(dict(y=y.detach().cpu(), held=held,
                            state=type(state)(*fields) if hasattr(state, "_fields") else type(state)(fields)))
    return out
