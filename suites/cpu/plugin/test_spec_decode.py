"""The speculative-decoding mode of the state-pool check (`assert_spec_decode_parity`) on
linattn's layer through the slot-pool client with verify and accept (`clients.spec_decode`), at
TP 2, CP 2 and TP 2 x CP 2, in float64. Under CP a prefill call's tokens are split over the CP
ranks, the pool is whole on every CP rank, and the verify calls run whole on every rank.

Verify calls run 3 drafts of every sequence and accept 0..3 of them (0 and 3 in the same call).
The correct client passes; two planted bugs each fail with the call, the slot, the sequence and
the token named: an accept that keeps one rejected draft's update (sglang #27658's and #40419's
class: a verify that leaves the state advanced or scrambled), and a verify that starts from a
zeroed state instead of the slot's (sglang #27658: verify replayed from zero-initialised buffers).
A path's `state_dtypes` gives the pool's dtype per field: a float32 recurrent pool under bf16
ranks reaches the client's verify and accept in float32.
"""


import dataclasses

import pytest
import torch

from cases.layer_parity import make_config, replicated_layer
from linattn.layers import LayerState
from pytest_linattn.harness import Placement, SpecPlan, assert_spec_decode_parity
from pytest_linattn.harness.spec_decode import spec_schedule
from pytest_linattn.parity import capture_records
from clients.spec_decode import linattn_spec_path, pool_accept, pool_verify, verify_states
from clients.state_pool import pool_prefill

CONFIG = make_config("qwen3_5", 1)
K = 3
# a 1-token first chunk, a 4-token chunk from a state; every verify call mixes counts, round 1
# accepts 2, 3, 0 and 1
PLANS = [SpecPlan((3,), (2, 0, 3)), SpecPlan((1, 4), (3, 1)), SpecPlan((2,), (0, 2, 1)), SpecPlan((5,), (1, 3, 0))]
RTOL = 1e-10


def reference(seed=21):
    return replicated_layer(CONFIG, seed)


def accept_keeping_a_rejected_draft(module, pool, slots, num_accepted_tokens, placement):
    """The state one token past the accepted ones: the first rejected draft's update stays."""
    rows = torch.arange(slots.numel(), device=slots.device)
    kept_index = (num_accepted_tokens + 1).clamp(max=module.verify_states[0].shape[0] - 1)
    for f, kept in zip(pool, module.verify_states):
        f[slots] = kept[kept_index, rows]


def verify_from_zeros(module, x, cu_seqlens, pool, slots, placement):
    """The drafts replayed from zero-initialised buffers instead of the slot's state."""
    y, module.verify_states = verify_states(module, x, cu_seqlens,
                                            LayerState(*(torch.zeros_like(f[slots]) for f in pool)))
    return y


def check(spawn, path, placement):
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_spec_decode_parity(spawn, path, reference(), [placement], PLANS, num_draft=K,
                                  hidden_size=CONFIG.hidden_size, seed=22, rtol=RTOL, name="qwen3_5")


def test_schedule_verifies_k_drafts_accepting_0_to_k():
    x = torch.randn(1, sum(pl.length for pl in PLANS), 4, dtype=torch.float64)
    bounds = torch.tensor([0] + [pl.length for pl in PLANS]).cumsum(0).tolist()
    calls = spec_schedule(PLANS, bounds, x, K, torch.Generator().manual_seed(0))
    verify = [c for c in calls if c.kind == "verify"]
    assert [c.accepted for c in verify] == [(2, 3, 0, 1), (0, 1, 2, 3), (3, 1, 0)], verify
    assert all(c.x.shape[1] == K * len(c.sequences) for c in verify)
    assert sorted(calls[0].slots) == [1, 2, 3, 4]  # slot 0 free: a write there shows
    # the drafts after the accepted tokens are not the sequence's next tokens
    first = verify[0]
    assert torch.equal(first.x[:, :2], x[:, 3:5]) and not torch.equal(first.x[:, 2], x[0, 5])


@pytest.mark.parametrize("placement", [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2)],
                         ids=["tp2", "cp2", "tp2-cp2"])
def test_spec_decode_client_and_plants(spawn, placement):
    check(spawn, linattn_spec_path(CONFIG), placement)  # the correct client passes
    with pytest.raises(AssertionError) as kept:
        check(spawn, linattn_spec_path(CONFIG, accept=accept_keeping_a_rejected_draft), placement)
    report = str(kept.value)
    # round 1: sequence 0 accepted 2 of 3; its slot holds the state one draft further
    assert ("call 2 (verify round 1: 3 drafts each of sequences [0, 1, 2, 3] in slots [4, 3, 2, 1], accepted "
            "[2, 3, 0, 1]): slot 4, sequence 0 (chunks 3, then verify rounds accepting [2, 0, 3]), state after "
            "token 4, 2 of 3 drafts accepted: field") in report, report
    assert "slot 3, sequence 1" not in report.split("first wrong states")[1].split("call 3")[0]  # 3 of 3: right
    with pytest.raises(AssertionError) as zeroed:
        check(spawn, linattn_spec_path(CONFIG, verify=verify_from_zeros), placement)
    report = str(zeroed.value)
    assert ("call 2 (verify round 1: 3 drafts each of sequences [0, 1, 2, 3] in slots [4, 3, 2, 1], accepted "
            "[2, 3, 0, 1]): slot 4, sequence 0 (chunks 3, then verify rounds accepting [2, 0, 3]), token 3: output "
            "error") in report, report
    # j = 0 accepts nothing: its outputs are all drafts, the first one located as such
    assert "slot 2, sequence 2 (chunks 2, then verify rounds accepting [0, 2, 1]), draft 1 of 3 (rejected; after " \
           "token 1)" in report, report


def _dtypes_as_declared(pool):
    if (pool.conv.dtype, pool.recurrent.dtype) != (torch.bfloat16, torch.float32):
        raise AssertionError(f"the pool's fields came as conv {pool.conv.dtype}, recurrent {pool.recurrent.dtype}; "
                             "declared: conv in the ranks' bf16, recurrent float32")


def prefill_checking_dtypes(module, x, cu_seqlens, pool, slots, fresh, placement):
    _dtypes_as_declared(pool)
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement)


def verify_checking_dtypes(module, x, cu_seqlens, pool, slots, placement):
    _dtypes_as_declared(pool)
    return pool_verify(module, x, cu_seqlens, pool, slots, placement)


def accept_checking_dtypes(module, pool, slots, num_accepted_tokens, placement):
    pool_accept(module, pool, slots, num_accepted_tokens, placement)
    _dtypes_as_declared(pool)


def test_float32_recurrent_pool_under_bf16_ranks(spawn):
    path = dataclasses.replace(linattn_spec_path(CONFIG, prefill=prefill_checking_dtypes, verify=verify_checking_dtypes,
                                                 accept=accept_checking_dtypes),
                               state_dtypes={"recurrent": torch.float32})
    with capture_records():
        assert_spec_decode_parity(spawn, path, reference(), [Placement(tp=2)], PLANS, num_draft=K,
                                  hidden_size=CONFIG.hidden_size, seed=22, rtol=5e-2, dtype=torch.bfloat16,
                                  name="qwen3_5")


def test_bad_input_names_the_parameter_and_the_rule():
    with pytest.raises(ValueError, match=r"plans\[1\]\.accepted must lie in 0\.\.num_draft \(3\), got \[4\]"):
        assert_spec_decode_parity(None, linattn_spec_path(CONFIG), reference(), [Placement(tp=2)],
                                  [SpecPlan((2,), (1,)), SpecPlan((2,), (4,))], num_draft=K, hidden_size=20, seed=0,
                                  rtol=RTOL)
    with pytest.raises(ValueError, match=r"SpecPlan.accepted must be ints >= 0"):
        SpecPlan((2,), (-1,))
    # CP runs in the contiguous layout without sequence parallel (each prefill call cut in contiguous pieces)
    for placement in (Placement(cp=2, cp_layout="zigzag"), Placement(tp=2, sequence_parallel=True)):
        with pytest.raises(ValueError, match=r"placements: the spec-decode mode runs TP, CP in the contiguous layout "
                                             r"\(each prefill call cut in contiguous pieces over the CP ranks\) and "
                                             r"TP x CP, without sequence parallel; got " + placement.name):
            assert_spec_decode_parity(None, linattn_spec_path(CONFIG), reference(), [placement], PLANS,
                                      num_draft=K, hidden_size=20, seed=0, rtol=RTOL)
