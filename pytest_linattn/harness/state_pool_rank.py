"""What a rank of the state-pool check runs: build the client's layer, load its weights, shard
the pool (each field in its dtype: the path's `state_dtypes`, else the case's), then every call
in order, each followed by a comparison of every slot the call did not schedule with its value
before it (bitwise: live and free slots alike; the path's reserved slots, an engine's scratch,
excepted); a finishing sequence's slot is copied out as its final state. With captured steps
(the path's `capture`) each padded batch size is captured once and its decode calls replayed. Under CP a prefill call
runs this CP rank's piece of its tokens (a filler appended where they do not divide by cp:
`prefill_on_rank`), a decode call runs whole, and the pool is whole (TP-sharded) on every CP rank.
The test process (`pytest_linattn.harness.state_pool`) judges. No pytest."""

from __future__ import annotations

import dataclasses

import torch

from .continuation_rank import cp_share, rank_coordinates
from .placement import Placement
from .sharded_parity_rank import load_shard, run_device

__all__ = ["PoolCall", "RankPool", "pool_dtypes", "prefill_on_rank", "run_pool_on_rank"]

FLAGS = ("decode_rows",)  # a prefill's keywords of per-sequence flags (bool); the others hold slots or counts (int64)


@dataclasses.dataclass(frozen=True)
class PoolCall:
    """One call: kind "prefill" or "decode"; the sequences it runs and their slots (a decode's
    padding rows' slots after the first `num_valid`); their tokens (global indices, in order); a
    prefill's `cu_seqlens` and `fresh` flags; a decode's padding inputs `[1, pads, hidden]`; the
    live slots when it runs (sequence -> slot). In prefix mode (a block size given) a prefill
    call also names each sequence's snapshot slot (where its state at the chunk's end, a block
    boundary, goes) and prefix slot (the snapshot a prefix hit starts from), and the snapshots
    (prefix blocks) taken before it, which it may not change; with inner snapshots (the path's
    `inner_snapshots`) also, per sequence, the slots of the block boundaries strictly inside its
    chunk and their offsets in the chunk (tokens of the chunk before the boundary), each row
    padded with -1 to the call's most. Under CP a prefill call whose tokens do not divide by cp
    carries a filler: (its input `[1, pad, hidden]`, its scratch slot). The options of
    `pool_modes` add a prefill call's block tables and tokens computed, its decode rows (mixed
    calls) and the sequences it admits."""

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
    filler: tuple | None = None  # under CP: (input [1, pad, hidden], scratch slot) of a filler sequence
    inner_snapshot_slots: tuple | None = None  # inner snapshots: per sequence its inner boundaries' slots, -1 padded
    inner_snapshot_offsets: tuple | None = None  # inner snapshots: per sequence their offsets in the chunk, -1 padded
    block_table: tuple | None = None  # block tables: per sequence the blocks a hit's group has cached, -1 padded
    num_computed: tuple | None = None  # block tables: per sequence its tokens before the chunk
    decode_rows: tuple | None = None  # mixed calls: per sequence whether its row is a decode token
    admission: tuple | None = None  # admissions: (row, the snapshot its admission loads or -1, whether it loads)


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


def prefill_on_rank(prefill, module, placement, x, cu_seqlens, pool, slots, fresh, filler, device, dtype,
                    **slot_keywords):
    """One prefill call of a pool-mode check (the state pool's, speculative decoding's) on this
    rank: x `[1, T, hidden]` the call's tokens, slots and fresh per sequence. Under CP the filler
    (input, scratch slot), if any, goes after the call's sequences (fresh, -1 in every keyword's
    slots: no snapshot, no prefix) and the client's prefill gets this CP rank's piece of the
    tokens (`cp_share`), the boundaries, the pool and the slots whole. Returns the outputs of the
    call's own tokens this rank held and their positions in the call."""
    _, cp_rank = rank_coordinates(placement)
    num_real = x.shape[1]
    x, slots, fresh = x.to(device, dtype), list(slots), list(fresh)
    if filler is not None:
        filler_x, filler_slot = filler
        x = torch.cat([x, filler_x.to(device, dtype)], dim=1)
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + filler_x.shape[1]])
        slots.append(filler_slot)
        fresh.append(True)
        slot_keywords = {k: tuple(v) + ((False,) if k in FLAGS else (_none_like(v),)) for k, v in slot_keywords.items()}
    piece, own = cp_share(x.shape[1], num_real, placement.cp, cp_rank)
    keywords = {k: torch.tensor(v, dtype=torch.bool if k in FLAGS else torch.int64, device=device)
                for k, v in slot_keywords.items()}
    y = prefill(module, x[:, piece], cu_seqlens.to(device), pool, torch.tensor(slots, dtype=torch.int64, device=device),
                torch.tensor(fresh, dtype=torch.bool, device=device), placement, **keywords)
    return y[:, own.to(y.device)], torch.arange(x.shape[1])[piece][own]


def _none_like(rows):
    """A filler's entry in a keyword of per-sequence slots: -1, or a row of -1 where each
    sequence has a row (inner snapshots `[N, B]`)."""
    return tuple(-1 for _ in rows[0]) if rows and isinstance(rows[0], (tuple, list)) else -1


def call_keywords(call) -> dict:
    """A prefill call's prefix-mode keywords for the client's prefill (none outside prefix mode):
    snapshot_slots and prefix_slots, and with inner snapshots inner_snapshot_slots and
    inner_snapshot_offsets."""
    keywords = {}
    if call.decode_rows is not None:
        keywords.update(decode_rows=call.decode_rows)
    if call.snapshot_slots is None:
        return keywords
    if call.block_table is not None:  # the client maps tokens to blocks itself: no prefix slots handed
        return dict(keywords, snapshot_slots=call.snapshot_slots, block_table=call.block_table,
                    num_computed_tokens=call.num_computed)
    keywords.update(snapshot_slots=call.snapshot_slots, prefix_slots=call.prefix_slots)
    if call.inner_snapshot_slots is not None:
        keywords.update(inner_snapshot_slots=call.inner_snapshot_slots,
                        inner_snapshot_offsets=call.inner_snapshot_offsets)
    return keywords


def written_snapshots(call) -> set:
    """The snapshot slots a prefill call writes: its chunk-end snapshots and its inner ones."""
    inner = [s for row in call.inner_snapshot_slots or () for s in row]
    return {s for s in (*(call.snapshot_slots or ()), *inner) if s >= 0}


def run_pool_on_rank(case: RankPool) -> dict:
    """Rank function (for spawn): the outputs of the tokens this rank ran and which ('held'; under
    CP a prefill token on one CP rank, 'decoded' ones on every rank), the final state of every
    sequence `[N, ...]` per field (this rank's shard, in the pool's dtypes), the unscheduled slots
    a call changed: (call index, slot, sequence or None for a free slot, field, max |change|),
    the snapshots as written (slot -> fields, copies), and the prefix blocks a later call
    changed: (call index, slot, field, max |change|)."""
    p, device = case.placement, run_device()
    path, (module, pool) = case.path, rank_layer_and_pool(case, device)
    x = case.x.to(device, case.dtype)
    T = case.x.shape[1]
    y_out = torch.zeros(tuple(case.x.shape), dtype=case.dtype)
    held, decoded = (torch.zeros(T, dtype=torch.bool) for _ in range(2))
    num_sequences = 1 + max(n for call in case.calls for n in call.sequences)
    final = [torch.zeros((num_sequences,) + tuple(t.shape[1:]), dtype=t.dtype) for t in pool]
    changed, snapshots, changed_blocks = [], {}, []
    reserved = set(getattr(path, "reserved_slots", ()))  # the engine's scratch: may change in any call
    replays = {}  # captured steps: batch size -> the client's replay
    with torch.no_grad():
        for i, call in enumerate(case.calls):
            before = [t.clone() for t in pool]
            slots = torch.tensor(call.slots, dtype=torch.int64, device=device)
            if call.kind == "prefill":
                if call.admission:  # the sequences this call admits: their slots, what each admission loads
                    rows, loads, loaded = zip(*call.admission)
                    path.admit(module, pool, slots[list(rows)], torch.tensor(loads, dtype=torch.int64, device=device),
                               torch.tensor(loaded, dtype=torch.bool, device=device), p)
                prefix = call_keywords(call)
                y, positions = prefill_on_rank(path.prefill, module, p, x[:, call.tokens], call.cu_seqlens, pool,
                                               call.slots, call.fresh, call.filler, device, case.dtype, **prefix)
                tokens = call.tokens[positions]
            else:
                x_call = torch.cat([x[:, call.tokens], call.pad_x.to(device, case.dtype)], dim=1)
                if path.capture is not None:  # captured steps: one replay per padded batch size
                    if x_call.shape[1] not in replays:
                        replays[x_call.shape[1]] = path.capture(module, pool, x_call.shape[1], p)
                    y = replays[x_call.shape[1]](x_call, slots, call.num_valid)
                else:
                    y = path.decode(module, x_call, pool, slots, call.num_valid, p)
                y = y[:, :call.num_valid]
                tokens = call.tokens
                decoded[tokens] = True
            y_out[:, tokens] = y.detach().cpu().to(case.dtype)
            held[tokens] = True
            written = written_snapshots(call)
            scheduled = set(call.slots[:call.num_valid]) | written | set(call.blocks or ()) | reserved
            if call.filler is not None:  # the CP filler's scratch slot: the call's
                scheduled.add(call.filler[1])
            holder = {slot: seq for seq, slot in call.live.items()}
            for slot in range(pool[0].shape[0]):  # live and free alike: a write through -1 lands in the last
                if slot in scheduled:
                    continue
                for name, old, new in zip(case.names, before, pool):
                    if not torch.equal(old[slot], new[slot]):
                        diff = float((old[slot] - new[slot]).abs().nan_to_num(float("inf")).max())
                        changed.append((i, slot, holder.get(slot), name, diff))
            for slot in sorted(call.blocks or {}):  # a prefix block: written once, then only read
                for name, old, new in zip(case.names, before, pool):
                    if slot not in written and not torch.equal(old[slot], new[slot]):
                        diff = float((old[slot] - new[slot]).abs().nan_to_num(float("inf")).max())
                        changed_blocks.append((i, slot, name, diff))
            for slot in written:  # copies: t[slot] is a view of the pool, and .cpu() on a CPU no copy
                snapshots[slot] = [t[slot].detach().to("cpu", copy=True) for t in pool]
            for seq, slot in zip(call.sequences, call.slots):
                for f, t in zip(final, pool):  # the latest state; the last call of the sequence leaves its final one
                    f[seq] = t[slot].detach().cpu()
    return dict(y=y_out, held=held, decoded=decoded, final=rebuild_state(case.pool, final), changed=changed,
                snapshots=snapshots, changed_blocks=changed_blocks)


def rank_layer_and_pool(case, device):
    """This rank's layer (built, its shard loaded) and its shard of the case's pool (whole on every
    CP rank) on `device`, each field in its dtype: the path's `state_dtypes` where it names the
    field, else the case's dtype (a state-pool or speculative-decoding case: placement, path,
    weights, pool, dtype, names)."""
    p, path = case.placement, case.path
    tp_rank, _ = rank_coordinates(p)
    module = path.layer.build(p, path.layer.process_groups(p), case.dtype, device)
    if path.layer.shard is not None:
        load_shard(module, path.layer.shard(case.weights, p, tp_rank))
    pool = case.pool if p.tp == 1 else path.shard_state(case.pool, p, tp_rank)
    dtypes = pool_dtypes(path, case.names, case.dtype)
    return module, rebuild_state(case.pool, [t.to(device, d).clone() for t, d in zip(pool, dtypes)])


def pool_dtypes(path, names, dtype) -> list:
    """Each state field's pool dtype: the path's `state_dtypes[name]`, else `dtype` (the ranks')."""
    declared = getattr(path, "state_dtypes", None) or {}
    return [declared.get(name, dtype) for name in names]


def rebuild_state(like, fields):
    """`fields` as a state of `like`'s type (a named tuple or a tuple)."""
    return type(like)(*fields) if hasattr(like, "_fields") else type(like)(fields)
