"""The speculative-decoding check's judge (`pytest_linattn.harness.spec_decode`): every call's outputs
and scheduled slots against the float64 serial run, every other slot bitwise unchanged, and the
report's words (the call, the slot, the sequence, the token, the field). The same judge reads a
drafter's run on its own pool (`spec_drafter`), its lines saying so. No pytest.
"""

from __future__ import annotations

import math

import torch

from .continuation_report import cp_view
from .serving_plans import describe_fillers, rank_note

__all__ = ["MAX_LISTED", "call_drafts", "check_spec_calls", "describe_call"]

MAX_LISTED = 8  # failures listed per kind; the first (earliest call) is where it went wrong


def describe_call(i, call, K) -> str:
    """K: (num_draft, 1 with a bonus token else 0)."""
    if call.kind == "prefill":
        return (f"call {i} (prefill chunk {call.index + 1} of sequences {list(call.sequences)} in slots "
                f"{list(call.slots)})")
    num_draft, b = K
    drafts = call_drafts(call, K)
    said = (f"{num_draft} drafts each" if set(drafts) == {num_draft} else f"drafts {drafts} (mixed)"
            if 0 in drafts else f"drafts {drafts}")
    return (f"call {i} (verify round {call.index + 1}: {'the next token and ' if b else ''}{said} of "
            f"sequences {list(call.sequences)} in slots {list(call.slots)}, accepted {[a - b for a in call.accepted]})")


def call_drafts(call, K) -> list[int]:
    """Each row's drafts in a verify call: its tokens less the bonus token."""
    return [int(n) - K[1] for n in call.cu_seqlens.diff().tolist()]


def check_spec_calls(label, p, path, plans, calls, expected, results, rtol, K, names, blocks=([], [], ()),
                     who="") -> str:
    """The report ('' where all is right). blocks: (wrong blocks, blocks changed after their call, the
    block slots) of `spec_blocks`. who: '' for the target's run, "the drafter's " for a drafter's
    (its outputs, states and slots named so)."""
    outputs, states, changed = [], [], list(blocks[1])
    for r, result in enumerate(results):
        for i, slot, field, diff in result["changed"]:
            if slot in blocks[2]:  # a block: said by spec_blocks
                continue
            changed.append(f"{describe_call(i, calls[i], K)} changed {who}slot {slot}, which it did not schedule: "
                           f"field {field}, max |change| {diff:.2e} (rank {r})")
    for i, (call, exp) in enumerate(zip(calls, expected)):
        cu = call.cu_seqlens.tolist()
        scale = float(torch.linalg.vector_norm(exp["y"])) / math.sqrt(exp["y"].shape[1]) or 1.0
        # a prefill call's tokens come from the CP rank that held them (judged once, on CP rank 0's
        # view); a verify call runs whole on every rank (judged on each)
        for c, t_rank in ((c, t) for c in range(p.cp if call.kind == "verify" else 1) for t in range(p.tp)):
            y = cp_view([r["calls"][i] for r in results], "y", p, t_rank, c)
            err = torch.linalg.vector_norm((y - exp["y"])[0], dim=-1) / scale
            for k, (n, slot, start) in enumerate(zip(call.sequences, call.slots, call.starts)):
                bad = torch.nonzero(~(err[cu[k]:cu[k + 1]] <= rtol)).flatten().tolist()
                if bad:
                    pos = bad[0]
                    kept = cu[k + 1] - cu[k] if call.kind == "prefill" else call.accepted[k]
                    what = (f"token {start + pos}" if pos < kept else
                            f"draft {pos + 1 - K[1]} of {cu[k + 1] - cu[k] - K[1]} (rejected; after token "
                            f"{start + kept - 1})")
                    outputs.append(f"{describe_call(i, call, K)}: slot {slot}, sequence {n} ({plans[n]}), {who}{what}: "
                                   f"output error {float(err[cu[k] + pos]):.1e} of the tokens' RMS norm"
                                   + rank_note(p, t_rank, c, call.kind == "verify"))
        for c in range(p.cp):  # the pool is whole on every CP rank: each rank's slots
            per_rank = [results[t + p.tp * c]["calls"][i]["states"] for t in range(p.tp)]
            got = per_rank[0] if p.tp == 1 else path.unshard_state(per_rank, p)
            for k, (n, slot, start) in enumerate(zip(call.sequences, call.slots, call.starts)):
                kept = cu[k + 1] - cu[k] if call.kind == "prefill" else call.accepted[k]
                for field, a, e in zip(names, got, exp["states"]):
                    err = float(torch.linalg.vector_norm(a[k].double() - e[k])) / (
                        float(torch.linalg.vector_norm(e[k])) or 1.0)
                    if not err <= rtol:
                        after = f"after token {start + kept - 1}" if start + kept else "before its first token (zeros)"
                        how = ("" if call.kind == "prefill" else
                               f", {kept - K[1]} of {cu[k + 1] - cu[k] - K[1]} drafts accepted")
                        states.append(f"{describe_call(i, call, K)}: slot {slot}, sequence {n} ({plans[n]}), "
                                      f"{who}state {after}{how}: field {field} error {err:.1e}"
                                      + (f" (cp_rank{c})" if p.cp > 1 else ""))
    if not (outputs or states or changed or blocks[0]):
        return ""
    parts = [f"spec-decode parity failed for {label}: {len(outputs)} wrong output(s), {len(states)} wrong state(s), "
             + (f"{len(blocks[0])} wrong block(s), " if blocks[0] else "")
             + f"{len(changed)} unscheduled slot change(s)" + (f"\n{describe_fillers(calls).rstrip()}"
                                                              if describe_fillers(calls) else "")]
    for title, found in (("first wrong outputs (by call)", outputs), ("first wrong states (by call)", states),
                         ("first wrong blocks (by call)", blocks[0]),
                         ("slots changed without being scheduled", changed)):
        if found:
            parts.append(f"{title}:\n" + "\n".join(f"  {f}" for f in found[:MAX_LISTED])
                         + (f"\n  ... and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""))
    return "\n".join(parts)
