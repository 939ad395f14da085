"""What a rank of the speculative-decoding check runs: build the client's layer, load its weights,
shard the pool, then every call in order (prefill chunks; verify calls, each followed by the
client's accept with the number of accepted drafts per sequence). After each call the rank keeps
the call's outputs and its scheduled slots, and compares every other slot with its value before
the call (bitwise). The test process (`pytest_linattn.harness.spec_decode`) judges. No pytest."""

from __future__ import annotations

import dataclasses

import torch

from .placement import Placement
from .sharded_parity_rank import run_device
from .state_pool_rank import rank_layer_and_pool, rebuild_state

__all__ = ["RankSpec", "SpecCall", "run_spec_on_rank"]


@dataclasses.dataclass(frozen=True)
class SpecCall:
    """One call: kind "prefill" (chunk `index` of each sequence) or "verify" (round `index`: K
    tokens of each sequence, its next `accepted[i]` tokens then random drafts); the sequences and
    their slots; the call's input `[1, T, hidden]` packed by `cu_seqlens`; a prefill's `fresh`
    flags; `starts`: each sequence's tokens before the call."""

    kind: str
    index: int
    sequences: tuple
    slots: tuple
    x: torch.Tensor
    cu_seqlens: torch.Tensor
    fresh: tuple | None
    accepted: tuple | None
    starts: tuple


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What every rank gets: the client's path, the placement, the replicated weights, the
    initial pool (replicated layout, random), the calls, the dtype, the state's field names."""

    path: object
    placement: Placement
    weights: dict
    pool: tuple
    calls: list
    dtype: torch.dtype
    names: list


def run_spec_on_rank(case: RankSpec) -> dict:
    """Rank function (for spawn): per call its outputs `y` and the scheduled slots' state after it
    (this rank's shard, one row per sequence of the call), and the slots a call changed without
    scheduling them: (call index, slot, field, max |change|)."""
    p, device = case.placement, run_device()
    path, (module, pool) = case.path, rank_layer_and_pool(case, device)
    out, changed = [], []
    with torch.no_grad():
        for i, call in enumerate(case.calls):
            before = [t.clone() for t in pool]
            slots = torch.tensor(call.slots, dtype=torch.int64, device=device)
            x, cu = call.x.to(device, case.dtype), call.cu_seqlens.to(device)
            if call.kind == "prefill":
                y = path.prefill(module, x, cu, pool, slots, torch.tensor(call.fresh, device=device), p)
            else:
                y = path.verify(module, x, cu, pool, slots, p)
                path.accept(module, pool, slots, torch.tensor(call.accepted, dtype=torch.int64, device=device), p)
            states = rebuild_state(case.pool, [t[slots].detach().cpu() for t in pool])
            out.append(dict(y=y.detach().cpu().to(case.dtype), states=states))
            for slot in range(pool[0].shape[0]):
                if slot in call.slots:
                    continue
                for name, old, new in zip(case.names, before, pool):
                    if not torch.equal(old[slot], new[slot]):
                        diff = float((old[slot] - new[slot]).abs().nan_to_num(float("inf")).max())
                        changed.append((i, slot, name, diff))
    return dict(calls=out, changed=changed)

