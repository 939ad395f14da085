"""The state-pool check's serving options (`pytest_linattn.harness.pool_modes`) on linattn's
layer through the slot-pool client (suites/clients/state_pool.py), at TP 2, float64:

- block tables with per-group hit lengths (`StatePoolPath.block_tables`, `group_hits`): the client
  maps token counts to blocks itself; a hit whose recurrent group cached a block more than the
  engine resumes at. Plants: a restore from the group's own (longer) hit (vLLM #53912), and one
  seeded with a drafter's block size (vLLM #55601);
- mixed calls (`StatePoolPath.mixed_calls`): decode rows in the prefill call. Plant: the prefill
  rows' snapshots taken through row indices that count the decode rows in (sglang #23075);
- admissions and rejected loads (`StatePoolPath.admit`, `rejected_hits`): a load-back client that
  copies a hit's snapshot into the admitted slot. Plants: the slot published before the load is
  known to go through, never unwound when it is rejected (sglang #30986); a connector that reports
  a hit whose recurrent state it never stored (LMCache #2863).

The correct client passes each; each plant fails with the call, the slot, the sequence and the
token named (the expected lines derived from the plans' schedule); each option refuses a plan it
would not exercise.
"""

import re

import pytest
import torch

from bug_record import plants_serving as P
from cases.layer_parity import make_config, replicated_layer
from clients.state_pool import linattn_block_pool_path, linattn_load_back_path, linattn_pool_path
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity
from pytest_linattn.harness.serving_plans import pool_schedule
from pytest_linattn.parity import capture_records

CONFIG = make_config("qwen3_5", 1)
BLOCK = P.MAMBA_BLOCK
RTOL = 1e-10
# block tables: sequence 0 snapshots at 4 and 8; sequence 1 resumes at 4 while its recurrent group
# cached sequence 0's blocks up to 8; sequence 2 resumes at 8 (its group's hit the same)
BLOCK_HITS = {1: (0, 4), 2: (0, 8)}
GROUP_HITS = {1: 8}
BLOCK_PLANS = [SequencePlan((4, 4, 2), 1), SequencePlan((3,), 1), SequencePlan((2,), 1)]
# mixed calls: sequence 1's second chunk ends on the block boundary at 4 while sequence 0 decodes
# beside it (one decode row); sequence 2 hits that snapshot
MIXED_HITS = {2: (1, 4)}
MIXED_PLANS = [SequencePlan((2,), 3), SequencePlan((1, 3), 1), SequencePlan((2,), 1)]
# admissions: sequence 2's load of sequence 0's snapshot at 4 is rejected: it runs all 7 tokens
# from zero, in the slot sequence 0 left; sequence 3's load (a hit) goes through
LOAD_HITS = {3: (0, 4)}
REJECTED = {2: (0, 4)}
LOAD_PLANS = [SequencePlan((4,), 1), SequencePlan((2,), 3), SequencePlan((3, 4), 1), SequencePlan((2,), 1)]


def cu_of(plans, hits):
    return torch.tensor([0, *(pl.length + hits.get(n, (0, 0))[1] for n, pl in enumerate(plans))]).cumsum(0).to(
        torch.int32)


def reference(seed=13):
    return replicated_layer(CONFIG, seed)


def check(spawn, path, plans, hits, max_live=2, placement=Placement(tp=2), **options):
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_state_pool_parity(spawn, path, reference(), [placement], cu_of(plans, hits), plans=plans,
                                 hidden_size=CONFIG.hidden_size, seed=14, rtol=RTOL, max_live=max_live,
                                 capture_sizes=(4,), block_size=BLOCK, prefix_hits=hits, name="qwen3_5", **options)


def schedule(plans, hits, max_live=2, **options):
    """The spare pool's schedule (max_live + 1 slots for the sequences), as the check runs it first."""
    bounds = [int(b) for b in cu_of(plans, hits)]
    return pool_schedule(plans, bounds, max_live, max_live + 1, CONFIG.hidden_size, torch.Generator().manual_seed(0),
                         (4,), BLOCK, hits, **options)


def first_call(calls, n):
    return next((i, c) for i, c in enumerate(calls) if c.kind == "prefill" and n in c.sequences)


def test_block_tables_hold_the_group_hit_and_resume_where_the_engine_does():
    calls = schedule(BLOCK_PLANS, BLOCK_HITS, block_tables=True, group_hits=GROUP_HITS)
    i, call = first_call(calls, 1)
    k = call.sequences.index(1)
    four, eight = call.block_table[k]  # sequence 0's blocks at tokens 4 and 8
    assert call.blocks[four] == (0, 4) and call.blocks[eight] == (0, 8) and call.num_computed[k] == 4
    assert not call.fresh[k] and int(call.tokens[call.cu_seqlens[k]]) - int(cu_of(BLOCK_PLANS, BLOCK_HITS)[1]) == 4
    _, hit = first_call(calls, 2)
    assert hit.block_table[hit.sequences.index(2)] == (four, eight) and hit.num_computed[hit.sequences.index(2)] == 8


def test_block_tables_group_hits_and_plants(spawn):
    path = linattn_block_pool_path(CONFIG, BLOCK)
    check(spawn, path, BLOCK_PLANS, BLOCK_HITS, group_hits=GROUP_HITS)  # the correct client passes
    calls = schedule(BLOCK_PLANS, BLOCK_HITS, block_tables=True, group_hits=GROUP_HITS)
    i, _ = first_call(calls, 1)
    with pytest.raises(AssertionError) as group:
        check(spawn, linattn_block_pool_path(CONFIG, BLOCK, prefill=P.prefill_restoring_the_group_hit), BLOCK_PLANS,
              BLOCK_HITS, group_hits=GROUP_HITS)
    report = str(group.value)
    # the hit resuming at 4 restored its group's block at 8; the hit whose group agrees is right
    assert re.search(rf"first wrong token: sequence 1 \(chunks 3, then 1 decode steps\) token 4, call {i} \(prefill "
                     r"of sequences \[[\d, ]+\] in slots \[[\d, ]+\](, snapshots to slots \[[-\d, ]+\])?, block tables "
                     r"\[[\[\]\-\d, ]+\] resuming at tokens \[[\d, ]+\]\)", report), report
    assert "    sequence 2 (" not in report, report
    assert (f"call {i}: sequence 1 resumes at token 4, but its first computed token's output is the one from the "
            f"block at token 8 (column 1 of its block table, slot ") in report, report
    with pytest.raises(AssertionError) as drafter:
        check(spawn, linattn_block_pool_path(CONFIG, BLOCK, prefill=P.prefill_seeding_from_the_drafter_block_size),
              BLOCK_PLANS, BLOCK_HITS, group_hits=GROUP_HITS)
    report = str(drafter.value)
    assert "first wrong token: sequence 1 (chunks 3, then 1 decode steps) token 4" in report, report
    assert "    sequence 2 (chunks 2, then 1 decode steps) token 8, call" in report, report


def test_mixed_calls_run_decode_rows_in_the_prefill_call():
    calls = schedule(MIXED_PLANS, MIXED_HITS, mixed_calls=True)
    mixed = [c for c in calls if c.kind == "prefill" and any(c.decode_rows)]
    assert mixed and all(c.decode_rows[:sum(not d for d in c.decode_rows)] == (False,) * sum(
        not d for d in c.decode_rows) for c in mixed)  # decode rows after the prefill rows
    first = mixed[0]
    assert first.sequences == (1, 0) and first.decode_rows == (False, True) and first.snapshot_slots[1] == -1
    assert int(first.cu_seqlens[-1] - first.cu_seqlens[-2]) == 1 and not first.fresh[1]
    # that step runs no decode call: sequence 0's first decode token is the mixed call's row
    assert [c.kind for c in calls[:3]] == ["prefill", "prefill", "decode"] and calls[1] is first


def test_mixed_calls_and_plant(spawn):
    check(spawn, linattn_pool_path(CONFIG, mixed_calls=True), MIXED_PLANS, MIXED_HITS)  # the correct client passes
    with pytest.raises(AssertionError) as tracked:
        check(spawn, linattn_pool_path(CONFIG, P.prefill_tracking_snapshots_through_the_decode_rows, mixed_calls=True),
              MIXED_PLANS, MIXED_HITS)
    report = str(tracked.value)
    calls = schedule(MIXED_PLANS, MIXED_HITS, mixed_calls=True)
    i, call = next((i, c) for i, c in enumerate(calls) if c.kind == "prefill" and any(c.decode_rows))
    slot = call.snapshot_slots[0]
    assert (f"call {i} (prefill of sequences [1, 0] in slots {list(call.slots)}, snapshots to slots [{slot}, -1], "
            f"decode rows of sequences [0]): the snapshot of sequence 1 (chunks 1+3, then 1 decode steps) at token 4 "
            f"in slot {slot} is not the state there: field conv error") in report, report
    assert "it holds sequence 0's state at token 3 (a decode row of the call)" in report, report
    assert "first wrong token: sequence 2 (chunks 2, then 1 decode steps) token 4" in report, report


def test_admissions_load_hits_and_roll_back_rejected_loads():
    calls = schedule(LOAD_PLANS, LOAD_HITS, admission=True, rejected_hits=REJECTED)
    _, call = first_call(calls, 2)
    k = call.sequences.index(2)
    row, load, loaded = next(a for a in call.admission if a[0] == k)
    assert call.blocks[load] == (0, 4) and not loaded and call.fresh[k]  # a rejected load: from token 0, fresh
    assert call.slots[k] == 0 and int(call.tokens[call.cu_seqlens[k]]) == int(cu_of(LOAD_PLANS, LOAD_HITS)[2])
    _, hit = first_call(calls, 3)
    k = hit.sequences.index(3)
    assert next(a for a in hit.admission if a[0] == k)[1:] == (hit.prefix_slots[k], True) and not hit.fresh[k]


def test_admissions_and_plant(spawn):
    check(spawn, linattn_load_back_path(CONFIG), LOAD_PLANS, LOAD_HITS, rejected_hits=REJECTED)
    with pytest.raises(AssertionError) as published:
        check(spawn, linattn_load_back_path(CONFIG, admit=P.admit_publishing_before_the_load), LOAD_PLANS, LOAD_HITS,
              rejected_hits=REJECTED)
    report = str(published.value)
    i, call = first_call(schedule(LOAD_PLANS, LOAD_HITS, admission=True, rejected_hits=REJECTED), 2)
    assert re.search(rf"first wrong token: sequence 2 \(chunks 3\+4, then 1 decode steps\) token 0, call {i} "
                     r"\(prefill of sequences \[[\d, ]+\] in slots \[[\d, ]+\], admitting sequences \[2\] \(loads: "
                     r"sequence 2 from slot \d+, rejected\)\), its slot 0 \(held before by sequence 0\)",
                     report), report
    assert "    sequence 3 (" not in report, report  # the hit whose load went through is right
    with pytest.raises(AssertionError) as unrestored:  # a connector that reports a hit it never restored
        check(spawn, linattn_load_back_path(CONFIG, admit=P.admit_reporting_hits_it_never_restored), LOAD_PLANS,
              LOAD_HITS, rejected_hits=REJECTED)
    report = str(unrestored.value)
    i, call = first_call(schedule(LOAD_PLANS, LOAD_HITS, admission=True, rejected_hits=REJECTED), 3)
    assert re.search(rf"first wrong token: sequence 3 \(chunks 2, then 1 decode steps\) token 4, call {i} \(prefill "
                     r"of sequences \[3\] in slots \[\d+\], from prefix slots \[\d+\], admitting sequences \[3\] "
                     r"\(loads: sequence 3 from slot \d+\)\), its slot \d+ \(held before by sequence \d+\)",
                     report), report
    assert "    sequence 2 (" not in report, report  # the rejected load ran from zero


def test_options_refuse_plans_they_would_not_exercise():
    base = dict(hidden_size=CONFIG.hidden_size, seed=0, rtol=RTOL, max_live=2, block_size=BLOCK)
    block = linattn_block_pool_path(CONFIG, BLOCK)
    with pytest.raises(ValueError, match=r"group_hits\[1\] = 4: the layer group's own hit must be longer than the hit "
                                         r"the engine resumes at"):
        assert_state_pool_parity(None, block, reference(), [Placement(tp=2)], cu_of(BLOCK_PLANS, BLOCK_HITS),
                                 plans=BLOCK_PLANS, prefix_hits=BLOCK_HITS, group_hits={1: 4}, **base)
    with pytest.raises(ValueError, match=r"group_hits needs StatePoolPath.block_tables"):
        assert_state_pool_parity(None, linattn_pool_path(CONFIG), reference(), [Placement(tp=2)],
                                 cu_of(BLOCK_PLANS, BLOCK_HITS), plans=BLOCK_PLANS, prefix_hits=BLOCK_HITS,
                                 group_hits=GROUP_HITS, **base)
    plans = [SequencePlan((4,), 1), SequencePlan((2,), 1)]  # both decode after every prefill: nothing mixes
    with pytest.raises(ValueError, match=r"StatePoolPath.mixed_calls: no prefill call of these plans runs beside a "
                                         r"decode row"):
        assert_state_pool_parity(None, linattn_pool_path(CONFIG, mixed_calls=True), reference(), [Placement(tp=2)],
                                 cu_of(plans, {}), plans=plans, **base)
    with pytest.raises(ValueError, match=r"rejected_hits needs StatePoolPath.admit"):
        assert_state_pool_parity(None, linattn_pool_path(CONFIG), reference(), [Placement(tp=2)],
                                 cu_of(LOAD_PLANS, LOAD_HITS), plans=LOAD_PLANS, prefix_hits=LOAD_HITS,
                                 rejected_hits=REJECTED, **base)
    with pytest.raises(ValueError, match=r"rejected_hits\[2\] = \(0, 2\): tokens must be where a prefill chunk of "
                                         r"sequence 0 ends on a multiple of block_size 4"):
        assert_state_pool_parity(None, linattn_load_back_path(CONFIG), reference(), [Placement(tp=2)],
                                 cu_of(LOAD_PLANS, LOAD_HITS), plans=LOAD_PLANS, prefix_hits=LOAD_HITS,
                                 rejected_hits={2: (0, 2)}, **base)
