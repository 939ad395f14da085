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

Every call is also checked against the pool's free slots (they start at a large sentinel fill),
and every run is repeated on a full pool (no spare slot): a padding row writing through -1 (the
pool's last slot by negative indexing) is caught in both, located. The report's headline is the
earliest call that goes wrong. A path declares its pool's dtype per field (`state_dtypes`: a
float32 recurrent pool under a bf16 layer stays float32, in the check's copies too) and its
engine's padding convention (`padding_slot`, `reserved_slots`): vLLM's null block 0 (reserved,
the padding rows' scratch) passes with a client that writes it; under sglang's -1 a client that
writes its padding rows into live slot 0 fails.
"""


import dataclasses

import pytest
import torch
import torch.distributed as dist

from cases.layer_parity import make_config, replicated_layer
from linattn.layers import LayerState
from pytest_linattn.harness import Placement, SequencePlan
from pytest_linattn.parity import capture_records
from pytest_linattn.harness import assert_state_pool_parity
from pytest_linattn.harness.serving_plans import pool_schedule
from pytest_linattn.harness.state_pool_rank import RankPool, run_pool_on_rank
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


def check(spawn, path, placement, rtol=RTOL, **options):
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_state_pool_parity(spawn, path, reference(), [placement], CU, plans=PLANS,
                                 hidden_size=CONFIG.hidden_size, seed=12, rtol=rtol, max_live=3,
                                 capture_sizes=CAPTURE_SIZES, name="qwen3_5", **options)


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


# ---- free slots and the full pool: a padding row writing through -1 --------------------------


def decode_writing_through_the_sentinel(module, x, pool, slots, num_valid, placement):
    """A kernel that guards only the null block 0: a padding row at -1 runs and writes, and -1
    indexes the pool's last slot (negative indexing); the other padding rows write nothing."""
    y = pool_decode(module, x, pool, slots, num_valid, placement)
    sentinel = torch.nonzero(slots == -1).flatten()
    if sentinel.numel():
        _, new = module.step(x[:, sentinel], LayerState(*(f[slots[sentinel]] for f in pool)))
        for f, n in zip(pool, new):
            f[-1] = n[-1]
    return y


def test_full_pool_schedule_leaves_no_spare_slot():
    # 3 sequence slots for 3 live sequences: while sequences wait every slot is live, the last one too
    calls = pool_schedule(PLANS, [int(b) for b in CU], 3, 3, CONFIG.hidden_size, torch.Generator().manual_seed(0),
                          CAPTURE_SIZES)
    assert all(0 <= s < 3 for c in calls for s in c.slots[:c.num_valid])
    full = [c for c in calls if c.kind == "decode" and sorted(c.live.values()) == [0, 1, 2]
            and -1 in c.slots[c.num_valid:] and 2 not in c.slots[:c.num_valid]]
    assert full, calls  # a padding row at -1 while the last slot holds a live sequence the call does not run


@pytest.mark.parametrize("placement", [Placement(tp=2), Placement(cp=2)], ids=["tp2", "cp2"])
def test_padding_row_writing_through_minus_1_is_caught(spawn, placement):
    with pytest.raises(AssertionError) as info:
        check(spawn, pool_path(decode=decode_writing_through_the_sentinel), placement)
    report = str(info.value)
    # the pool with a spare slot: -1 lands in the last slot, free (the spare; under CP the scratch slot)
    last, what = (3, "never held by a sequence") if placement.cp == 1 else (4, "the CP filler's scratch slot")
    assert (f"call 2 (decode of sequences [1] in slots [1], padded to 4 rows with padding rows at slots [-1, 0, 3]) "
            f"changed free slot {last} ({what}), which it did not schedule: field conv, max |change|") in report, report
    if placement.cp == 1:  # the full pool: its last slot is sequence 2's, live, not in the call
        assert "qwen3_5/tp2/seed12/full-pool" in report, report
        assert ("call 2 (decode of sequences [1] in slots [1], padded to 4 rows with padding rows at slots "
                "[-1, 0, -1]) changed live slot 2 (sequence 2, chunks 2+3, then 2 decode steps), which it did not "
                "schedule: field conv, max |change|") in report, report


# ---- the headline: the earliest call that goes wrong ---------------------------------------


def _call_index(module):
    module.calls_run = getattr(module, "calls_run", -1) + 1
    return module.calls_run


def prefill_off_at_call_6(module, x, cu_seqlens, pool, slots, fresh, placement):
    """Call 6 (a prefill of two fresh sequences) returns its first output wrong: position 0."""
    i = _call_index(module)
    y = pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement)
    return torch.cat([y[:, :1] + 1, y[:, 1:]], dim=1) if i == 6 else y


def decode_off_at_call_2(module, x, pool, slots, num_valid, placement):
    """Call 2 (a decode of sequence 1's token 3) returns its outputs wrong."""
    i = _call_index(module)
    y = pool_decode(module, x, pool, slots, num_valid, placement)
    return y + 1 if i == 2 else y


def test_headline_is_the_earliest_wrong_call(spawn):
    with pytest.raises(AssertionError) as info:
        check(spawn, pool_path(prefill=prefill_off_at_call_6, decode=decode_off_at_call_2), Placement(tp=2))
    report = str(info.value).split("full-pool")[0]
    output = report[report.index("output tp_rank0"):]
    assert ("2 token(s) off; first wrong token: sequence 1 (chunks 3, then 3 decode steps) token 3, call 2 (decode "
            "of sequences [1] in slots [1], padded to 4 rows with padding rows at slots [-1, 0, 3]), its slot 1 (its "
            "first holder), error") in output, report
    assert ("\n  lowest wrong position: sequence 3 (chunks 1, then 4 decode steps) token 0, call 6 (prefill of "
            "sequences [3, 4] in slots [1, 2]), its slot 1 (held before by sequence 1), error") in output, report


# ---- the pool's dtype per field -------------------------------------------------------------


def _dtypes_as_declared(pool):
    if (pool.conv.dtype, pool.recurrent.dtype) != (torch.bfloat16, torch.float32):
        raise AssertionError(f"the pool's fields came as conv {pool.conv.dtype}, recurrent {pool.recurrent.dtype}; "
                             "declared: conv in the ranks' bf16, recurrent float32")


def prefill_checking_dtypes(module, x, cu_seqlens, pool, slots, fresh, placement, **prefix):
    _dtypes_as_declared(pool)
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, **prefix)


def decode_checking_dtypes(module, x, pool, slots, num_valid, placement):
    _dtypes_as_declared(pool)
    return pool_decode(module, x, pool, slots, num_valid, placement)


BF16_RTOL = 5e-2  # per token, of the RMS norm: bf16 compute reaches 3.9e-2 here (a fresh sequence's token 0)


def test_float32_recurrent_pool_under_bf16_ranks(spawn):
    """vLLM's mamba_ssm_cache_dtype=float32: the recurrent pool in float32 under a bf16 layer."""
    path = dataclasses.replace(pool_path(prefill=prefill_checking_dtypes, decode=decode_checking_dtypes),
                               state_dtypes={"recurrent": torch.float32})
    check(spawn, path, Placement(tp=2), dtype=torch.bfloat16, rtol=BF16_RTOL)
    # what the rank keeps between calls (the final states, the snapshots) keeps the pool's dtypes
    bounds = [int(b) for b in CU]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, bounds[-1], CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    calls = pool_schedule(PLANS, bounds, 3, 4, CONFIG.hidden_size, gen, CAPTURE_SIZES, block_size=1)
    snapshots = sum(int(s >= 0) for c in calls if c.kind == "prefill" for s in c.snapshot_slots)
    with torch.no_grad():
        _, probe = reference()(x[:, :1], torch.tensor([0, 1], dtype=torch.int32), None, output_final_state=True)
    pool = LayerState(*(torch.randn((4 + snapshots,) + tuple(t.shape[1:]), generator=gen, dtype=torch.float64)
                        for t in probe))
    case = RankPool(dataclasses.replace(path, shard_state=None, unshard_state=None), Placement(),
                    {k: t.detach() for k, t in reference().named_parameters()}, x, pool, calls, torch.bfloat16,
                    ["conv", "recurrent"])
    (result,) = spawn(run_pool_on_rank, 1, case)
    assert (result["final"].conv.dtype, result["final"].recurrent.dtype) == (torch.bfloat16, torch.float32)
    assert result["snapshots"] and all((conv.dtype, recurrent.dtype) == (torch.bfloat16, torch.float32)
                                       for conv, recurrent in result["snapshots"].values())


def test_state_dtypes_names_a_field_of_the_state(spawn):
    path = dataclasses.replace(pool_path(), state_dtypes={"ssm": torch.float32})
    with pytest.raises(ValueError, match=r"state_dtypes names field 'ssm'; the state's fields are \['conv', "
                                         r"'recurrent'\]"):
        check(spawn, path, Placement(tp=2))
    with pytest.raises(ValueError, match=r"StatePoolPath.state_dtypes must map field names to floating-point "
                                         r"torch.dtypes"):
        dataclasses.replace(pool_path(), state_dtypes={"recurrent": torch.int32})


# ---- the engine's padding convention --------------------------------------------------------


def _rows(mask, rows):
    return mask.view(-1, *[1] * (rows.dim() - 1))


def decode_every_row_null_block(module, x, pool, slots, num_valid, placement):
    """vLLM's convention: the captured graph runs every row; a row at the null block (slot 0, or
    below) starts from zeros and writes its state there, the engine's scratch."""
    null = slots <= 0
    rows = slots.clamp(min=0)
    state = LayerState(*(torch.where(_rows(null, f[rows]), torch.zeros_like(f[rows]), f[rows]) for f in pool))
    y, new = module.step(x, state)
    for f, n in zip(pool, new):
        f[rows] = n
    return y


def decode_every_row_skipping_minus_1(module, x, pool, slots, num_valid, placement):
    """sglang's convention: every row runs; a row at -1 starts from zeros and writes nothing."""
    pad = slots < 0
    rows = slots.clamp(min=0)
    state = LayerState(*(torch.where(_rows(pad, f[rows]), torch.zeros_like(f[rows]), f[rows]) for f in pool))
    y, new = module.step(x, state)
    for f, n in zip(pool, new):
        f[slots[~pad]] = n[~pad]
    return y


def decode_every_row_clamping_minus_1(module, x, pool, slots, num_valid, placement):
    """The plant: an sglang-convention kernel that clamps -1 to 0, so a padding row writes its
    state into slot 0, a live sequence's (the valid rows, written last, win a tie)."""
    pad = slots < 0
    rows = slots.clamp(min=0)
    state = LayerState(*(torch.where(_rows(pad, f[rows]), torch.zeros_like(f[rows]), f[rows]) for f in pool))
    y, new = module.step(x, state)
    for f, n in zip(pool, new):
        f[rows[pad]] = n[pad]
        f[rows[~pad]] = n[~pad]
    return y


VLLM = dict(padding_slot=0, reserved_slots=(0,))
SGLANG = dict(padding_slot=-1)


def test_reserved_slot_0_is_never_scheduled_and_takes_the_padding():
    for P in (5, 4):  # slot 0 reserved, then 3 live at most: with a spare slot and full
        calls = pool_schedule(PLANS, [int(b) for b in CU], 3, P, CONFIG.hidden_size, torch.Generator().manual_seed(0),
                              CAPTURE_SIZES, **VLLM)
        assert all(0 not in c.live.values() for c in calls), calls
        assert all(c.slots[c.num_valid:] == (0,) * (len(c.slots) - c.num_valid) for c in calls if c.kind == "decode")
    calls = pool_schedule(PLANS, [int(b) for b in CU], 3, 4, CONFIG.hidden_size, torch.Generator().manual_seed(0),
                          CAPTURE_SIZES, **SGLANG)
    assert {s for c in calls if c.kind == "decode" for s in c.slots[c.num_valid:]} == {-1}


def test_vllm_convention_null_block_passes(spawn):
    # the padding rows write slot 0, the reserved null block: allowed; every other slot is checked
    check(spawn, dataclasses.replace(pool_path(decode=decode_every_row_null_block), **VLLM), Placement(tp=2))


def test_sglang_convention_write_into_slot_0_is_caught(spawn):
    check(spawn, dataclasses.replace(pool_path(decode=decode_every_row_skipping_minus_1), **SGLANG), Placement(tp=2))
    with pytest.raises(AssertionError) as info:
        check(spawn, dataclasses.replace(pool_path(decode=decode_every_row_clamping_minus_1), **SGLANG),
              Placement(tp=2))
    report = str(info.value)
    assert ("call 2 (decode of sequences [1] in slots [1], padded to 4 rows with padding rows at slots [-1, -1, -1]) "
            "changed live slot 0 (sequence 0, chunks 1+4+2, then 2 decode steps), which it did not schedule: field "
            "conv, max |change|") in report, report
    # the vLLM client under sglang's convention: its null block is sequence 0's slot
    with pytest.raises(AssertionError, match=r"changed live slot 0 \(sequence 0"):
        check(spawn, dataclasses.replace(pool_path(decode=decode_every_row_null_block), **SGLANG), Placement(tp=2))


def test_bad_padding_convention_names_the_rule():
    with pytest.raises(ValueError, match=r"StatePoolPath.padding_slot must be -1 \(a sentinel\), 0, a reserved slot "
                                         r"or 'free' \(a free slot\); None: -1, slot 0 and a free slot in turn; got 2"):
        dataclasses.replace(pool_path(), padding_slot=2)
    with pytest.raises(ValueError, match=r"StatePoolPath.reserved_slots must be distinct slot indices >= 0"):
        dataclasses.replace(pool_path(), reserved_slots=(-1,))
