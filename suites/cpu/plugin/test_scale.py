"""The at-scale check (pytest_linattn.harness.scale) at small shapes on the CPU: the project's
torch kernels in float32 against the float64 reference computed in pieces with the state passed
along, forward and backward; and a plant of fla #1080's mechanism (an element offset that wraps
at a narrow width, here 2**17 instead of 2**31) caught with its first wrong token and head."""

import re

import pytest
import torch

from linattn import kernels
from bug_record.plants_scale import WRAP, gated_delta_rule_reading_v_through_wrapped_offsets
from pytest_linattn.harness.scale import ScaleShape, assert_delta_rule_at_scale, delta_rule_at_scale

GDN = ScaleShape("gdn-small", 3000, heads=2, v_heads=4, head_k_dim=16, head_v_dim=16)
KDA = ScaleShape("kda-small", 1100, heads=2, v_heads=2, head_k_dim=16, head_v_dim=16, per_channel_decay=True)


def torch_op(per_channel_decay):
    entry = kernels.kda if per_channel_decay else kernels.gated_delta_rule
    return lambda q, k, v, g, beta: entry(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]


@pytest.mark.parametrize("shape", [GDN, KDA], ids=lambda s: s.name)
def test_float32_kernels_match_float64_pieces(shape):
    result = assert_delta_rule_at_scale(torch_op(shape.per_channel_decay), shape, rtol=1e-5, dtype=torch.float32,
                                        device="cpu", seed=3, piece_tokens=512)
    assert set(result.errors) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert all(r is None for r in result.first_wrong.values())


def test_pieces_equal_one_reference_call():
    """The piecewise reference is the reference: float64 subject, one piece against many."""
    shape = ScaleShape("one-piece", 700, heads=1, v_heads=2, head_k_dim=8, head_v_dim=8)

    def float64_op(q, k, v, g, beta):
        return kernels.gated_delta_rule(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]

    result = delta_rule_at_scale(float64_op, shape, dtype=torch.float64, device="cpu", seed=4, piece_tokens=128)
    # dg is a reverse cumulative sum of terms that cancel: float64 keeps it to 1e-7 here, not 1e-12
    assert all(err < (1e-7 if name == "dg" else 1e-12) for name, err in result.errors.items()), result.errors


def test_a_wrapped_offset_is_located_at_its_first_token_and_head():
    with pytest.raises(AssertionError) as info:
        assert_delta_rule_at_scale(gated_delta_rule_reading_v_through_wrapped_offsets, GDN, rtol=1e-5, dtype=torch.float32, device="cpu", seed=3,
                                   piece_tokens=512)
    first_token = WRAP // (GDN.v_heads * GDN.head_v_dim)  # 2048: the first row read through a wrapped offset
    report = str(info.value)
    # the outputs go wrong at the first token read through a wrapped offset (its head: the first
    # whose row moves by more than ROW_TOL); v's gradient at token 0, where the wrapped reads land
    assert re.search(rf"gdn-small o: relative error .* first wrong row token {first_token:,} head \d ", report), report
    assert re.search(rf"gdn-small dq: .* first wrong row token {first_token:,} head 0 ", report), report
    assert re.search(r"gdn-small dv: .* first wrong row token 0 head \d ", report), report


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="ScaleShape.v_heads"):
        ScaleShape("bad", 10, heads=3, v_heads=4)
    with pytest.raises(ValueError, match="ScaleShape.tokens"):
        ScaleShape("bad", 0, heads=1, v_heads=1)


def test_element_counts_past_int32():
    """The scale suite's shapes: fla #1080's tokens put the value input past 2**31; half of them
    puts fla's 64-token chunk states (h, dh) past it while the inputs stay at 2**30."""
    past_inputs = ScaleShape("qwen3.5-4b", (1 << 19) + (1 << 12), heads=16, v_heads=32)
    past_states = ScaleShape("qwen3.5-4b", (1 << 18) + (1 << 11), heads=16, v_heads=32)
    assert past_inputs.largest_offset == past_states.chunk_state_elements() == 2**31 + 2**24
    assert past_states.largest_offset == 2**30 + 2**23
    assert ScaleShape("ragged", 65, heads=1, v_heads=1, head_k_dim=2, head_v_dim=3).chunk_state_elements() == 2 * 6
    with pytest.raises(ValueError, match="chunk_size"):
        past_states.chunk_state_elements(0)
