"""What a rank of the speculative-decoding check runs: build the client's layer, load its weights,
shard the pool (each field in its dtype: the path's `state_dtypes`, else the case's), then every
call in order (prefill chunks; verify calls, each followed by the client's accept with the number
of accepted drafts per sequence). After each call the rank keeps the call's outputs and a copy of
its scheduled slots, and compares every other slot with its value before
the call (bitwise); a path with `read_state` says where each sequence's state is (its row of
slots). Under CP a prefill call runs this CP rank's piece of its tokens
(`state_pool_rank.prefill_on_rank`, a filler in its scratch slot where they do not divide by cp),
a verify call runs whole, and the pool is whole (TP-sharded) on every CP rank. The test process
(`pytest_linattn.harness.spec_decode`) judges. No pytest."""

from __future__ import annotations

import dataclasses

import torch

from .placement import Placement
from .sharded_parity_rank import run_device
from .state_pool_rank import prefill_on_rank, rank_layer_and_pool, rebuild_state

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
    filler: tuple | None = None  # under CP: (input [1, pad, hidden], scratch slot(s)) of a filler sequence
    snapshot_slots: tuple | None = None  # block_size: per sequence the block of the boundary its tokens reach, -1
    snapshot_offsets: tuple | None = None  # block_size: per sequence that boundary's offset in the call's tokens


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
    drafter: RankSpec | None = None  # the path's drafter: its path, weights, pool and calls (run after the target)


def run_spec_on_rank(case: RankSpec) -> dict:
    """Rank function (for spawn): per call its outputs `y` `[1, T, hidden]` over the call's tokens,
    which of them this rank ran ('held': under CP a prefill token on one CP rank) and which every
    rank runs ('decoded': a verify call's), the scheduled slots' state after it (this rank's shard,
    one row per sequence of the call), the blocks it wrote (block_size: slot -> state, each field
    `[1, ...]`), and the slots a call changed without scheduling them: (call index, slot, field,
    max |change|). With a drafter, its run on its own pool as `drafter` (the same keys)."""
    p, device = case.placement, run_device()
    path, (module, pool) = case.path, rank_layer_and_pool(case, device)
    out, changed = [], []
    with torch.no_grad():
        for i, call in enumerate(case.calls):
            before = [t.clone() for t in pool]
            slots = torch.tensor(call.slots, dtype=torch.int64, device=device)
            T = call.x.shape[1]
            y_call, held = torch.zeros(1, T, call.x.shape[2], dtype=case.dtype), torch.zeros(T, dtype=torch.bool)
            blocks = {} if call.snapshot_slots is None else dict(snapshot_slots=call.snapshot_slots)
            if call.kind == "prefill":
                y, positions = prefill_on_rank(path.prefill, module, p, call.x, call.cu_seqlens, pool, call.slots,
                                               call.fresh, call.filler, device, case.dtype, **blocks)
            else:
                if blocks:
                    blocks["snapshot_offsets"] = call.snapshot_offsets
                y = path.verify(module, call.x.to(device, case.dtype), call.cu_seqlens.to(device), pool, slots, p)
                path.accept(module, pool, slots, torch.tensor(call.accepted, dtype=torch.int64, device=device), p,
                            **{k: torch.tensor(v, dtype=torch.int64, device=device) for k, v in blocks.items()})
                positions = torch.arange(T)
            y_call[:, positions] = y.detach().cpu().to(case.dtype)
            held[positions] = True
            rows = [t[slots] for t in pool] if path.read_state is None else path.read_state(module, pool, slots, p)
            # copies: read_state may return views of the pool (and .cpu() on a CPU copies nothing)
            states = rebuild_state(case.pool, [t.detach().to("cpu", copy=True) for t in rows])
            written = [s for s in call.snapshot_slots or () if s >= 0]  # copies, each field [1, ...]
            out.append(dict(y=y_call, held=held, decoded=held if call.kind == "verify" else torch.zeros_like(held),
                            states=states, snapshots={s: rebuild_state(case.pool, [t[s:s + 1].detach().to(
                                "cpu", copy=True) for t in pool]) for s in written}))
            scheduled = set(slots.flatten().tolist()) | set(written)
            if call.filler is not None:  # the filler's scratch slot(s): scheduled by the call
                scheduled |= set(torch.tensor(call.filler[1]).flatten().tolist())
            for slot in range(pool[0].shape[0]):
                if slot in scheduled:
                    continue
                for name, old, new in zip(case.names, before, pool):
                    if not torch.equal(old[slot], new[slot]):
                        diff = float((old[slot] - new[slot]).abs().nan_to_num(float("inf")).max())
                        changed.append((i, slot, name, diff))
    result = dict(calls=out, changed=changed)
    if case.drafter is not None:
        result["drafter"] = run_spec_on_rank(case.drafter)
    return result

