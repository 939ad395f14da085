"""Padded THD under CP (gloo, CPU): every sequence padded to a multiple of 2*cp, the padded
sequences laid out as zigzag (the harness's Placement(cp_layout="zigzag-padded"); linattn's
layer: cp_layout="zigzag" with forward(..., cu_seqlens_padded=)), against the replicated layer
on the unpadded batch, real tokens only, float64 at 1e-10.

    lengths (none divisible by 2*cp)   cp 2: 1, 6, 9, 3      cp 4: 5, 1, 13, 10
    what the pads make                 a rank holding only pads of a sequence (the 1-token one;
                                       cp 4: ranks 1-3), a real run ending inside a piece and
                                       its pads crossing the piece edge

Two plants, each caught on the output with the sequence, token and CP rank named: the padded
chunks indexed with the unpadded offsets, and each sequence's pads joined to the next
sequence's recurrence.
"""

import dataclasses
import functools
import re

import pytest
import torch

from bug_record.plants_layer import UnpaddedOffsets
from cases.layer_parity import FAMILIES, linattn_layer, make_case, make_config, random_state_dict
from linattn.layers import GatedDeltaNet, build_layer
from linattn.parallel import cp
from pytest_linattn.harness import Placement, assert_parity_cases, assert_sharded_parity, rank_token_index
from pytest_linattn.harness.placement import check_fits, padded_batch, padded_cu_seqlens, real_positions
from pytest_linattn.parity import capture_records

RTOL = 1e-10

# lengths none of which divides by 2*cp, one of a single token
LENGTHS = {2: [1, 6, 9, 3], 4: [5, 1, 13, 10]}


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


@pytest.mark.cp_sizes(2, 4)
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_cp_layer_matches_replicated(spawn, cp_size, family):
    case = make_case(make_config(family, 2 + FAMILIES.index(family) % 2), _cu(LENGTHS[cp_size]),
                     seed=31 + cp_size + 10 * FAMILIES.index(family), cp=cp_size, layout="zigzag-padded",
                     name="padded", rtol=RTOL)
    assert_parity_cases(spawn, [case], world_size=cp_size)


# ---- what a rank receives -------------------------------------------------------------------


def test_padded_layout_gives_each_rank_its_zigzag_chunks_of_the_padded_sequences():
    cu = _cu([1, 6])  # cp 2: padded to 4 and 8
    placement = Placement(cp=2, cp_layout="zigzag-padded")
    assert padded_cu_seqlens(cu, placement).tolist() == [0, 4, 12]
    assert real_positions(cu, placement).tolist() == [0, 4, 5, 6, 7, 8, 9]
    # chunks of 1 (sequence 0) and 2 (sequence 1): rank r holds chunks r and 3 - r of each
    assert rank_token_index(cu, placement, cp_rank=0).tolist() == [0, 3, 4, 5, 10, 11]
    assert rank_token_index(cu, placement, cp_rank=1).tolist() == [1, 2, 6, 7, 8, 9]
    # with SP the unit is 2*cp*tp
    assert padded_cu_seqlens(cu, Placement(tp=2, cp=2, cp_layout="zigzag-padded",
                                           sequence_parallel=True)).tolist() == [0, 8, 16]


def test_padded_batch_keeps_real_tokens_and_fills_pads_with_random_inputs_and_a_zero_cotangent():
    cu = _cu([1, 6])
    placement = Placement(cp=2, cp_layout="zigzag-padded")
    gen = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(1, 7, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    x_padded, dy_padded = padded_batch(x, dy, cu, placement)
    real = real_positions(cu, placement)
    pads = torch.ones(12, dtype=torch.bool)
    pads[real] = False
    assert torch.equal(x_padded[:, real], x) and torch.equal(dy_padded[:, real], dy)
    assert bool((x_padded[:, pads] != 0).all()), "pad inputs must be random, never zeros"
    assert bool((dy_padded[:, pads] == 0).all()), "the loss mask: no pad output enters a gradient"
    assert padded_batch(x, dy, cu, Placement(cp=2, cp_layout="zigzag")) == (x, dy)


def test_padded_placement_is_refused_where_pads_are_not_handled():
    placement = Placement(cp=2, cp_layout="zigzag-padded")
    with pytest.raises(ValueError, match="padded layouts are checked by assert_sharded_parity / assert_parity_cases"):
        check_fits([0, 1, 7], placement)  # as the training-step check calls it
    with pytest.raises(ValueError, match="Placement.cp_layout 'zigzag-padded' cuts each sequence"):
        placement.fla_layout  # noqa: B018


def test_padded_runs_split_each_padded_sequence_into_its_real_tokens_and_its_pads():
    padded, runs = cp.padded_runs(_cu([1, 6, 8]), _cu([4, 8, 8]), cp_size=2)
    assert padded.tolist() == [0, 4, 12, 20]
    assert runs.tolist() == [0, 1, 4, 10, 12, 20]  # the 8-token sequence has no pads: no empty run


# ---- rules ----------------------------------------------------------------------------------

PADDED_RULES = [
    ([0, 4, 12], "cu_seqlens_padded must hold one boundary per boundary of cu_seqlens \\(4\\), got 3"),
    ([0, 0, 8, 16], "cu_seqlens_padded must give every sequence a padded length >= its length in cu_seqlens; "
                    "\\(sequence, length, padded length\\) violating it: \\[\\(0, 1, 0\\)\\]"),
    ([0, 4, 10, 20], "cu_seqlens_padded must give every sequence a padded length divisible by 2\\*cp_size=4; "
                     "\\(sequence, padded length\\) violating it: \\[\\(1, 6\\), \\(2, 10\\)\\]"),
]


@pytest.mark.parametrize("padded, rule", PADDED_RULES)
def test_bad_cu_seqlens_padded_is_refused_naming_the_rule(padded, rule):
    with pytest.raises(ValueError, match=rule):
        cp.build_context(_cu([1, 5, 8]), None, "zigzag", cp_rank=0, cp_size=2, cu_seqlens_padded=torch.tensor(padded))


def test_layer_refuses_bad_padding_and_padding_with_state():
    config = make_config("qwen3_5", 1)
    layer = build_layer(config, dtype=torch.float64)  # no CP: padded lengths by 2
    x = torch.randn(1, 8, config.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match="cu_seqlens_padded must give every sequence a padded length divisible by "
                                         "2\\*cp_size=2; \\(sequence, padded length\\) violating it: \\[\\(0, 3\\)"):
        layer(x, _cu([1, 4]), cu_seqlens_padded=_cu([3, 5]))
    with pytest.raises(ValueError, match="hidden_states must hold cu_seqlens_padded\\[-1\\] = 8 tokens, got 6"):
        layer(x[:, :6], _cu([1, 4]), cu_seqlens_padded=_cu([2, 6]))
    with pytest.raises(ValueError, match="cu_seqlens_padded is not taken with state or output_final_state"):
        layer(x, _cu([1, 4]), output_final_state=True, cu_seqlens_padded=_cu([2, 6]))
    # without CP the pads change nothing either: the real tokens' outputs equal the unpadded run's
    layer.load_state_dict(random_state_dict(config, 4))
    real = real_positions(_cu([1, 4]), Placement(cp=1, cp_layout="zigzag-padded"))
    with torch.no_grad():
        assert torch.allclose(layer(x, _cu([1, 4]), cu_seqlens_padded=_cu([2, 6]))[:, real],
                              layer(x[:, real], _cu([1, 4])), rtol=0, atol=1e-12)


# ---- plants -------------------------------------------------------------------------------------

PLANT_CONFIG = make_config("qwen3_5", 2)


class PadsEnterTheRecurrence(GatedDeltaNet):
    """Each sequence's pads lead the next sequence's run in the recurrence (the conv's runs are
    right): the next sequence's state starts at a pad."""

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        starts = set(cp_context.cu_seqlens_padded[1:-1].tolist())
        joined = torch.tensor([b for b in cp_context.cu_seqlens.tolist() if b not in starts])
        wrong = dataclasses.replace(cp.build_context(joined, self.cp_group), relayout=cp_context.relayout)
        return super()._delta_rule(q, k, v, g, beta, cu_seqlens, wrong, carry, **gate)


def _build_plant(cls, config, placement, groups, dtype, device):
    return cls(config, cp_group=groups[1], cp_layout="zigzag", dtype=dtype, device=device)


@functools.lru_cache(maxsize=1)
def plant_reference():
    layer = build_layer(PLANT_CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(PLANT_CONFIG, 61))
    return layer


def report_of(spawn, cls):
    layer = dataclasses.replace(linattn_layer(PLANT_CONFIG), build=functools.partial(_build_plant, cls, PLANT_CONFIG))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, layer, plant_reference(), [Placement(cp=2, cp_layout="zigzag-padded")],
                              _cu(LENGTHS[2]), hidden_size=PLANT_CONFIG.hidden_size, seed=61, rtol=RTOL,
                              name="padded")
    return str(info.value)


def row(report, tensor):
    """The report table's line of `tensor` (its error and worst element), or ''."""
    found = re.search(rf"^\s+{re.escape(tensor)}\s.*$", report, re.M)
    return found.group(0) if found else ""


OUTPUT_LOCATED = r"seq [123] token \d+ \(global \d+\) on CP rank [01], feature \d+"


def test_unpadded_offsets_for_the_padded_chunks_are_caught(spawn):
    report = report_of(spawn, UnpaddedOffsets)
    # sequence 0 starts at 0 either way: the first wrong token is in a later sequence
    assert re.search(OUTPUT_LOCATED, row(report, "padded/cp2-zigzag-padded/seed61 output")), report


def test_a_pad_entering_the_recurrence_is_caught(spawn):
    report = report_of(spawn, PadsEnterTheRecurrence)
    assert re.search(OUTPUT_LOCATED, row(report, "padded/cp2-zigzag-padded/seed61 output")), report
