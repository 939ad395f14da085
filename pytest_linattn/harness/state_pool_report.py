"""The state-pool check's comparisons and reports (`pytest_linattn.harness.state_pool`): a run's
outputs per token (the earliest wrong call first), its final states, the unscheduled slots a call
changed, and in prefix mode the snapshots and prefix blocks. No pytest."""

from __future__ import annotations

import bisect
import math

import torch

from ..parity import assert_parity
from .continuation_report import cp_view, field_names
from .serving_plans import chunk_of, describe_call, describe_fillers
from .state_pool_rank import rebuild_state

__all__ = ["check_pool_run", "check_snapshots"]


def check_pool_run(label, p, path, plans, bounds, calls, results, y_ref, ht_ref, rtol, prefix=(), run=None) -> str:
    failures = list(prefix)
    for r, result in enumerate(results):
        for i, slot, seq, field, diff in result["changed"]:
            change = f"field {field}, max |change| {diff:.2e} (rank {r})"
            if seq is not None:
                failures.append(f"{describe_call(i, calls[i])} changed live slot {slot} (sequence {seq}, "
                                f"{plans[seq]}), which it did not schedule: {change}")
            elif run is not None and slot in run.snapshots and run.snapshots[slot][0] < i:
                _, block_seq, t = run.snapshots[slot]
                failures.append(f"{describe_call(i, calls[i])} changed prefix block slot {slot} (the snapshot of "
                                f"sequence {block_seq} at token {t}), which it did not schedule: {change}")
            else:
                failures.append(f"{describe_call(i, calls[i])} changed free slot {slot} "
                                f"({_free_words(slot, i, calls, run)}), which it did not schedule: {change}")
    where, holders, before = {}, {}, {}  # token -> (call, slot, sequence); slot -> last sequence; sequence -> previous
    for i, call in enumerate(calls):
        for t in call.tokens.tolist():
            seq = bisect.bisect_right(bounds, t) - 1
            slot = call.slots[call.sequences.index(seq)]
            where[t] = (i, slot, seq)
            if holders.get(slot, seq) != seq:
                before[seq] = holders[slot]
            holders[slot] = seq
    scale = float(torch.linalg.vector_norm(y_ref)) / math.sqrt(y_ref.shape[1]) or 1.0

    def located(t):
        i, slot, seq = where[t]
        holder = f"held before by sequence {before[seq]}" if seq in before else "its first holder"
        return (f"sequence {seq} ({plans[seq]}) token {t - bounds[seq]}, {describe_call(i, calls[i])}, its slot "
                f"{slot} ({holder})")

    unrun = [t for t in range(y_ref.shape[1]) if t not in where]  # a prefix hit's restored tokens
    for c, t_rank in ((c, t) for c in range(p.cp) for t in range(p.tp)):
        y = cp_view(results, "y", p, t_rank, c)
        per_token = torch.linalg.vector_norm((y - y_ref)[0], dim=-1) / scale
        per_token[unrun] = 0
        if c:  # a prefill token comes from the CP rank that held it: judged once, on CP rank 0's view
            per_token[~results[t_rank + p.tp * c]["decoded"]] = 0
        bad = torch.nonzero(~(per_token <= rtol)).flatten().tolist()
        if not bad:
            continue
        firsts = {}  # each wrong sequence's first wrong token
        for t in bad:
            firsts.setdefault(where[t][2], t)
        # the headline: the earliest call that goes wrong (its first wrong token); then the lowest
        # wrong position (the earliest token of its sequence), where that is another token
        earliest = min(bad, key=lambda g: (where[g][0], g))
        lowest = min(firsts.values(), key=lambda g: (g - bounds[where[g][2]], where[g][2]))
        text = (f"output{_rank_words(p, t_rank, c)}: {len(bad)} token(s) off; first wrong token: {located(earliest)}, "
                f"error {float(per_token[earliest]):.1e} of the tokens' RMS norm")
        if lowest != earliest:
            text += (f"\n  lowest wrong position: {located(lowest)}, error {float(per_token[lowest]):.1e} of the "
                     "tokens' RMS norm")
        failures.append(text + "\n  each wrong sequence's first wrong token:\n"
                        + "\n".join(f"    {located(g)}" for g in firsts.values()))
    names = field_names(results[0]["final"])

    def describe(tensor_name, index):
        return f"sequence {index[0]} ({plans[index[0]]}), element {tuple(index[1:])}"

    for c in range(p.cp):
        states = _unshard(path, p, [results[t + p.tp * c]["final"] for t in range(p.tp)])
        try:
            assert_parity(dict(zip(names, states)), dict(zip(names, ht_ref)), rtol=rtol,
                          name=f"{label} final state (the slot when the sequence ends)"
                               + (f" on cp_rank{c}" if p.cp > 1 else ""), describe=describe, activations=False)
        except AssertionError as exc:
            failures.append(str(exc))
    if not failures:
        return ""
    return (f"state-pool parity failed for {label}: {len(failures)} failing check(s)\n"
            + (run.describe() if run is not None else "")
            + "".join(f"  {describe_call(i, c)}\n" for i, c in enumerate(calls)) + describe_fillers(calls) + "\n"
            + "\n".join(failures))


def _free_words(slot, i, calls, run) -> str:
    """What a free slot is at call i: the CP scratch slot, a snapshot slot not yet written, free
    since a sequence finished, or never held."""
    if run is not None and slot == run.scratch:
        return "the CP filler's scratch slot"
    if run is not None and slot in run.snapshots:
        _, seq, t = run.snapshots[slot]
        return f"the snapshot slot of sequence {seq} at token {t}, not yet written"
    previous = [seq for c in calls[:i] for seq, s in c.live.items() if s == slot]
    return f"free since sequence {previous[-1]} finished" if previous else "never held by a sequence"


def _rank_words(p, t_rank, c) -> str:
    """' tp_rank1 (decoded on cp_rank0)': which rank's view a report line judges ('' for one rank)."""
    return "".join([f" tp_rank{t_rank}" if p.tp > 1 else "", f" (decoded on cp_rank{c})" if p.cp > 1 else ""])


def _unshard(path, p, per_tp_rank) -> list:
    """One CP rank's states (per TP rank) as the replicated layout's fields, float64."""
    return [t.double() for t in (per_tp_rank[0] if p.tp == 1 else path.unshard_state(per_tp_rank, p))]


def check_snapshots(p, path, plans, bounds, run, results, rtol, state_at) -> list[str]:
    """The prefix blocks changed after their call, then each snapshot against the float64 state
    at its boundary (an inner snapshot named with the chunk it lies in; a wrong one also says what
    it holds where that is recognised: `_held`)."""
    calls, snapshots, expected = run.calls, run.snapshots, run.expected
    failures = []
    for r, result in enumerate(results):
        for i, slot, field, diff in result["changed_blocks"]:
            _, seq, t = snapshots[slot]
            read = calls[i].prefix_slots is not None and slot in calls[i].prefix_slots
            failures.append(f"{describe_call(i, calls[i])} changed prefix block slot {slot} (the snapshot of "
                            f"sequence {seq} at token {t})" + (", which it read from" if read else "")
                            + f": field {field}, max |change| {diff:.2e} (rank {r})")
    order = sorted(snapshots)
    like = results[0]["final"]
    names = field_names(like)
    for c in range(p.cp):  # the pool is whole on every CP rank: each rank's snapshots
        per_rank = [rebuild_state(like, [torch.stack([results[t + p.tp * c]["snapshots"][s][f] for s in order])
                                         for f in range(len(expected[order[0]]))]) for t in range(p.tp)]
        got = _unshard(path, p, per_rank)
        for k, slot in enumerate(order):
            i, seq, t = snapshots[slot]
            start, end = chunk_of(calls[i], seq, bounds)
            where = f"token {t}" if t == end else f"token {t}, inside its {end - start}-token chunk from token {start},"
            for f, (field, a, e) in enumerate(zip(names, got, expected[slot])):
                err = _error(a[k], e)
                if not err <= rtol:
                    held = (_held(a[k], e, f, run.pool[f][slot], seq, t, start, end, rtol, state_at)
                            or _held_by_another_row(a[k], f, calls[i], seq, bounds, rtol, state_at))
                    failures.append(f"{describe_call(i, calls[i])}: the snapshot of sequence {seq} ({plans[seq]}) at "
                                    f"{where} in slot {slot} is not the state there: field {field} error {err:.1e}"
                                    + held + (f" (cp_rank{c})" if p.cp > 1 else ""))
    return failures


def _error(actual, expected) -> float:
    return float(torch.linalg.vector_norm(actual.double() - expected)) / (float(torch.linalg.vector_norm(expected))
                                                                          or 1.0)


def _held(actual, expected, f, initial, seq, t, start, end, rtol, state_at) -> str:
    """What a wrong snapshot's field `f` holds, where recognised: the slot's contents before the
    run (never written), part the state and part those contents (a partial copy), or the float64
    state at another token of its chunk (published under a boundary it does not represent); ''
    otherwise."""
    if _error(actual, initial) <= rtol:
        return "; it holds the slot's contents from before (never written)"
    a, e = actual.double().flatten(), expected.double().flatten()
    copied = (a - e).abs() <= rtol * float(e.abs().max())
    kept = actual.flatten() == initial.to(actual.dtype).flatten()
    if bool((copied | kept).all()) and 0 < int(copied.sum()) < a.numel():
        return (f"; it holds a partial copy: {int(copied.sum())} of {a.numel()} elements the state's, the rest the "
                f"slot's contents from before")
    for u in [end] + list(range(max(start, 1), end)):  # the chunk's end first, then its other tokens
        if u != t and _error(actual, state_at(seq, u)[f]) <= rtol:
            return f"; it holds the state at token {u}" + (" (its chunk's end)" if u == end else "")
    return ""


def _held_by_another_row(actual, f, call, seq, bounds, rtol, state_at) -> str:
    """Where a wrong snapshot's field `f` is another row's state after the call (the state at its
    chunk's end: a row's index read off by the others, a mixed call's decode row), '; it holds
    sequence m's state at token u (...)'; '' otherwise."""
    for other in call.sequences:
        if other == seq:
            continue
        _, end = chunk_of(call, other, bounds)
        if _error(actual, state_at(other, end)[f]) <= rtol:
            decode = call.decode_rows is not None and call.decode_rows[call.sequences.index(other)]
            return (f"; it holds sequence {other}'s state at token {end} ("
                    + ("a decode row" if decode else "another row") + " of the call)")
    return ""
