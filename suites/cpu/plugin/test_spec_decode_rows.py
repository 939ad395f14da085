"""The speculative-decoding check in vLLM's layout (`SpecDecodePath.bonus_token`,
`slots_per_sequence`, `read_state`): every verify call runs the sequence's next token, always
accepted, then K drafts; each sequence holds a row of 1 + K slots, the state after token t of a
call goes to column t, and the next call starts from column num_accepted_tokens - 1 (nothing is
copied back). linattn's layer through `clients.spec_decode.linattn_row_spec_path`, at TP 2, in
float64 (fla's kernel in this layout: suites/cpu/library/test_fla_spec_decode.py).

The correct client passes; an accept that keeps num_accepted_tokens one too high (the first
rejected draft's state) fails with the call, the row, the sequence and the drafts accepted named.
"""


import re

import pytest
import torch

from cases.layer_parity import make_config, replicated_layer
from pytest_linattn.harness import Placement, SpecDecodePath, SpecPlan, assert_spec_decode_parity
from pytest_linattn.harness.spec_decode import spec_schedule
from pytest_linattn.parity import capture_records
from clients.spec_decode import linattn_row_spec_path, row_accept

CONFIG = make_config("qwen3_5", 1)
K = 2
# round 1 accepts 1, 2 and 0 drafts; round 2 2, 0 and 1
PLANS = [SpecPlan((3,), (1, 2)), SpecPlan((1, 2), (2, 0)), SpecPlan((2,), (0, 1))]
RTOL = 1e-10


def reference(seed=61):
    return replicated_layer(CONFIG, seed)


def accept_one_too_many(module, pool, slots, num_accepted_tokens, placement):
    """The column after the accepted tokens': the first rejected draft's state (K + 1 clamped)."""
    row_accept(module, pool, slots, (num_accepted_tokens + 1).clamp(max=slots.shape[1]), placement)


def test_schedule_runs_a_bonus_token_and_rows_of_slots():
    lengths = [pl.length + len(pl.accepted) for pl in PLANS]  # a bonus token per round
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    x = torch.randn(1, bounds[-1], 4, dtype=torch.float64)
    calls = spec_schedule(PLANS, bounds, x, K, torch.Generator().manual_seed(0), bonus_token=True,
                          slots_per_sequence=K + 1)
    verify = [c for c in calls if c.kind == "verify"]
    assert [c.accepted for c in verify] == [(2, 3, 1), (3, 1, 2)]  # 1 + the drafts accepted
    assert all(c.x.shape[1] == (1 + K) * len(c.sequences) for c in verify)
    # column c of sequence n in slot 1 + c*N + N-1-n: every slot but 0 held by one row
    assert calls[0].slots == ((3, 6, 9), (2, 5, 8), (1, 4, 7))
    # sequence 0 (3 tokens prefilled): round 1 runs tokens 3 and 4 (the bonus, one accepted draft),
    # then a draft; round 2 starts at token 5
    first, second = verify
    assert torch.equal(first.x[:, :2], x[:, 3:5]) and not torch.equal(first.x[:, 2], x[0, 5])
    assert torch.equal(second.x[:, :3], x[:, 5:8]) and second.starts[0] == 5


@pytest.mark.tp_sizes(2)
def test_row_client_and_plant(spawn, tp_size):
    with capture_records():  # the plant's failing comparisons stay out of the session's parity records
        assert_spec_decode_parity(spawn, linattn_row_spec_path(CONFIG, K), reference(), [Placement(tp=2)], PLANS,
                                  num_draft=K, hidden_size=CONFIG.hidden_size, seed=62, rtol=RTOL, name="rows")
        with pytest.raises(AssertionError) as failed:
            assert_spec_decode_parity(spawn, linattn_row_spec_path(CONFIG, K, accept=accept_one_too_many),
                                      reference(), [Placement(tp=2)], PLANS, num_draft=K,
                                      hidden_size=CONFIG.hidden_size, seed=62, rtol=RTOL, name="rows")
    report = str(failed.value)
    # round 1: sequence 0 accepted 1 of 2 drafts (its row's column 2 read instead of column 1)
    assert ("call 2 (verify round 1: the next token and 2 drafts each of sequences [0, 1, 2] in slots [(3, 6, 9), "
            "(2, 5, 8), (1, 4, 7)], accepted [1, 2, 0]): slot (3, 6, 9), sequence 0 (chunks 3, then verify rounds "
            "accepting [1, 2]), state after token 4, 1 of 2 drafts accepted: field") in report, report
    # all drafts accepted: the clamp keeps the right column
    assert "sequence 1 (chunks 1+2, then verify rounds accepting [2, 0]), state after token 5" not in report, report


def test_slot_rows_need_read_state():
    path = linattn_row_spec_path(CONFIG, K)
    with pytest.raises(ValueError, match=r"SpecDecodePath.read_state must be callable with slots_per_sequence > 1"):
        SpecDecodePath(path.layer, path.prefill, path.verify, path.accept, slots_per_sequence=3)
    with pytest.raises(ValueError, match=r"SpecDecodePath.slots_per_sequence must be a positive int, got 0"):
        SpecDecodePath(path.layer, path.prefill, path.verify, path.accept, slots_per_sequence=0)


def test_mixed_calls_describe_each_row_s_drafts():
    # a row of 0 drafts runs its bonus token alone beside rows of K: the call's cu_seqlens says so
    plans = [SpecPlan((3,), (2, 0), drafts=(2, 0)), SpecPlan((2,), (0, 1), drafts=(0, 2))]
    lengths = [pl.length + len(pl.accepted) for pl in plans]
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    x = torch.randn(1, bounds[-1], 4, dtype=torch.float64)
    calls = spec_schedule(plans, bounds, x, K, torch.Generator().manual_seed(0), bonus_token=True,
                          slots_per_sequence=K + 1)
    verify = [c for c in calls if c.kind == "verify"]
    assert [c.cu_seqlens.diff().tolist() for c in verify] == [[3, 1], [1, 3]]
    assert [c.accepted for c in verify] == [(3, 1), (1, 2)]
    assert str(plans[0]) == "chunks 3, then verify rounds accepting [2, 0] of drafts [2, 0]"


@pytest.mark.parametrize("fields, says", [
    (dict(chunks=(3,), accepted=(1, 0), drafts=(2,)), "one per verify round"),
    (dict(chunks=(3,), accepted=(2,), drafts=(1,)), "must not exceed the round's drafts"),
    (dict(chunks=(3,), accepted=(0,), drafts=(-1,)), "ints >= 0"),
])
def test_spec_plan_drafts_are_checked(fields, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        SpecPlan(**fields)


def test_zero_drafts_need_a_bonus_token_and_at_most_num_draft():
    from clients.spec_decode import linattn_spec_path

    base = dict(num_draft=K, hidden_size=CONFIG.hidden_size, seed=0, rtol=RTOL)
    with pytest.raises(ValueError, match="runs no token without the path's bonus_token"):
        assert_spec_decode_parity(None, linattn_spec_path(CONFIG), reference(), [Placement()],
                                  [SpecPlan((2,), (0,), drafts=(0,))], **base)
    with pytest.raises(ValueError, match=re.escape("plans[0].drafts must lie in 0..num_draft (2)")):
        assert_spec_decode_parity(None, linattn_row_spec_path(CONFIG, K), reference(), [Placement()],
                                  [SpecPlan((2,), (0,), drafts=(3,))], **base)
