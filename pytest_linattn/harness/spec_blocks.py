"""Block boundaries in the speculative-decoding check (`assert_spec_decode_parity(block_size=B)`):
an engine with prefix caching keeps each sequence's state at every multiple of B tokens it
commits in a block of its own (vLLM's align mode with MTP: the running state migrates into a new
block as the sequence crosses a boundary, the block left behind keeping the state there). Where a
prefill chunk ends on a boundary, or a verify round's committed tokens (the bonus token and the
accepted drafts) reach one, the call gets the boundary's block: the prefill a keyword
`snapshot_slots` `[N]` (as the state pool's prefix mode), the accept two, `snapshot_slots` `[N]`
and `snapshot_offsets` `[N]` (the boundary's offset in the call's tokens: the state after the
call's first `offset` tokens; -1 for none). Each block must hold the float64 serial state at its
boundary after the call that wrote it, and no later call may change it; the committed state after
every round is checked as always.

The plans must exercise it: chunks are kept block-aligned (a chunk crossing a boundary inside it
is refused), a round commits at most one boundary (num_draft plus the bonus token at most B), and
at least one verify round's acceptance must land exactly on a boundary (the case where the
committed state and the boundary's block are the same state; refused otherwise: the option would
not reach it). This module imports no pytest.
"""

from __future__ import annotations

import dataclasses

import torch

from linattn.checks import positive_int

__all__ = ["check_block_plans", "check_spec_snapshots", "landed", "with_block_snapshots"]


def check_block_plans(plans, num_draft, bonus_token, block_size) -> None:
    """ValueError naming the rule a block-mode plan breaks (module docstring)."""
    positive_int(block_size, "block_size")
    b = int(bonus_token)
    if num_draft + b > block_size:
        raise ValueError(f"block_size {block_size}: a verify round commits up to num_draft ({num_draft})"
                         + (" + the bonus token" if b else "") + " tokens, which must not exceed block_size (a "
                         "round reaches at most one block boundary)")
    for n, pl in enumerate(plans):
        start = 0
        for k, size in enumerate(pl.chunks):
            boundary = (start // block_size + 1) * block_size
            if start + size > boundary:
                raise ValueError(f"plans[{n}].chunks[{k}] covers tokens {start}..{start + size - 1}, crossing the "
                                 f"block boundary at {boundary} inside it; with block_size the chunks are kept "
                                 f"block-aligned (vLLM's align mode): cut it there")
            start += size
    if not any(landed(pl, block_size, b) for pl in plans):
        raise ValueError(f"block_size {block_size}: no verify round of these plans lands exactly on a block boundary "
                         f"(committed tokens a multiple of {block_size} after the round: "
                         f"{[list(committed(pl, b)) for pl in plans]}), so the check would not reach it; script the "
                         f"acceptance so that one does")


def committed(plan, bonus) -> list[int]:
    """The plan's committed tokens after each verify round."""
    done, out = sum(plan.chunks), []
    for j in plan.accepted:
        done += bonus + j
        out.append(done)
    return out


def landed(plan, block_size, bonus) -> list[int]:
    """The verify rounds (0-based) of `plan` whose committed tokens end exactly on a block boundary,
    having committed at least one token."""
    before = [sum(plan.chunks)] + committed(plan, bonus)[:-1]
    return [r for r, (a, c) in enumerate(zip(before, committed(plan, bonus))) if c > a and c % block_size == 0]


def with_block_snapshots(calls, block_size, first_slot) -> tuple[list, dict]:
    """`calls` with each one's `snapshot_slots` and `snapshot_offsets` (a slot from `first_slot` on
    per boundary a sequence's committed tokens reach in the call), and the snapshots: slot ->
    (call index, sequence, token)."""
    snapshots, placed = {}, []
    for i, call in enumerate(calls):
        cu = call.cu_seqlens.tolist()
        slots, offsets = [], []
        for k, (n, start) in enumerate(zip(call.sequences, call.starts)):
            kept = cu[k + 1] - cu[k] if call.kind == "prefill" else call.accepted[k]
            boundary = (start // block_size + 1) * block_size
            if boundary <= start + kept:
                slot = first_slot + len(snapshots)
                snapshots[slot] = (i, n, boundary)
                slots.append(slot)
                offsets.append(boundary - start)
            else:
                slots.append(-1)
                offsets.append(-1)
        placed.append(dataclasses.replace(call, snapshot_slots=tuple(slots), snapshot_offsets=tuple(offsets)))
    return placed, snapshots


def check_spec_snapshots(p, path, plans, calls, snapshots, results, serial_states, initial, rtol, describe,
                         names) -> tuple[list[str], list[str]]:
    """(wrong snapshots, snapshot blocks a later call changed): each block against the serial state
    at its boundary (what a wrong one holds where recognised: the slot's contents from before, or
    the serial state at another token of its sequence, the round's start named), on every rank."""
    wrong, changed = [], []
    for r, result in enumerate(results):
        for i, slot, field, diff in result["changed"]:
            if slot in snapshots:
                w, n, t = snapshots[slot]
                when = f"written by call {w}" if w < i else f"not yet written: call {w} writes it"
                changed.append(f"{describe(i, calls[i])} changed the block of sequence {n} at token {t} (slot "
                               f"{slot}, {when}): field {field}, max |change| {diff:.2e} (rank {r})")
    for slot, (i, n, t) in sorted(snapshots.items(), key=lambda item: item[1][0]):  # by call, each CP rank's
        for c in range(p.cp):
            per_rank = [results[tp + p.tp * c]["calls"][i]["snapshots"][slot] for tp in range(p.tp)]
            got = per_rank[0] if p.tp == 1 else path.unshard_state(per_rank, p)  # each field [1, ...]
            call = calls[i]
            k = call.sequences.index(n)
            start = call.starts[k]
            kept = call.cu_seqlens[k + 1] - call.cu_seqlens[k] if call.kind == "prefill" else call.accepted[k]
            where = ("the chunk's end" if call.kind == "prefill" else "where the round's acceptance landed"
                     if t == start + kept else f"inside the round's {int(kept)} committed tokens")
            for f, field in enumerate(names):
                actual, expected = got[f][0].double(), serial_states[f][n, t]
                err = _error(actual, expected)
                if not err <= rtol:
                    wrong.append(f"{describe(i, call)}: sequence {n} ({plans[n]}), the block at token {t} (a block "
                                 f"boundary, {where}) in slot {slot} is not the state there: field {field} error "
                                 f"{err:.1e}" + _held(actual, initial[f][slot], serial_states[f][n], start, rtol)
                                 + (f" (cp_rank{c})" if p.cp > 1 else ""))
    return wrong, changed


def _error(actual, expected) -> float:
    return float(torch.linalg.vector_norm(actual.double() - expected)) / (float(torch.linalg.vector_norm(expected))
                                                                          or 1.0)


def _held(actual, initial, states, start, rtol) -> str:
    """What a wrong block holds: the slot's contents from before the run (never written), or the
    serial state after token u of its sequence (the round's start named); '' otherwise."""
    if _error(actual, initial) <= rtol:
        return "; it holds the slot's contents from before (never written)"
    for u in [start] + [u for u in range(states.shape[0]) if u != start]:
        if _error(actual, states[u]) <= rtol:
            return f"; it holds the state at token {u}" + (" (the state the call started from)" if u == start else "")
    return ""
