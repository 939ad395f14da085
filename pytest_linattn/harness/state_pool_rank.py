"""What a rank of the state-pool check runs: build the client's layer, load its weights, shard
the pool, then every call in order, each followed by a comparison of the live slots the call did
not schedule with their values before it (bitwise); a finishing sequence's slot is copied out as
its final state. The test process (`pytest_linattn.harness.state_pool`) judges. No pytest."""

from __future__ import annotations

import dataclasses

import torch

from .placement import Placement
from .sharded_parity_rank import load_shard, run_device

__all__ = ["PoolCall", "RankPool", "run_pool_on_rank"]


@dataclasses.dataclass(frozen=True)
class PoolCall:
    """One call: kind "prefill" or "decode"; the sequences it runs and their slots (a decode's
    padding rows' slots after the first `num_valid`); their tokens (global indices, in order); a
    prefill's `cu_seqlens` and `fresh` flags; a decode's padding inputs `[1, pads, hidden]`; the
    live slots when it runs (sequence -> slot). In prefix mode (a block size given) a prefill
    call also names each sequence's snapshot slot (where its state at the chunk's end, a block
    boundary, goes) and prefix slot (the snapshot a prefix hit starts from), and the snapshots
    (prefix blocks) taken before it, which it may not change."""

    kind: str
    sequences: tuple
    slots: tuple
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor | None
    fresh: tuple | None
    num_valid: int
    pad_x: torch.Tensor | None
    live: dict
    snapshot_slots: tuple | None = None  # prefix mode: per sequence the slot of its snapshot, -1: none
    prefix_slots: tuple | None = None  # prefix mode: per sequence the snapshot it starts from, -1: none
    blocks: dict | None = None  # prefix mode: the snapshots taken before the call, slot -> (sequence, token)


@dataclasses.dataclass(frozen=True)
class RankPool:
    """What every rank gets: the client's pool path, the placement, the replicated weights, the
    batch's input, the initial pool (replicated layout, random), the calls, the dtype, the
    state's field names."""

    path: object
    placement: Placement
    weights: dict
    x: torch.Tensor
    pool: tuple
    calls: list
    dtype: torch.dtype
    names: list


def run_pool_on_rank(case: RankPool) -> dict:
    """Rank function (for spawn): the outputs of every token, the final state of every sequence
    `[N, ...]` per field (this rank's shard), the unscheduled live slots a call changed: (call
    index, slot, sequence, field, max |change|), the snapshots as written (slot -> fields), and the
    prefix blocks a later call changed: (call index, slot, field, max |change|)."""
    p, device = case.placement, run_device()
    path, (module, pool) = case.path, rank_layer_and_pool(case, device)
    x = case.x.to(device, case.dtype)
    y_out = torch.zeros(tuple(case.x.shape), dtype=case.dtype)
    num_sequences = 1 + max(n for call in case.calls for n in call.sequences)
    final = [torch.zeros((num_sequences,) + tuple(t.shape[1:]), dtype=t.dtype) for t in pool]
    changed, snapshots, changed_blocks = [], {}, []
    with torch.no_grad():
        for i, call in enumerate(case.calls):
            before = [t.clone() for t in pool]
            slots = torch.tensor(call.slots, dtype=torch.int64, device=device)
            if call.kind == "prefill":
                fresh = torch.tensor(call.fresh, dtype=torch.bool, device=device)
                prefix = {} if call.snapshot_slots is None else dict(
                    snapshot_slots=torch.tensor(call.snapshot_slots, dtype=torch.int64, device=device),
                    prefix_slots=torch.tensor(call.prefix_slots, dtype=torch.int64, device=device))
                y = path.prefill(module, x[:, call.tokens], call.cu_seqlens.to(device), pool, slots, fresh, p,
                                 **prefix)
            else:
                x_call = torch.cat([x[:, call.tokens], call.pad_x.to(device, case.dtype)], dim=1)
                y = path.decode(module, x_call, pool, slots, call.num_valid, p)[:, :call.num_valid]
            y_out[:, call.tokens] = y.detach().cpu().to(case.dtype)
            scheduled = set(call.slots[:call.num_valid])
            for seq, slot in call.live.items():
                if slot in scheduled:
                    continue
                for name, old, new in zip(case.names, before, pool):
                    if not torch.equal(old[slot], new[slot]):
                        diff = float((old[slot] - new[slot]).abs().nan_to_num(float("inf")).max())
                        changed.append((i, slot, seq, name, diff))
            written = {s for s in call.snapshot_slots or () if s >= 0}
            for slot in sorted(call.blocks or {}):  # a prefix block: written once, then only read
                for name, old, new in zip(case.names, before, pool):
                    if slot not in written and not torch.equal(old[slot], new[slot]):
                        diff = float((old[slot] - new[slot]).abs().nan_to_num(float("inf")).max())
                        changed_blocks.append((i, slot, name, diff))
            for slot in written:
                snapshots[slot] = [t[slot].detach().cpu() for t in pool]
            for seq, slot in zip(call.sequences, call.slots):
                for f, t in zip(final, pool):  # the latest state; the last call of the sequence leaves its final one
                    f[seq] = t[slot].detach().cpu()
    return dict(y=y_out, final=rebuild_state(case.pool, final), changed=changed, snapshots=snapshots,
                changed_blocks=changed_blocks)


def rank_layer_and_pool(case, device):
    """This rank's layer (built, its shard loaded) and its shard of the case's pool, in the case's
    dtype on `device` (a state-pool or speculative-decoding case: placement, path, weights, pool)."""
    import torch.distributed as dist

    p, path = case.placement, case.path
    tp_rank = dist.get_rank() % p.tp
    module = path.layer.build(p, path.layer.process_groups(p), case.dtype, device)
    if path.layer.shard is not None:
        load_shard(module, path.layer.shard(case.weights, p, tp_rank))
    pool = case.pool if p.tp == 1 else path.shard_state(case.pool, p, tp_rank)
    return module, rebuild_state(case.pool, [t.to(device, case.dtype).clone() for t in pool])


def rebuild_state(like, fields):
    """`fields` as a state of `like`'s type (a named tuple or a tuple)."""
    return type(like)(*fields) if hasattr(like, "_fields") else type(like)(fields)
