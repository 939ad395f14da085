"""The serving modes' schedules and their words (the state pool's, shared by speculative decoding
and padded batches): which placements the modes take, CP fillers, the state pool's call schedule
(admission around reserved slots, padded decode calls and where their padding rows point, prefix
snapshots at chunk ends or inside chunks too, prefix hits), the fill of the slots no sequence
holds, the paths' `state_dtypes` rule and how a report names a call and a rank.
pytest_linattn.harness.state_pool's docstring says what the schedule does. This module imports no
pytest."""
from __future__ import annotations

import dataclasses

import torch

from linattn.checks import positive_int

from .continuation_plans import cp_filler
from .placement import Placement, check_one_stage
from .state_pool_rank import PoolCall

__all__ = ["CAPTURE_SIZES", "FREE_FILL", "PAD_TARGETS", "SENTINEL", "check_hits_served", "check_pool_placements",
           "check_prefix_hits", "check_state_dtype_names", "check_state_dtypes", "chunk_of", "describe_call",
           "describe_fillers", "free_fill", "pool_schedule", "rank_note", "sequence_slots", "snapshots_of",
           "with_cp_fillers"]

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)  # decode batch sizes a graph is captured for
PAD_TARGETS = ("sentinel", "slot 0", "free slot")  # what padding rows point at, in turn (padding_slot None)
SENTINEL = -1
FREE_FILL = 1024.0  # the slots no sequence holds start at +-(FREE_FILL + |randn|): finite in bf16 and fp16


def free_fill(values: torch.Tensor) -> torch.Tensor:
    """Random `values` moved away from zero: +-(FREE_FILL + |v|), the sign of v (+ for 0). The fill
    of the slots no sequence holds: never zero, never NaN (NaN would fail a bitwise comparison
    with itself), and large, so a write there stands out in a report."""
    return torch.where(values < 0, -1.0, 1.0).to(values.dtype) * (FREE_FILL + values.abs())


def sequence_slots(count: int, reserved_slots=()) -> list[int]:
    """The first `count` slot indices that are not reserved: where the sequences live."""
    slots, s = [], 0
    while len(slots) < count:
        if s not in reserved_slots:
            slots.append(s)
        s += 1
    return slots


def check_pool_placements(placements, path, mode: str, state_fields=("shard_state", "unshard_state")) -> list:
    """`placements` as a list, for a serving mode (`mode`: its name in the message): ValueError
    naming the rule a placement breaks. The serving modes run TP, CP in the contiguous layout (a
    prefill call cut in contiguous pieces over the CP ranks, `continuation_rank.cp_share`) and TP x
    CP, without sequence parallel; tp > 1 needs the path's `state_fields`."""
    placements = list(placements)
    if not placements:
        raise ValueError("placements must be a non-empty sequence of Placement")
    for p in placements:
        if not isinstance(p, Placement):
            raise ValueError(f"placements must be Placements, got {p!r}")
        check_one_stage(p, mode)
        if p.sequence_parallel or (p.cp > 1 and p.cp_layout != "contiguous"):
            raise ValueError(f"placements: {mode} runs TP, CP in the contiguous layout (each prefill call cut in "
                             f"contiguous pieces over the CP ranks) and TP x CP, without sequence parallel; got "
                             f"{p.name} (cp_layout {p.cp_layout!r}, sequence_parallel {p.sequence_parallel})")
        if p.tp > 1 and any(getattr(path, f) is None for f in state_fields):
            raise ValueError(f"placement {p.name}: tp > 1 needs {type(path).__name__}."
                             + " and ".join(state_fields))
    return placements


def check_state_dtypes(state_dtypes, owner: str):
    """A path's `state_dtypes` as a dict {field name: floating-point torch.dtype}, or None (every
    field in the ranks' dtype); ValueError naming the rule otherwise."""
    if state_dtypes is None:
        return None
    if not (isinstance(state_dtypes, dict) and all(isinstance(k, str) and isinstance(v, torch.dtype)
                                                   and v.is_floating_point for k, v in state_dtypes.items())):
        raise ValueError(f"{owner}.state_dtypes must map field names to floating-point torch.dtypes (the pool's dtype "
                         f"of each field named, e.g. {{'recurrent': torch.float32}}), got {state_dtypes!r}")
    return dict(state_dtypes)


def check_state_dtype_names(path, names) -> None:
    """ValueError where the path's `state_dtypes` names a field the state does not have."""
    for name in path.state_dtypes or {}:
        if name not in names:
            raise ValueError(f"{type(path).__name__}.state_dtypes names field {name!r}; the state's fields are "
                             f"{list(names)}")


def with_cp_fillers(calls, cp: int, hidden_size: int, gen, slot: int) -> list:
    """`calls` for a CP placement: every prefill call whose tokens (cu_seqlens[-1]) do not divide by
    cp gets a filler sequence (`continuation_plans.cp_filler`: random input, drawn from `gen`),
    fresh, in scratch slot `slot`; the other calls unchanged. For the state pool's and speculative
    decoding's calls (a `filler` field)."""
    placed = []
    for call in calls:
        filler = cp_filler(int(call.cu_seqlens[-1]), cp, hidden_size, gen) if call.kind == "prefill" else None
        placed.append(call if filler is None else dataclasses.replace(call, filler=(filler[0], slot)))
    return placed


def rank_note(p, t_rank, c, whole) -> str:
    """' (tp_rank1, cp_rank0)': the rank whose result a report line judges ('' for one rank). A
    prefill call's CP rank (the one holding the token) goes unnamed; a whole call's (`whole`: a
    decode or verify call, run on every CP rank) is named."""
    words = ([f"tp_rank{t_rank}"] if p.tp > 1 else []) + ([f"cp_rank{c}"] if p.cp > 1 and whole else [])
    return f" ({', '.join(words)})" if words else ""


def describe_fillers(calls) -> str:
    """The report's line on the CP fillers of `calls` ('' without any)."""
    fillers = [f"call {i}: {c.filler[0].shape[1]} token(s) in slot {c.filler[1]}" for i, c in enumerate(calls)
               if c.filler is not None]
    return (f"  fillers (CP: a prefill call's tokens padded to a multiple of cp, fresh, unchecked): "
            f"{'; '.join(fillers)}\n") if fillers else ""


def pool_schedule(plans, bounds, max_live, P, hidden_size, gen, capture_sizes=CAPTURE_SIZES, block_size=None,
                  prefix_hits=None, *, padding_slot=None, reserved_slots=(), inner_snapshots=False, block_tables=False,
                  group_hits=None, mixed_calls=False, admission=False, rejected_hits=None) -> list[PoolCall]:
    """The calls in order (module docstring): each step one prefill call, then one padded decode
    call. The pool's slots 0..P-1 less `reserved_slots` are the sequences' (the lowest free one
    first); a reserved slot is never given to a sequence. Padding rows point at `padding_slot`:
    -1, 0 (or another reserved slot), "free" (the lowest free slot), or None: the sentinel -1,
    slot 0 and the lowest free slot in turn (-1 where none is free: a full pool). Prefix mode:
    snapshot slots from P on, one per chunk ending on a block boundary; a prefix hit's first chunk
    waits for the snapshot it starts from (ValueError naming prefix_hits where no call writes it).
    `inner_snapshots` (prefix mode): also a snapshot slot per block boundary strictly inside a
    chunk, in token order (the call's `inner_snapshot_slots` and `inner_snapshot_offsets`);
    ValueError where no chunk crosses one (the option would check nothing). The options of
    `pool_modes` (block tables, per-group hit lengths, mixed calls, admissions and rejected loads)
    as its docstring says."""
    if inner_snapshots and not block_size:
        raise ValueError("inner_snapshots needs block_size (snapshots at the block boundaries inside a chunk)")
    waiting, live, done = list(range(len(plans))), {}, {}
    free = [s for s in range(P) if s not in reserved_slots]
    progress = {n: 0 for n in range(len(plans))}  # work items done: chunks, then decode tokens
    calls, pads = [], 0
    hits, groups, rejected = prefix_hits or {}, group_hits or {}, rejected_hits or {}
    restored = {n: hits[n][1] if n in hits else 0 for n in range(len(plans))}  # tokens a hit does not compute
    blocks = {}  # (sequence, token) -> its snapshot's slot

    def admit():
        while waiting and len(live) < max_live:
            n = waiting.pop(0)
            live[n] = free.pop(0)
            free.sort()

    def ready(n):  # a prefix hit (or a rejected load) waits for the snapshots it reads
        needs = [tuple(hits[n])] if n in hits else [tuple(rejected[n])] if n in rejected else []
        if n in groups:
            needs.append((hits[n][0], groups[n]))
        return progress[n] > 0 or all(b in blocks for b in needs)

    admit()
    while live:
        prefill = [n for n in sorted(live) if progress[n] < len(plans[n].chunks) and ready(n)]
        decoding = [n for n in sorted(live) if n not in prefill
                    and len(plans[n].chunks) <= progress[n] < len(plans[n].chunks) + plans[n].decode]
        mixed = decoding if mixed_calls and prefill else []  # decode rows in the prefill call, after its rows
        if prefill:
            tokens, lengths, snapshot, prefix, inner, table, computed = [], [], [], [], [], [], []
            taken = {slot: key for key, slot in blocks.items()}
            for n in prefill:
                k = progress[n]
                start = restored[n] + sum(plans[n].chunks[:k])
                end = start + plans[n].chunks[k]
                tokens.append(torch.arange(bounds[n] + start, bounds[n] + end))
                lengths.append(plans[n].chunks[k])
                prefix.append(blocks[tuple(hits[n])] if k == 0 and n in hits else -1)
                computed.append(start)
                table.append(block_table_row(blocks, hits[n][0], groups.get(n, hits[n][1]), block_size)
                             if k == 0 and n in hits and block_tables else [])
                inner.append([])
                if inner_snapshots:  # the block boundaries strictly inside the chunk, in order
                    for b in range(start - start % block_size + block_size, end, block_size):
                        blocks[(n, b)] = P + len(blocks)
                        inner[-1].append((blocks[(n, b)], b - start))
                snapshot.append(-1)
                if block_size and end % block_size == 0:
                    snapshot[-1] = blocks[(n, end)] = P + len(blocks)
            for n in mixed:  # a decode row: the sequence's next token, from its slot
                t = restored[n] + sum(plans[n].chunks) + progress[n] - len(plans[n].chunks)
                tokens.append(torch.tensor([bounds[n] + t]))
                lengths.append(1)
                prefix.append(-1)
                snapshot.append(-1)
                computed.append(t)
                table.append([])
                inner.append([])
            rows = prefill + mixed
            width = max(map(len, inner))
            padded = [row + [(-1, -1)] * (width - len(row)) for row in inner]
            options = {}
            if inner_snapshots:
                options.update(inner_snapshot_slots=tuple(tuple(s for s, _ in r) for r in padded),
                               inner_snapshot_offsets=tuple(tuple(o for _, o in r) for r in padded))
            if block_tables:
                columns = max(1, max(map(len, table)))
                options.update(block_table=tuple(tuple(r) + (-1,) * (columns - len(r)) for r in table),
                               num_computed=tuple(computed))
            if mixed_calls:
                options.update(decode_rows=tuple(n in mixed for n in rows))
            if admission:  # each sequence's first call admits it: the snapshot its admission loads, whether it does
                options.update(admission=tuple(
                    (k, blocks[tuple(hits[n])] if n in hits else blocks[tuple(rejected[n])] if n in rejected else -1,
                     n not in rejected) for k, n in enumerate(prefill) if progress[n] == 0))
            calls.append(PoolCall("prefill", tuple(rows), tuple(live[n] for n in rows), torch.cat(tokens),
                                  torch.tensor([0] + lengths).cumsum(0).to(torch.int32),
                                  tuple(progress[n] == 0 and n not in hits and n not in mixed for n in rows),
                                  len(rows), None, dict(live),
                                  *((tuple(snapshot), tuple(prefix), taken) if block_size else ()), **options))
        if decoding and not mixed:
            size = next((c for c in capture_sizes if c >= len(decoding)), len(decoding))
            slots = [live[n] for n in decoding]
            for _ in range(size - len(decoding)):
                if padding_slot == "free":
                    if not free:
                        raise ValueError(f"padding_slot 'free': a decode call of sequences {decoding} pads while no "
                                         f"slot is free (slots {sorted(live.values())} live): the pool needs a spare")
                    slots.append(free[0])
                elif padding_slot is not None:
                    slots.append(padding_slot)
                else:
                    target = PAD_TARGETS[pads % len(PAD_TARGETS)]
                    pads += 1
                    slots.append(0 if target == "slot 0" else free[0] if target == "free slot" and free
                                 else SENTINEL)
            tokens = torch.tensor([bounds[n] + restored[n] + sum(plans[n].chunks) + progress[n] - len(plans[n].chunks)
                                   for n in decoding])
            pad_x = torch.randn(1, size - len(decoding), hidden_size, generator=gen, dtype=torch.float64)
            calls.append(PoolCall("decode", tuple(decoding), tuple(slots), tokens, None, None, len(decoding), pad_x,
                                  dict(live)))
        if not prefill and not decoding:  # every live sequence a hit waiting for a snapshot no call writes
            n = min(live)
            m, t = hits[n] if n in hits else rejected[n]
            raise ValueError(f"{'prefix_hits' if n in hits else 'rejected_hits'}[{n}] = ({m}, {t}): sequence {n} "
                             f"waits for the snapshot of sequence {m} at token {t}"
                             + (f" (and at token {groups[n]}, group_hits)" if n in groups else "")
                             + f", which no prefill call writes (sequence {m}'s snapshots: tokens "
                             f"{sorted(b for s, b in blocks if s == m)}); a hit starts from a snapshot an earlier "
                             f"call wrote")
        for n in prefill + decoding:
            progress[n] += 1
        for n in [n for n in live if progress[n] == len(plans[n].chunks) + plans[n].decode]:
            done[n] = live.pop(n)
            free.append(done[n])
            free.sort()
        admit()
    if inner_snapshots and not any(s >= 0 for c in calls if c.kind == "prefill" for r in c.inner_snapshot_slots
                                   for s in r):
        raise ValueError(f"inner_snapshots: no prefill chunk of these plans crosses a multiple of block_size "
                         f"{block_size} strictly inside it (every chunk: {[list(pl.chunks) for pl in plans]}), so the "
                         f"option checks nothing here; give a chunk that crosses a block boundary, or leave it off")
    if mixed_calls and not any(c.decode_rows and any(c.decode_rows) and not all(c.decode_rows) for c in calls):
        raise ValueError(f"StatePoolPath.mixed_calls: no prefill call of these plans runs beside a decode row (every "
                         f"plan: {[str(pl) for pl in plans]}), so the option checks nothing here; give a sequence "
                         f"that decodes while another prefills, or leave it off")
    return calls


def block_table_row(blocks, m, cached, block_size) -> list[int]:
    """A prefix hit's block table (block-table mode): the slots of sequence m's snapshots at every
    block boundary up to `cached` tokens (the layer group's own hit length), -1 where m took none."""
    return [blocks.get((m, block_size * (i + 1)), -1) for i in range(cached // block_size)]


def check_hits_served(calls, hits) -> None:
    """ValueError naming prefix_hits where a hit's first call does not start from its snapshot,
    written by an earlier call (a prefix block of the call): a hit that restores nothing checks
    nothing. By construction of `pool_schedule` it holds; this says so where it would not."""
    for n, (m, t) in hits.items():
        first = next((c for c in calls if c.kind == "prefill" and n in c.sequences), None)
        k = first.sequences.index(n) if first is not None else None
        slot = first.prefix_slots[k] if first is not None and first.prefix_slots is not None else -1
        if slot < 0 or (first.blocks or {}).get(slot) != (m, t):
            raise ValueError(f"prefix_hits[{n}] = ({m}, {t}): sequence {n}'s first prefill call does not start from "
                             f"the snapshot of sequence {m} at token {t} written by an earlier call (its prefix slot "
                             f"{slot}); a hit that restores no snapshot checks nothing")


def describe_call(i, call) -> str:
    if call.kind == "prefill":
        extra = ""
        if call.snapshot_slots is not None and any(s >= 0 for s in call.snapshot_slots):
            extra += f", snapshots to slots {list(call.snapshot_slots)}"
        if call.inner_snapshot_slots is not None and any(s >= 0 for r in call.inner_snapshot_slots for s in r):
            extra += f", inner snapshots to slots {[list(r) for r in call.inner_snapshot_slots]}"
        if call.block_table is not None and any(s >= 0 for r in call.block_table for s in r):
            extra += (f", block tables {[list(r) for r in call.block_table]} resuming at tokens "
                      f"{list(call.num_computed)}")
        elif call.prefix_slots is not None and any(s >= 0 for s in call.prefix_slots):
            extra += f", from prefix slots {list(call.prefix_slots)}"
        rows = [k for k, d in enumerate(call.decode_rows or ()) if d]
        if rows:  # a mixed call: its decode rows, after its prefill rows
            extra += f", decode rows of sequences {[call.sequences[k] for k in rows]}"
        if call.admission:
            extra += f", admitting sequences {[call.sequences[k] for k, _, _ in call.admission]}"
            loads = [(call.sequences[k], s, ok) for k, s, ok in call.admission if s >= 0]
            if loads:
                extra += " (loads: " + ", ".join(f"sequence {n} from slot {s}" + ("" if ok else ", rejected")
                                                  for n, s, ok in loads) + ")"
        return f"call {i} (prefill of sequences {list(call.sequences)} in slots {list(call.slots)}{extra})"
    rows = list(call.slots[call.num_valid:])
    return (f"call {i} (decode of sequences {list(call.sequences)} in slots {list(call.slots[:call.num_valid])}, "
            f"padded to {len(call.slots)} row{'s' * (len(call.slots) > 1)}"
            + (f" with padding rows at slots {rows})" if rows else ")"))


def snapshots_of(call, bounds):
    """(sequence, snapshot slot, token) of each snapshot a prefill call writes: each sequence's
    inner ones (inner snapshots: in token order), then its chunk-end one."""
    if call.snapshot_slots is None:
        return []
    cu = call.cu_seqlens.tolist()
    inner = call.inner_snapshot_slots or ((),) * len(call.sequences)
    offsets = call.inner_snapshot_offsets or ((),) * len(call.sequences)
    found = []
    for k, (seq, slot) in enumerate(zip(call.sequences, call.snapshot_slots)):
        start = int(call.tokens[cu[k]]) - bounds[seq]
        found += [(seq, s, start + o) for s, o in zip(inner[k], offsets[k]) if s >= 0]
        if slot >= 0:
            found.append((seq, slot, int(call.tokens[cu[k + 1] - 1]) + 1 - bounds[seq]))
    return found


def chunk_of(call, seq, bounds):
    """(start, end) of sequence `seq`'s chunk in prefill call `call`, in tokens of the sequence."""
    k = call.sequences.index(seq)
    cu = call.cu_seqlens.tolist()
    return int(call.tokens[cu[k]]) - bounds[seq], int(call.tokens[cu[k + 1] - 1]) + 1 - bounds[seq]


def check_prefix_hits(block_size, prefix_hits, plans, bounds, inner_snapshots=False) -> dict:
    """prefix_hits as {n: (m, tokens)}, each hit starting from a snapshot that sequence m takes:
    where a chunk of m ends on a block boundary, or (`inner_snapshots`) at any block boundary
    of m's chunks."""
    if block_size is None:
        if prefix_hits:
            raise ValueError("prefix_hits needs block_size (a hit starts from a snapshot at a block boundary)")
        if inner_snapshots:
            raise ValueError("inner_snapshots needs block_size (snapshots at the block boundaries inside a chunk)")
        return {}
    positive_int(block_size, "block_size")
    hits = {}
    for n, hit in dict(prefix_hits or {}).items():
        if not (isinstance(hit, tuple) and len(hit) == 2 and all(isinstance(v, int) for v in hit)):
            raise ValueError(f"prefix_hits[{n}] must be (sequence, tokens), got {hit!r}")
        m, tokens = hit
        ends = [sum(plans[m].chunks[:k + 1]) for k in range(len(plans[m].chunks))] if 0 <= m < len(plans) else []
        if not (isinstance(n, int) and 0 <= m < n < len(plans)):
            raise ValueError(f"prefix_hits: sequence {n} may start from an earlier sequence's snapshot only "
                             f"(0 <= m < n < {len(plans)}), got {n}: {hit}")
        if inner_snapshots:
            boundaries = list(range(block_size, (ends[-1] if ends else 0) + 1, block_size))
            if m in dict(prefix_hits) or tokens not in boundaries or tokens >= bounds[n + 1] - bounds[n]:
                raise ValueError(f"prefix_hits[{n}] = ({m}, {tokens}): with inner_snapshots tokens must be a block "
                                 f"boundary of sequence {m}'s chunks (not itself a hit; multiples of block_size "
                                 f"{block_size} up to its prefilled {ends[-1] if ends else 0} tokens: {boundaries}), "
                                 f"shorter than sequence {n}")
        elif m in dict(prefix_hits) or tokens not in ends or tokens % block_size or tokens >= bounds[n + 1] - bounds[n]:
            raise ValueError(f"prefix_hits[{n}] = ({m}, {tokens}): tokens must be where a prefill chunk of sequence "
                             f"{m} (not itself a hit) ends on a multiple of block_size {block_size} (its chunks end "
                             f"at {ends}), shorter than sequence {n}")
        hits[n] = (m, tokens)
    return hits
