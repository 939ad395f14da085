"""The prefix mode of the state-pool check (`assert_state_pool_parity(block_size=...,
prefix_hits=...)`) on linattn's layer through the slot-pool client (suites/clients/state_pool.py),
at TP 2, CP 2 and TP 2 x CP 2, in float64 (under CP the pool, its prefix blocks included, whole on
every CP rank).

Chunks ending on a block boundary write a snapshot (a prefix block); later sequences start from
another's snapshot (prefix hits), one of them with a first chunk shorter than W-1. The correct
client passes; two planted bugs each fail with the call, the slot and the snapshot named: a
prefill that never writes its snapshots (sglang #31474: prefix hits restored garbage), and a chunk
shorter than W-1 that writes its conv state into the prefix block it read from instead of its own
slot (vLLM #56196).
"""


import pytest
import torch

from cases.layer_parity import make_config, replicated_layer
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity
from pytest_linattn.harness.serving_plans import pool_schedule
from pytest_linattn.parity import capture_records
from clients.state_pool import linattn_pool_path, pool_prefill

CONFIG = make_config("qwen3_5", 1)
BLOCK = 4
# sequences 2, 3 and 4 are prefix hits: 2 on sequence 0's first 8 tokens (then a 2-token chunk,
# shorter than W-1 = 3), 3 on its first 4 (then a chunk to its own snapshot at 8), 4 on sequence 1's first 4
HITS = {2: (0, 8), 3: (0, 4), 4: (1, 4)}
SEQLENS = (14, 9, 12, 11, 8)
PLANS = [SequencePlan((4, 4, 3), 3), SequencePlan((4, 3), 2), SequencePlan((2,), 2), SequencePlan((4, 1), 2),
         SequencePlan((1,), 3)]
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
RTOL = 1e-10


def reference(seed=13):
    return replicated_layer(CONFIG, seed)


def prefill_without_snapshots(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix_slots):
    """The snapshots never written: a prefix hit restores whatever the snapshot slot held."""
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, None, prefix_slots)


def prefill_writing_a_short_chunk_into_its_prefix_block(module, x, cu_seqlens, pool, slots, fresh, placement,
                                                         snapshot_slots, prefix_slots):
    """A prefix hit's chunk shorter than W-1 writes its conv state into the block it read from;
    its own slot keeps the conv state it held."""
    own_conv = pool.conv[slots].clone()
    y = pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix_slots)
    short = (prefix_slots >= 0) & (cu_seqlens.diff().to(prefix_slots.device) < module.local_config.conv_size - 1)
    pool.conv[prefix_slots[short]] = pool.conv[slots[short]]
    pool.conv[slots[short]] = own_conv[short]
    return y


def check(spawn, placement, prefill=pool_prefill):
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_state_pool_parity(spawn, linattn_pool_path(CONFIG, prefill=prefill), reference(), [placement],
                                 CU, plans=PLANS, hidden_size=CONFIG.hidden_size, seed=14, rtol=RTOL, max_live=3,
                                 capture_sizes=(4,), block_size=BLOCK, prefix_hits=HITS, name="qwen3_5")


def test_schedule_snapshots_block_boundaries_and_hits_start_from_them():
    calls = pool_schedule(PLANS, [int(b) for b in CU], 3, 4, CONFIG.hidden_size, torch.Generator().manual_seed(0),
                          (4,), BLOCK, HITS)
    prefills = [c for c in calls if c.kind == "prefill"]
    snapshots = {}
    for c in prefills:
        for n, s, tokens in zip(c.sequences, c.snapshot_slots, c.tokens.split(c.cu_seqlens.diff().tolist())):
            if s >= 0:
                snapshots[(n, int(tokens[-1]) + 1 - int(CU[n]))] = s
    assert sorted(snapshots) == [(0, 4), (0, 8), (1, 4), (3, 8)], snapshots
    assert sorted(snapshots.values()) == [4, 5, 6, 7]  # after the live slots 0..3
    for n, (m, tokens) in HITS.items():
        first = next(c for c in prefills if n in c.sequences)
        k = first.sequences.index(n)
        # the hit starts from the snapshot, not fresh, and computes only the tokens after the prefix
        assert first.prefix_slots[k] == snapshots[(m, tokens)] and not first.fresh[k]
        assert int(first.tokens[first.cu_seqlens[k]]) == int(CU[n]) + tokens
        assert snapshots[(m, tokens)] in first.blocks  # taken by an earlier call: a prefix block


@pytest.mark.parametrize("placement", [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2)],
                         ids=["tp2", "cp2", "tp2-cp2"])
def test_prefix_snapshots_and_plants(spawn, placement):
    check(spawn, placement)  # the correct client passes
    with pytest.raises(AssertionError) as never:
        check(spawn, placement, prefill_without_snapshots)
    report = str(never.value)
    assert ("snapshots to slots [4, 5]): the snapshot of sequence 0 (chunks 4+4+3, then 3 decode steps) at token 4 "
            "in slot 4 is not the state there: field conv error") in report, report
    # the headline: the earliest call that goes wrong (sequence 2's hit, on the snapshot at token 8);
    # then the lowest wrong position, a later call's (sequence 3's hit at token 4)
    assert ("first wrong token: sequence 2 (chunks 2, then 2 decode steps) token 8, call 2 (prefill of sequences "
            "[0, 2] in slots [0, 2], from prefix slots [-1, 6])") in report, report
    assert "lowest wrong position: sequence 3 (chunks 4+1, then 2 decode steps) token 4, call" in report, report
    with pytest.raises(AssertionError) as short:
        check(spawn, placement, prefill_writing_a_short_chunk_into_its_prefix_block)
    report = str(short.value)
    assert ("call 2 (prefill of sequences [0, 2] in slots [0, 2], from prefix slots [-1, 6]) changed prefix block "
            "slot 6 (the snapshot of sequence 0 at token 8), which it read from: field conv, max |change|") in report, \
        report
    # sequence 3's 4-token chunk leaves its block alone (slot 4 with a spare slot, 3 in the full pool)
    assert "(the snapshot of sequence 0 at token 4), which it read from" not in report, report
    # the snapshot was right when call 1 wrote it: the check keeps a copy, not a view of the pool
    # that call 2 then changes (which would blame call 1)
    assert "at token 8 in slot 6 is not the state there" not in report, report


def test_bad_prefix_input_names_the_parameter_and_the_rule():
    path = linattn_pool_path(CONFIG)
    base = dict(plans=PLANS, hidden_size=20, seed=0, rtol=RTOL, max_live=3)
    with pytest.raises(ValueError, match=r"placements: the pool mode runs TP, CP in the contiguous layout .* without "
                                         r"sequence parallel; got tp2-sp"):
        assert_state_pool_parity(None, path, reference(), [Placement(tp=2, sequence_parallel=True)], CU,
                                 block_size=BLOCK, prefix_hits=HITS, **base)
    with pytest.raises(ValueError, match=r"prefix_hits needs block_size"):
        assert_state_pool_parity(None, path, reference(), [Placement(tp=2)], CU, prefix_hits=HITS, **base)
    with pytest.raises(ValueError, match=r"prefix_hits\[2\] = \(0, 6\): tokens must be where a prefill chunk of "
                                         r"sequence 0 \(not itself a hit\) ends on a multiple of block_size 4"):
        assert_state_pool_parity(None, path, reference(), [Placement(tp=2)], CU, block_size=BLOCK,
                                 prefix_hits={**HITS, 2: (0, 6)}, **base)
    with pytest.raises(ValueError, match=r"plans\[2\] covers 4 tokens \(chunks 2, then 2 decode steps\); sequence 2 "
                                         r"has 12, 4 of them a prefix hit"):
        assert_state_pool_parity(None, path, reference(), [Placement(tp=2)], CU, block_size=BLOCK,
                                 prefix_hits={**HITS, 2: (0, 4)}, **base)
