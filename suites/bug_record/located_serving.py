"""Where the serving options' plants must point (`bug_record.checks_serving`): the located patterns
of their registry entries, derived from the record's plans and the checks' own schedules (the
spare pool's, which the report shows first), never read off a report.
"""

from __future__ import annotations

import re

import torch

from bug_record import checks_serving as V
from bug_record.checks import CONFIG, SEED, SPEC_DRAFTS, SPEC_PLANS
from pytest_linattn.harness.serving_plans import pool_schedule
from pytest_linattn.harness.spec_blocks import landed

WRONG_LIST = r"\n    "  # an entry of a report's "each wrong sequence's first wrong token" list


def _schedule(plans, hits, **options):
    bounds = [int(b) for b in V.cu_of(plans, hits)]
    return pool_schedule(plans, bounds, 2, 3, CONFIG.hidden_size, torch.Generator(), (4,), V.BLOCK, hits, **options)


def _first_call(calls, n):
    return next((i, c) for i, c in enumerate(calls) if c.kind == "prefill" and n in c.sequences)


def _block_hits():
    """(the hit whose group cached more, where it resumes, its group's hit), (the hit whose group agrees)."""
    n = min(V.GROUP_HITS)
    other = min(m for m in V.BLOCK_HITS if m not in V.GROUP_HITS)
    return (n, V.BLOCK_HITS[n][1], V.GROUP_HITS[n]), (other, V.BLOCK_HITS[other][1])


def restored_the_group_hit():
    """vLLM #53912's plant: the hit whose recurrent group cached more restores its group's last block
    (the report names the block its first computed token came from), and only that hit goes wrong."""
    (n, resume, group), (other, _) = _block_hits()
    i, _ = _first_call(_schedule(V.BLOCK_PLANS, V.BLOCK_HITS, block_tables=True, group_hits=V.GROUP_HITS), n)
    return (rf"\A(?![\s\S]*{WRONG_LIST}sequence {other} \()[\s\S]*?"
            + re.escape(f"call {i}: sequence {n} resumes at token {resume}, but its first computed token's output is "
                        f"the one from the block at token {group} (column {group // V.BLOCK - 1} of its block table, "
                        f"slot ") + r"\d+" + re.escape(", past where it resumes)"))


def seeded_from_the_drafter_block():
    """vLLM #55601's plant: every hit restores through the drafter's block size: the short one a later
    block, the long one a column past its table (the hit whose group agrees goes wrong too)."""
    (n, resume, _), (other, at) = _block_hits()
    calls = _schedule(V.BLOCK_PLANS, V.BLOCK_HITS, block_tables=True, group_hits=V.GROUP_HITS)
    i, _ = _first_call(calls, other)
    return (re.escape(f"first wrong token: sequence {n} ({V.BLOCK_PLANS[n]}) token {resume}, call ") + r"[\s\S]*?"
            + WRONG_LIST + re.escape(f"sequence {other} ({V.BLOCK_PLANS[other]}) token {at}, call {i} (prefill of "
                                     f"sequences [{other}] in slots ") + r"\[\d+\], block tables \[\[[\d, ]+\]\] "
            + re.escape(f"resuming at tokens [{at}])"))


def snapshot_of_a_decode_row():
    """sglang #23075's plant: the first mixed call's snapshot holds its decode row's state."""
    calls = _schedule(V.MIXED_PLANS, V.MIXED_HITS, mixed_calls=True)
    i, call = next((i, c) for i, c in enumerate(calls) if c.kind == "prefill" and any(c.decode_rows)
                   and any(s >= 0 for s in c.snapshot_slots))
    k = next(k for k, s in enumerate(call.snapshot_slots) if s >= 0)
    n, d = call.sequences[k], call.sequences[call.decode_rows.index(True)]
    cu = call.cu_seqlens.tolist()
    bounds = [int(b) for b in V.cu_of(V.MIXED_PLANS, V.MIXED_HITS)]
    end = int(call.tokens[cu[k + 1] - 1]) + 1 - bounds[n]
    decoded = int(call.tokens[cu[call.sequences.index(d) + 1] - 1]) + 1 - bounds[d]
    return (rf"call {i} \(prefill of sequences \[[\d, ]+\] in slots \[[\d, ]+\], snapshots to slots \[[-\d, ]+\], "
            rf"decode rows of sequences \[{d}\]\): "
            + re.escape(f"the snapshot of sequence {n} ({V.MIXED_PLANS[n]}) at token {end} in slot ") + r"\d+"
            + r" is not the state there: field \w+ error \S+; "
            + re.escape(f"it holds sequence {d}'s state at token {decoded} (a decode row of the call)"))


def rejected_load_read_as_loaded():
    """sglang #30986's plant: the sequence whose load was rejected goes wrong from its token 0, in
    the call that admitted it, on the slot another sequence left; the hit whose load went through is
    right."""
    n = min(V.REJECTED)
    hit = min(V.LOAD_HITS)
    calls = _schedule(V.LOAD_PLANS, V.LOAD_HITS, admission=True, rejected_hits=V.REJECTED)
    i, call = _first_call(calls, n)
    return (rf"\A(?![\s\S]*{WRONG_LIST}sequence {hit} \()[\s\S]*?"
            + re.escape(f"first wrong token: sequence {n} ({V.LOAD_PLANS[n]}) token 0, call {i} (prefill of sequences "
                        f"{list(call.sequences)} in slots {list(call.slots)}, admitting sequences [{n}] (loads: "
                        f"sequence {n} from slot ") + r"\d+" + re.escape(", rejected)), its slot ")
            + r"\d+ \(held before by sequence \d+\)")


def hit_never_restored():
    """LMCache #2863's plant: the hit whose load went through goes wrong from its first computed token
    (where it resumes), in the call that admitted it; the rejected load's sequence is right."""
    n = min(V.LOAD_HITS)
    rejected = min(V.REJECTED)
    calls = _schedule(V.LOAD_PLANS, V.LOAD_HITS, admission=True, rejected_hits=V.REJECTED)
    i, call = _first_call(calls, n)
    return (rf"\A(?![\s\S]*{WRONG_LIST}sequence {rejected} \()[\s\S]*?"
            + re.escape(f"first wrong token: sequence {n} ({V.LOAD_PLANS[n]}) token {V.LOAD_HITS[n][1]}, call {i} "
                        f"(prefill of sequences {list(call.sequences)} in slots {list(call.slots)}, from prefix slots "
                        f"{list(call.prefix_slots)}, admitting sequences [{n}] (loads: sequence {n} from slot ")
            + r"\d+" + re.escape(")), its slot ") + r"\d+ \(held before by sequence \d+\)")


def copied_back_on_a_landed_boundary():
    """vLLM #53505's plant: the first round whose acceptance lands exactly on a boundary: the
    sequence's committed state after it, then its block there, holding the state the round started
    from."""
    plans, K = V.SPEC_BLOCK_PLANS, V.SPEC_BLOCK_DRAFTS
    r, n = min((r, n) for n, pl in enumerate(plans) for r in landed(pl, V.BLOCK, 0))
    call = max(len(pl.chunks) for pl in plans) + r
    start = sum(plans[n].chunks) + sum(plans[n].accepted[:r])
    j = plans[n].accepted[r]
    head = re.escape(f"call {call} (verify round {r + 1}: {K} drafts each of sequences ") + r"[^\n]*?\): "
    return (head + r"slot \d+, " + re.escape(f"sequence {n} ({plans[n]}), state after token {start + j - 1}, {j} of "
                                             f"{K} drafts accepted: field conv error") + r"[\s\S]*?"
            + head + re.escape(f"sequence {n} ({plans[n]}), the block at token {start + j} (a block boundary, where "
                               f"the round's acceptance landed) in slot ") + r"\d+"
            + r" is not the state there: field conv error \S+; "
            + re.escape(f"it holds the state at token {start} (the state the call started from)"))


def drafter_kept_the_rejected_drafts():
    """PrismML llama.cpp #174's plant: the target is right (the report is the drafter's alone); the
    first round that rejects a draft, its first sequence that did: the drafter's state after the
    accepted tokens holds the rejected drafts too."""
    plans, K = SPEC_PLANS, SPEC_DRAFTS
    r, n = min((r, n) for n, pl in enumerate(plans) for r in range(len(pl.accepted))
               if pl.accepted[r] < pl.drafts_of(r, K))
    call = max(len(pl.chunks) for pl in plans) + r
    start = sum(plans[n].chunks) + sum(plans[n].accepted[:r])
    j, d = plans[n].accepted[r], plans[n].drafts_of(r, K)
    return (r"\A" + re.escape(f"spec-decode parity failed for record/tp2/seed{SEED}, the drafter (its own state "
                              f"pool):") + r"[\s\S]*?"
            + re.escape(f"call {call} (verify round {r + 1}: {K} drafts each of sequences ") + r"[^\n]*?\): "
            + re.escape(f"slot {len(plans) - n}, sequence {n} ({plans[n]}), the drafter's state after token "
                        f"{start + j - 1}, {j} of {d} drafts accepted: field conv error"))
