"""The state-pool mode of the continuation check (`pytest_linattn.harness.assert_state_pool_parity`)
on linattn's layer through the slot-pool client (suites/clients/state_pool.py: prefill and decode
read and write the scheduled slots of a pool in place), at TP 2, CP 2 and TP 2 x CP 2, in float64.
Under CP every prefill call's tokens are split over the CP ranks, the pool is whole on every CP
rank and the decode calls run whole on every rank.

The check pads decode batches to captured sizes with padding rows at a sentinel, at slot 0 and
at a free slot, and frees and reuses slots mid-run. The correct client passes; two planted bugs
(a decode that writes its padding rows' slots too, so slot 0; a prefill that reads a reused
slot without resetting it) each fail with the call, the slot, the sequence and the token named,
at every placement; a third, under CP only (a prefill that writes a sequence's state on the CP
rank holding its last token only, the other ranks' pools left stale), fails on the stale rank.
"""


import pytest
import torch
import torch.distributed as dist

from cases.layer_parity import make_config, replicated_layer
from linattn.layers import LayerState
from pytest_linattn.harness import Placement, SequencePlan
from pytest_linattn.parity import capture_records
from pytest_linattn.harness import assert_state_pool_parity
from pytest_linattn.harness.serving_plans import pool_schedule
from clients.state_pool import linattn_pool_path, pool_decode, pool_prefill

CONFIG = make_config("qwen3_5", 1)
SEQLENS = (9, 6, 7, 5, 8)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
# 1-token first chunks, a 4-token chunk from a state, decode runs of several lengths: with 3
# live at once, sequences 3 and 4 take slots that sequences 0..2 freed
PLANS = [SequencePlan((1, 4, 2), 2), SequencePlan((3,), 3), SequencePlan((2, 3), 2), SequencePlan((1,), 4),
         SequencePlan((5,), 3)]
CAPTURE_SIZES = (4,)  # every decode call padded to 4 rows
RTOL = 1e-10


def reference(seed=11):
    return replicated_layer(CONFIG, seed)


def decode_writing_every_row(module, x, pool, slots, num_valid, placement):
    """The padding rows run and write too: a padding row at slot 0 overwrites a live sequence."""
    rows = slots.clamp(min=0)  # the sentinel taken as slot 0, as a kernel that clamps its index
    y, new = module.step(x, LayerState(*(f[rows] for f in pool)))
    for f, n in zip(pool, new):
        f[rows.flip(0)] = n.flip(0)  # the padding rows, last in the batch, write first: the valid ones win ties
    return y


def prefill_without_reset(module, x, cu_seqlens, pool, slots, fresh, placement):
    """A fresh sequence reads whatever its slot holds: a freed slot's previous sequence's state."""
    y, new = module(x, cu_seqlens, LayerState(*(f[slots] for f in pool)), output_final_state=True)
    for f, n in zip(pool, new):
        f[slots] = n
    return y


def prefill_writing_where_the_sequence_ends(module, x, cu_seqlens, pool, slots, fresh, placement):
    """Each CP rank writes back only the states of the sequences whose last token it holds (the
    rank that finished them); the other CP ranks' slots keep what they held."""
    state = LayerState(*(torch.where(fresh.view(-1, *[1] * (f.dim() - 1)), torch.zeros_like(f[slots]), f[slots])
                         for f in pool))
    y, new = module(x, cu_seqlens, state, output_final_state=True)
    cp_rank = dist.get_rank() // placement.tp % placement.cp
    last = cu_seqlens[1:].to(torch.long) - 1
    mine = (last >= cp_rank * x.shape[1]) & (last < (cp_rank + 1) * x.shape[1])
    for f, n in zip(pool, new):
        f[slots[mine.to(slots.device)]] = n[mine.to(n.device)]
    return y


def pool_path(prefill=pool_prefill, decode=pool_decode):
    return linattn_pool_path(CONFIG, prefill=prefill, decode=decode)


PLACEMENTS = pytest.mark.parametrize("placement", [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2)],
                                     ids=["tp2", "cp2", "tp2-cp2"])


def check(spawn, path, placement):
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_state_pool_parity(spawn, path, reference(), [placement], CU, plans=PLANS,
                                 hidden_size=CONFIG.hidden_size, seed=12, rtol=RTOL, max_live=3,
                                 capture_sizes=CAPTURE_SIZES, name="qwen3_5")


def test_schedule_pads_frees_and_reuses_slots():
    calls = pool_schedule(PLANS, [int(b) for b in CU], 3, 4, CONFIG.hidden_size, torch.Generator().manual_seed(0),
                          CAPTURE_SIZES)
    first_slot = {}
    for call in calls:
        for n, slot in zip(call.sequences, call.slots):
            first_slot.setdefault(n, slot)
    assert [first_slot[n] for n in range(3)] == [0, 1, 2] and first_slot[3] in (0, 1, 2), first_slot  # reused
    pads = [s for c in calls if c.kind == "decode" for s in c.slots[c.num_valid:]]
    assert -1 in pads and 0 in pads and any(s not in (-1, 0) for s in pads), pads
    assert all(len(c.slots) == 4 for c in calls if c.kind == "decode")
    # a padding row at slot 0 while slot 0's sequence is live and not in the call
    assert any(0 in c.slots[c.num_valid:] and 0 in c.live.values() and 0 not in c.slots[:c.num_valid]
               for c in calls if c.kind == "decode"), calls


@PLACEMENTS
def test_slot_pool_client_matches_the_serial_run(spawn, placement):
    check(spawn, pool_path(), placement)


@PLACEMENTS
def test_padding_row_writing_slot_0_is_caught(spawn, placement):
    with pytest.raises(AssertionError) as info:
        check(spawn, pool_path(decode=decode_writing_every_row), placement)
    report = str(info.value)
    assert "changed live slot 0 (sequence 0, chunks 1+4+2, then 2 decode steps), which it did not schedule" in report, \
        report
    assert "padded to" in report and "with padding rows at slots" in report, report


@PLACEMENTS
def test_reused_slot_read_without_reset_is_caught(spawn, placement):
    with pytest.raises(AssertionError) as info:
        check(spawn, pool_path(prefill=prefill_without_reset), placement)
    report = str(info.value)
    # the pool starts random: every sequence's first chunk reads a stale slot, the reused ones their
    # previous sequence's state
    assert "first wrong token: sequence 0 (chunks 1+4+2, then 2 decode steps) token 0, call 0 (prefill" in report, report
    assert ("    sequence 3 (chunks 1, then 4 decode steps) token 0, call 6 (prefill of sequences [3, 4] in slots [1, 2]), "
            "its slot 1 (held before by sequence 1)") in report, report


def test_state_written_on_one_cp_rank_only_is_caught(spawn):
    with pytest.raises(AssertionError) as info:
        check(spawn, pool_path(prefill=prefill_writing_where_the_sequence_ends), Placement(cp=2))
    report = str(info.value)
    # call 0 packs sequences 0, 1, 2 (tokens 0 | 1..3 | 4..5), CP rank 0 holding tokens 0..2: sequences
    # 1 and 2 end on CP rank 1, so CP rank 0's slots 1 and 2 keep their random values, and sequence 1's
    # first decode step runs from it there
    stale = next(line for line in report.splitlines() if line.startswith("output (decoded on cp_rank0)"))
    assert ("first wrong token: sequence 1 (chunks 3, then 3 decode steps) token 3, call 2 (decode of sequences [1] "
            "in slots [1], padded to 4 rows with padding rows at slots [-1, 0, 3]), its slot 1 (its first holder)") \
        in stale, report
    assert "final state (the slot when the sequence ends) on cp_rank1" in report, report
