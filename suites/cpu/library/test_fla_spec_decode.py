"""Speculative decoding through fla's KDA serving kernel (suites/clients/fla_spec_decode.py:
verify calls on `fused_recurrent_kda_fwd` with `ssm_state_indices` `[N, 1 + K]`, a slot per token,
and `num_accepted_tokens` picking the column the next call starts from; prefill on `chunk_kda`)
under the fla_on_cpu emulation, float64, at TP 2, through `assert_spec_decode_parity` against
linattn's replicated float64 layer (<= 1e-10).

Every verify call runs the sequence's next token and K = 3 drafts, accepting 0..3 drafts, a
different count per sequence in one call (0 and 3 in the same call). Two plants: a verify that
leaves `num_accepted_tokens` out, so the kernel starts every sequence from column 0 of its row
(the state after the previous call's first token), fails where a sequence accepted a draft in the
round before, located; a verify that passes num_accepted_tokens one short (the accepted drafts,
not counting the bonus token) makes the kernel read column -1 where none was accepted, before the
row (on a GPU: the previous row's last slot, or memory before the index tensor): the emulation
refuses it, naming the argument.
"""


import pytest

from cases.layer_parity import make_config, replicated_layer
from pytest_linattn.harness import Placement, SpecPlan, assert_spec_decode_parity
from pytest_linattn.parity import capture_records

CONFIG = make_config("kda", 2)  # bounded gate, two value heads per key head
K = 3
# a 1-token first chunk, a chunk from a state; round 1 accepts 2, 3, 0 and 1 drafts, round 2
# 0, 1, 2 and 3: each count after each other count somewhere
PLANS = [SpecPlan((3,), (2, 0, 3)), SpecPlan((1, 4), (3, 1)), SpecPlan((2,), (0, 2, 1)), SpecPlan((5,), (1, 3, 0))]
RTOL = 1e-10


def reference(seed=41):
    return replicated_layer(CONFIG, seed)


def verify_from_column_0(module, x, cu_seqlens, pool, slots, placement):
    """num_accepted_tokens not passed: fla's kernel starts every sequence from column 0."""
    y, token_convs = module.pool_verify(x, cu_seqlens, pool.conv[slots[:, 0]], pool.recurrent, slots, None)
    pool.conv[slots] = token_convs.to(pool.conv.dtype)
    return y


def verify_one_short(module, x, cu_seqlens, pool, slots, placement):
    """num_accepted_tokens passed one short (the accepted drafts, the bonus token not counted)."""
    from clients.spec_decode import current_slots, num_accepted

    accepted = num_accepted(module, pool, slots)
    y, token_convs = module.pool_verify(x, cu_seqlens, pool.conv[current_slots(slots, accepted)], pool.recurrent,
                                        slots, accepted - 1)
    pool.conv[slots] = token_convs.to(pool.conv.dtype)
    return y


def check(spawn, path):
    assert_spec_decode_parity(spawn, path, reference(), [Placement(tp=2)], PLANS, num_draft=K,
                              hidden_size=CONFIG.hidden_size, seed=42, rtol=RTOL, name="fla-kda-spec")


@pytest.mark.tp_sizes(2)
def test_fla_spec_client_matches_the_serial_run(spawn, fla_on_cpu, tp_size):
    from clients.fla_spec_decode import fla_spec_path

    check(spawn, fla_spec_path(CONFIG, K))


@pytest.mark.tp_sizes(2)
def test_verify_from_column_0_is_located(spawn, fla_on_cpu, tp_size):
    from clients.fla_spec_decode import fla_spec_path

    with capture_records(), pytest.raises(AssertionError) as failed:
        check(spawn, fla_spec_path(CONFIG, K, verify=verify_from_column_0))
    report = str(failed.value)
    # round 1 starts from column 0 (after the prefill): right; round 2 of sequence 0, which accepted
    # 2 drafts in round 1, starts from the state after round 1's bonus token, not after its 2nd draft
    assert ("call 3 (verify round 2: the next token and 3 drafts each of sequences [0, 1, 2, 3] in slots "
            "[(4, 8, 12, 16), (3, 7, 11, 15), (2, 6, 10, 14), (1, 5, 9, 13)], accepted [0, 1, 2, 3]): slot "
            "(4, 8, 12, 16), sequence 0 (chunks 3, then verify rounds accepting [2, 0, 3]), token 6: output "
            "error") in report, report
    first_wrong = report.split("first wrong outputs (by call):\n")[1].splitlines()
    assert first_wrong[0].startswith("  call 3 (verify round 2"), report  # round 1 was right
    # sequence 2 accepted no draft in round 1: column 0 is its state, its round 2 is right
    assert "sequence 2 (chunks 2, then verify rounds accepting [0, 2, 1]), token 3" not in report, report


@pytest.mark.tp_sizes(2)
def test_num_accepted_tokens_one_short_is_refused(spawn, fla_on_cpu, tp_size):
    from clients.fla_spec_decode import fla_spec_path

    with capture_records(), pytest.raises(Exception, match=r"num_accepted_tokens.*reads column -1"):
        check(spawn, fla_spec_path(CONFIG, K, verify=verify_one_short))
