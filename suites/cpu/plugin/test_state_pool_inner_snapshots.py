"""Inner snapshots in the prefix mode of the state-pool check (`StatePoolPath.inner_snapshots`):
an engine whose snapshot cadence is shorter than its prefill chunk keeps the state at every block
boundary a chunk crosses, not only where a chunk ends. linattn's layer through the slot-pool client
(suites/clients/state_pool.py, `linattn_pool_path(..., inner_snapshots=True)`: each chunk run in
pieces cut at its inner boundaries) at TP 1 and TP 2, float64.

Chunks are not block-aligned (6 and 5 tokens on blocks of 4); prefix hits start from inner
snapshots and from a chunk-end one. The correct client passes; two planted bugs each fail with the
snapshot named (call, sequence, token, slot, and what it holds) and the hit it spoils: a chunk
shorter than the snapshot cadence that skips its inner snapshots (sglang #30938, vLLM #41060), and
a chunk not kept block-aligned that publishes its chunk-end state under the last boundary it
crossed (vLLM #51113). The expected lines are derived from the plans' schedule.
"""

import dataclasses
import re

import pytest
import torch

from bug_record import plants_state as S
from cases.layer_parity import make_config, replicated_layer
from clients.state_pool import linattn_pool_path
from pytest_linattn.harness import Placement, SequencePlan, StatePoolPath, assert_state_pool_parity
from pytest_linattn.harness.serving_plans import check_hits_served, pool_schedule, snapshots_of
from pytest_linattn.parity import capture_records

CONFIG = make_config("qwen3_5", 1)
BLOCK = 4
RTOL = 1e-10
# sequence 0 runs chunks of 6, 5 and 5 tokens: inner snapshots at 4, 8 and 12, a chunk-end one at
# 16; sequences 1, 2 and 5 hit inner snapshots (5 on sequence 4's 9-token chunk), 3 the chunk-end one
HITS = {1: (0, 8), 2: (0, 12), 3: (0, 16), 5: (4, 4)}
PLANS = [SequencePlan((6, 5, 5), 2), SequencePlan((5,), 1), SequencePlan((2, 3), 2), SequencePlan((1,), 1),
         SequencePlan((9,), 1), SequencePlan((3,), 1)]
SEQLENS = tuple(pl.length + HITS.get(n, (0, 0))[1] for n, pl in enumerate(PLANS))
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
MAX_LIVE = 3
# the plants' plans (the bug record's sizes): sequence 0's 10-token chunk crosses 4 and 8 and ends
# off a boundary; its 6-token chunk (shorter than the plants' CADENCE) crosses 12 and ends on 16;
# sequence 1 hits the snapshot at 8, sequence 2 the one at 12
PLANT_HITS = {1: (0, 8), 2: (0, 12)}
PLANT_PLANS = [SequencePlan((10, 6), 2), SequencePlan((3,), 1), SequencePlan((2,), 2)]
PLANT_CU = torch.tensor([0, *(pl.length + PLANT_HITS.get(n, (0, 0))[1] for n, pl in enumerate(PLANT_PLANS))]
                        ).cumsum(0).to(torch.int32)
PLANT_MAX_LIVE = 2


def reference(seed=13):
    return replicated_layer(CONFIG, seed)


def check(spawn, placement, prefill=None, plans=PLANS, cu=CU, hits=HITS, max_live=MAX_LIVE):
    path = linattn_pool_path(CONFIG, inner_snapshots=True, **({"prefill": prefill} if prefill else {}))
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_state_pool_parity(spawn, path, reference(), [placement], cu, plans=plans,
                                 hidden_size=CONFIG.hidden_size, seed=14, rtol=RTOL, max_live=max_live,
                                 capture_sizes=(4,), block_size=BLOCK, prefix_hits=hits, name="qwen3_5")


def schedule(plans=PLANS, cu=CU, hits=HITS, max_live=MAX_LIVE):
    """The spare pool's schedule (max_live + 1 slots for the sequences), as the check runs it first."""
    return pool_schedule(plans, [int(b) for b in cu], max_live, max_live + 1, CONFIG.hidden_size,
                         torch.Generator().manual_seed(0), (4,), BLOCK, hits, inner_snapshots=True)


def chunks_of(calls, cu):
    """(call index, call, sequence, chunk start, chunk end) of every prefill chunk, in tokens of its sequence."""
    for i, c in enumerate(calls):
        if c.kind == "prefill":
            for k, n in enumerate(c.sequences):
                start = int(c.tokens[c.cu_seqlens[k]]) - int(cu[n])
                yield i, c, k, n, start, start + int(c.cu_seqlens[k + 1] - c.cu_seqlens[k])


def test_schedule_snapshots_every_boundary_a_chunk_crosses():
    calls = schedule()
    inner, ends = {}, {}
    for i, c, k, n, start, end in chunks_of(calls, CU):
        for slot, offset in zip(c.inner_snapshot_slots[k], c.inner_snapshot_offsets[k]):
            if slot >= 0:
                assert 0 < offset < end - start and (start + offset) % BLOCK == 0
                inner[(n, start + offset)] = slot
        assert all(s == -1 for s in c.inner_snapshot_slots[k][len([s for s in c.inner_snapshot_slots[k] if s >= 0]):])
        if c.snapshot_slots[k] >= 0:
            ends[(n, end)] = c.snapshot_slots[k]
    # every multiple of the block inside a chunk, and every chunk end on one; a hit's restored
    # prefix none (sequence 2 starts at 12 and crosses 16; sequence 1 starts at 8 and crosses 12)
    assert sorted(inner) == [(0, 4), (0, 8), (0, 12), (1, 12), (2, 16), (4, 4), (4, 8)], inner
    assert sorted(ends) == [(0, 16)], ends
    assert sorted({**inner, **ends}.values()) == list(range(MAX_LIVE + 1, MAX_LIVE + 1 + len(inner) + len(ends)))
    assert {(n, t): s for c in calls if c.kind == "prefill" for n, s, t in snapshots_of(c, [int(b) for b in CU])} \
        == {**inner, **ends}
    for n, (m, tokens) in HITS.items():  # each hit starts from its snapshot, written by an earlier call
        first = next(c for c in calls if c.kind == "prefill" and n in c.sequences)
        k = first.sequences.index(n)
        assert first.prefix_slots[k] == {**inner, **ends}[(m, tokens)] and not first.fresh[k]
        assert first.blocks[first.prefix_slots[k]] == (m, tokens)
    check_hits_served(calls, HITS)


@pytest.mark.parametrize("placement", [Placement(), Placement(tp=2)], ids=["tp1", "tp2"])
def test_inner_snapshots_of_the_correct_client_pass(spawn, placement):
    check(spawn, placement)


def first_hit_line(calls, hits, plans, n, t):
    """The report's line for the first prefix hit that starts from sequence n's snapshot at token t:
    its first computed token, in the call that runs its first chunk."""
    h = min(h for h, source in hits.items() if source == (n, t))
    i = next(i for i, c in enumerate(calls) if c.kind == "prefill" and h in c.sequences)
    return f"first wrong token: sequence {h} ({plans[h]}) token {t}, call {i} "


def test_plant_skipping_inner_snapshots_of_short_chunks(spawn):
    calls = schedule(PLANT_PLANS, PLANT_CU, PLANT_HITS, PLANT_MAX_LIVE)
    # the first inner snapshot of a chunk shorter than the cadence, from the schedule
    i, n, t, slot, start, end = next((i, n, start + o, s, start, end) for i, c, k, n, start, end in
                                     chunks_of(calls, PLANT_CU) if end - start < S.CADENCE
                                     for s, o in zip(c.inner_snapshot_slots[k], c.inner_snapshot_offsets[k]) if s >= 0)
    with pytest.raises(AssertionError) as info:
        check(spawn, Placement(tp=2), S.prefill_skipping_inner_snapshots_of_short_chunks, PLANT_PLANS, PLANT_CU,
              PLANT_HITS, PLANT_MAX_LIVE)
    report = str(info.value)
    line = (re.escape(f"call {i} (prefill of sequences {list(calls[i].sequences)} in slots {list(calls[i].slots)}")
            + r"[^)]*\): "
            + re.escape(f"the snapshot of sequence {n} ({PLANT_PLANS[n]}) at token {t}, inside its {end - start}-token "
                        f"chunk from token {start}, in slot {slot} is not the state there: field ")
            + r"\w+ error \S+" + re.escape("; it holds the slot's contents from before (never written)"))
    assert re.search(line, report), report
    assert first_hit_line(calls, PLANT_HITS, PLANT_PLANS, n, t) in report, report
    assert "(its chunk's end)" not in report, report  # no state published under another boundary


def test_plant_publishing_the_chunk_end_under_its_last_boundary(spawn):
    calls = schedule(PLANT_PLANS, PLANT_CU, PLANT_HITS, PLANT_MAX_LIVE)
    # the last inner snapshot of the first chunk that does not end on a block boundary, from the schedule
    i, n, t, slot, start, end = next((i, n, start + max(o for o in c.inner_snapshot_offsets[k] if o >= 0),
                                      max(c.inner_snapshot_slots[k]), start, end)
                                     for i, c, k, n, start, end in chunks_of(calls, PLANT_CU)
                                     if c.snapshot_slots[k] < 0 and max(c.inner_snapshot_slots[k], default=-1) >= 0)
    with pytest.raises(AssertionError) as info:
        check(spawn, Placement(tp=2), S.prefill_publishing_the_chunk_end_under_its_last_boundary, PLANT_PLANS,
              PLANT_CU, PLANT_HITS, PLANT_MAX_LIVE)
    report = str(info.value)
    line = (re.escape(f"call {i} (prefill of sequences {list(calls[i].sequences)} in slots {list(calls[i].slots)}")
            + r"[^)]*\): "
            + re.escape(f"the snapshot of sequence {n} ({PLANT_PLANS[n]}) at token {t}, inside its {end - start}-token "
                        f"chunk from token {start}, in slot {slot} is not the state there: field ")
            + r"\w+ error \S+" + re.escape(f"; it holds the state at token {end} (its chunk's end)"))
    assert re.search(line, report), report
    assert first_hit_line(calls, PLANT_HITS, PLANT_PLANS, n, t) in report, report
    assert "never written" not in report, report  # every snapshot written, one with the wrong state


def test_the_plants_break_what_their_helpers_name():
    # the plants' own derivations (for the bug record's located lines) agree with the schedule's
    calls = schedule(PLANT_PLANS, PLANT_CU, PLANT_HITS, PLANT_MAX_LIVE)
    short = [(n, start + o) for _, c, k, n, start, end in chunks_of(calls, PLANT_CU) if end - start < S.CADENCE
             for s, o in zip(c.inner_snapshot_slots[k], c.inner_snapshot_offsets[k]) if s >= 0]
    assert S.stale_inner_snapshots(PLANT_PLANS, PLANT_HITS, BLOCK) == short == [(0, 12)]
    assert S.misplaced_inner_snapshots(PLANT_PLANS, PLANT_HITS, BLOCK) == [(0, 8, 10)]


def test_bad_inner_snapshot_input_names_the_parameter_and_the_rule():
    base = dict(plans=PLANS, hidden_size=CONFIG.hidden_size, seed=0, rtol=RTOL, max_live=MAX_LIVE)
    path = linattn_pool_path(CONFIG, inner_snapshots=True)
    with pytest.raises(ValueError, match=r"StatePoolPath.inner_snapshots must be a bool"):
        StatePoolPath(path.layer, prefill=path.prefill, decode=path.decode, inner_snapshots="yes")
    with pytest.raises(ValueError, match=r"inner_snapshots needs block_size"):
        assert_state_pool_parity(None, path, reference(), [Placement()], CU, **base)
    with pytest.raises(ValueError, match=r"StatePoolPath.inner_snapshots runs at cp 1 only .* got \['cp2"):
        assert_state_pool_parity(None, path, reference(), [Placement(cp=2)], CU, block_size=BLOCK, prefix_hits=HITS,
                                 **base)
    # a hit off every block boundary of its source's chunks
    with pytest.raises(ValueError, match=r"prefix_hits\[1\] = \(0, 6\): with inner_snapshots tokens must be a block "
                                         r"boundary of sequence 0's chunks .*\[4, 8, 12, 16\]"):
        assert_state_pool_parity(None, path, reference(), [Placement()], CU, block_size=BLOCK,
                                 prefix_hits={**HITS, 1: (0, 6)}, **{**base, "plans": [PLANS[0], SequencePlan(
                                     (7,), 1), *PLANS[2:]]})
    # chunks that cross no block boundary inside them: the option checks nothing
    aligned = [SequencePlan((4, 4), 1), SequencePlan((8,), 1)]
    with pytest.raises(ValueError, match=r"inner_snapshots: no prefill chunk of these plans crosses a multiple of "
                                         r"block_size 8 strictly inside it .* so the option checks nothing here"):
        assert_state_pool_parity(None, path, reference(), [Placement()], [0, 9, 18], block_size=8,
                                 **{**base, "plans": aligned})
    # a hit on a boundary no chunk snapshots (the check refuses it first; the schedule says so too)
    with pytest.raises(ValueError, match=r"prefix_hits\[1\] = \(0, 4\): sequence 1 waits for the snapshot of "
                                         r"sequence 0 at token 4, which no prefill call writes"):
        pool_schedule([SequencePlan((6,), 1), SequencePlan((2,), 1)], [0, 7, 13], 2, 3, CONFIG.hidden_size,
                      torch.Generator(), (4,), BLOCK, {1: (0, 4)})
    calls = schedule()
    first = next(i for i, c in enumerate(calls) if c.kind == "prefill" and 1 in c.sequences)
    k = calls[first].sequences.index(1)
    unserved = calls[:first] + [_replace_prefix(calls[first], k, -1)] + calls[first + 1:]
    with pytest.raises(ValueError, match=r"prefix_hits\[1\] = \(0, 8\): sequence 1's first prefill call does not "
                                         r"start from the snapshot of sequence 0 at token 8 .* checks nothing"):
        check_hits_served(unserved, HITS)


def _replace_prefix(call, k, slot):
    prefix = list(call.prefix_slots)
    prefix[k] = slot
    return dataclasses.replace(call, prefix_slots=tuple(prefix))
