"""The state-pool mode of the continuation check (`pytest_linattn.harness.assert_state_pool_parity`)
on linattn's layer through the slot-pool client (suites/state_pool_clients.py: prefill and decode
read and write the scheduled slots of a pool in place), at TP 2, in float64.

The check pads decode batches to captured sizes with padding rows at a sentinel, at slot 0 and
at a free slot, and frees and reuses slots mid-run. The correct client passes; two planted bugs
(a decode that writes its padding rows' slots too, so slot 0; a prefill that reads a reused
slot without resetting it) each fail with the call, the slot, the sequence and the token named.
"""


import pytest
import torch

from layer_parity import make_config, replicated_layer
from linattn.layers import LayerState
from pytest_linattn.harness import Placement, SequencePlan
from pytest_linattn.parity import capture_records
from pytest_linattn.harness import assert_state_pool_parity
from pytest_linattn.harness.state_pool import pool_schedule
from state_pool_clients import linattn_pool_path, pool_decode, pool_prefill

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


def pool_path(prefill=pool_prefill, decode=pool_decode):
    return linattn_pool_path(CONFIG, prefill=prefill, decode=decode)


def check(spawn, path):
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_state_pool_parity(spawn, path, reference(), [Placement(tp=2)], CU, plans=PLANS,
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


@pytest.mark.tp_sizes(2)
def test_slot_pool_client_matches_the_serial_run(spawn, tp_size):
    check(spawn, pool_path())


@pytest.mark.tp_sizes(2)
def test_padding_row_writing_slot_0_is_caught(spawn, tp_size):
    with pytest.raises(AssertionError) as info:
        check(spawn, pool_path(decode=decode_writing_every_row))
    report = str(info.value)
    assert "changed live slot 0 (sequence 0, chunks 1+4+2, then 2 decode steps), which it did not schedule" in report, \
        report
    assert "padded to" in report and "with padding rows at slots" in report, report


@pytest.mark.tp_sizes(2)
def test_reused_slot_read_without_reset_is_caught(spawn, tp_size):
    with pytest.raises(AssertionError) as info:
        check(spawn, pool_path(prefill=prefill_without_reset))
    report = str(info.value)
    # the pool starts random: every sequence's first chunk reads a stale slot, the reused ones their
    # previous sequence's state
    assert "first wrong token: sequence 0 (chunks 1+4+2, then 2 decode steps) token 0, call 0 (prefill" in report, report
    assert ("    sequence 3 (chunks 1, then 4 decode steps) token 0, call 6 (prefill of sequences [3, 4] in slots [1, 2]), "
            "its slot 1 (held before by sequence 1)") in report, report
