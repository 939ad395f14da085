"""The padded-batch mode of the continuation check (`assert_padded_continuation_parity`) on
linattn's layer through the padded-batch client (`clients.padded`: unpad to packed tokens and
cu_seqlens, run, repad), at TP 2, CP 2 and TP 2 x CP 2, in float64. Under CP a prefill call's
tokens (in row order) are split over the CP ranks and a decode step runs whole on every rank.

Left padding with padding runs that straddle call boundaries (a call holding only a row's pads),
and right padding with prompts ending before and inside a call. The correct client passes; two
planted bugs each fail with the call, the row and the token named: left pads that enter the conv
state (transformers #47086, the mask skipped on continued forwards; maxtext #5295, left pads in
the causal conv), and a right-padded prefill whose final conv state takes the pad tokens
(transformers #47086's right-padding case).
"""


import pytest
import torch

from cases.layer_parity import make_config, replicated_layer
from linattn.layers import LayerState
from clients.padded import linattn_padded_path, padded_forward, step_rows, zero_state
from pytest_linattn.harness import Placement, assert_padded_continuation_parity
from pytest_linattn.harness.padded import padded_schedule
from pytest_linattn.parity import capture_records

CONFIG = make_config("qwen3_5", 1)
SEQLENS = (7, 3, 5, 1)
WIDTH = 8
# left: row 1's 5 pads fill call 0 and straddle into call 1; row 3's 7 pads span calls 0..2.
# right: row 3 ends in call 0, row 1 inside call 1, then both only pad
CUTS = {"left": (3, 5), "right": (2, 5)}
RTOL = 1e-10


def reference(seed=31):
    return replicated_layer(CONFIG, seed)


def _conv_state_with_pads(module, x, mask, state, placement, held, which):
    """The client's result, but each row with `which` pads in the call (before its first token, or
    after its last) takes the conv state of a run over all its columns, pads included (the
    layer's one-token step column by column: the same on every CP rank, whatever it holds)."""
    y, new = padded_forward(module, x, mask, state, placement, held)
    state = zero_state(module, x.shape[0], x.dtype) if state is None else state
    edge = mask[:, 0] if which == "leading" else mask[:, -1]
    rows = torch.nonzero(~edge & (mask.any(dim=1) if which == "trailing" else torch.ones_like(edge))).flatten()
    if rows.numel():
        with_pads = LayerState(*(f[rows] for f in state))
        for col in range(x.shape[1]):
            _, with_pads = step_rows(module, x[rows, col:col + 1], torch.ones_like(mask[rows, col:col + 1]),
                                     with_pads)
        new.conv[rows] = with_pads.conv
    return y, new


def left_pads_in_conv_state(module, x, attention_mask, state, placement, held=None):
    """Left pads taken as tokens by the conv state (not by the outputs or the recurrence)."""
    return _conv_state_with_pads(module, x, attention_mask, state, placement, held, "leading")


def right_pads_in_conv_state(module, x, attention_mask, state, placement, held=None):
    """A right-padded call's conv state: the last W-1 columns, pads included."""
    return _conv_state_with_pads(module, x, attention_mask, state, placement, held, "trailing")


PLACEMENTS = pytest.mark.parametrize("placement", [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2)],
                                     ids=["tp2", "cp2", "tp2-cp2"])


def check(spawn, path, padding, placement):
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_padded_continuation_parity(spawn, path, reference(), [placement], SEQLENS, padding=padding,
                                          cuts=CUTS[padding], decode=2, width=WIDTH, hidden_size=CONFIG.hidden_size,
                                          seed=32, rtol=RTOL, name="qwen3_5")


def test_schedule_pads_left_and_right_across_call_boundaries():
    bounds = torch.tensor([0] + [n + 2 for n in SEQLENS]).cumsum(0).tolist()
    tokens = torch.randn(1, bounds[-1], 4, dtype=torch.float64)
    left = padded_schedule(SEQLENS, bounds, tokens, "left", WIDTH, CUTS["left"], 2, torch.Generator().manual_seed(0))
    assert [(c.kind, c.start, c.stop) for c in left] == [("prefill", 0, 3), ("prefill", 3, 5), ("prefill", 5, 8),
                                                         ("decode", 8, 9), ("decode", 9, 10)]
    assert not left[0].mask[1].any() and not left[1].mask[1].any() and left[2].mask[1].all()  # straddling pads
    assert torch.equal(left[2].x[1], tokens[0, bounds[1]:bounds[1] + 3])
    assert all((c.x[~c.mask] != 0).all() for c in left)  # pads random, never zeros
    right = padded_schedule(SEQLENS, bounds, tokens, "right", WIDTH, CUTS["right"], 2,
                            torch.Generator().manual_seed(0))
    assert right[1].mask[1].tolist() == [True, False, False] and right[3].mask.all()


@PLACEMENTS
def test_padded_client_and_plants(spawn, placement):
    for padding in ("left", "right"):  # the correct client passes
        check(spawn, linattn_padded_path(CONFIG), padding, placement)
    with pytest.raises(AssertionError) as left:
        check(spawn, linattn_padded_path(CONFIG, forward=left_pads_in_conv_state), "left", placement)
    report = str(left.value)
    # row 1's first call holds only pads: its conv state must stay zero
    assert ("call 0 (prefill of columns 0..2, pads per row [1, 3, 3, 3]): row 1 (a 3-token prompt), state before "
            "its first token (zeros): field conv error") in report, report
    assert "call 2 (prefill of columns 5..7, pads per row [0, 0, 0, 2]): row 1 (a 3-token prompt), token 0" in report, \
        report
    with pytest.raises(AssertionError) as right:
        check(spawn, linattn_padded_path(CONFIG, forward=right_pads_in_conv_state), "right", placement)
    report = str(right.value)
    assert ("call 0 (prefill of columns 0..1, pads per row [0, 0, 0, 1]): row 3 (a 1-token prompt), state after "
            "token 0: field conv error") in report, report
    # row 2's prompt ends at call 1's last column, then only pads: no call of it has trailing pads
    assert "row 2 (a 5-token prompt), state" not in report, report


def test_bad_input_names_the_parameter_and_the_rule():
    path = linattn_padded_path(CONFIG)
    for kwargs, message in ((dict(padding="middle"), r"padding must be one of \('left', 'right'\)"),
                            (dict(cuts=(5, 3)), r"cuts must be increasing ints inside \(0, width=8\)"),
                            (dict(width=4), r"width must hold the longest prompt \(7 tokens\)")):
        args = dict(padding="left", cuts=(3,), decode=1, width=WIDTH, hidden_size=20, seed=0, rtol=RTOL) | kwargs
        with pytest.raises(ValueError, match=message):
            assert_padded_continuation_parity(None, path, reference(), [Placement(tp=2)], SEQLENS, **args)
    args = dict(padding="left", cuts=(2, 5), decode=1, width=WIDTH, hidden_size=20, seed=0, rtol=RTOL)
    with pytest.raises(ValueError, match=r"placements: the padded mode runs TP, CP in the contiguous layout .* without "
                                         r"sequence parallel; got cp2-zigzag"):
        assert_padded_continuation_parity(None, path, reference(), [Placement(cp=2, cp_layout="zigzag")], SEQLENS,
                                          **args)
    # at CP 4 call 0 (columns 0..1) holds row 0's one token: a filler of 3 tokens does not fit its 2 columns
    with pytest.raises(ValueError, match=r"cuts: under CP a prefill call's tokens are padded to a multiple of cp=4 "
                                         r"by a filler row's tokens in the call's columns; call 0 \(columns 0\.\.1\) "
                                         r"has 2 column\(s\) for the 3 it needs"):
        assert_padded_continuation_parity(None, path, reference(), [Placement(cp=4)], SEQLENS, **args)
