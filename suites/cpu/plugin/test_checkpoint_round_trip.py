"""The checkpoint round trip (`pytest_linattn.harness.assert_checkpoint_round_trip`) on linattn's
layer: saved at one TP size, merged, checked per section against the replicated layer, loaded at
another TP size and run forward and backward there.

The full-precision client (suites/clients/checkpoint.py: shards merged with `unshard_state_dict`,
loaded with `shard_state_dict`) passes at TP 2 -> 1, 1 -> 2, 2 -> 4 and 4 -> 2 in float64 at 1e-10,
for Qwen3.5's and Qwen3-Next's layouts (2 value heads per key head; TP 4 is the key heads). The
FP8-style client (suites/clients/quantized_checkpoint.py: per-section scales of the fused
weights, block scales per head) passes at its bound, `QUANTIZED_RTOL`. Two plants of public
reports (suites/bug_record/plants_checkpoint.py) each fail with the place located: the loaded
shard's sections after the first (a loader filling one scale slot of several), and the merged
checkpoint's SSM parameters holding TP rank 0's rows only (an exporter mapping them as
replicated). The expected lines are derived there from the config and the plant.
"""

import re

import pytest
import torch

from bug_record.plants_checkpoint import (all_lines, exported_as_replicated_lines, fill_first_scale_slot_only,
                                          merge_mapping_ssm_parameters_as_replicated, unfilled_scale_lines)
from cases.layer_parity import linattn_layer, make_config, replicated_layer
from clients.checkpoint import linattn_checkpoint_io, load_by_section, merge_by_section
from clients.quantized_checkpoint import QUANTIZED_RTOL, quantized_checkpoint_io
from pytest_linattn.harness import CheckpointIO, ShardedLayer, assert_checkpoint_round_trip
from pytest_linattn.harness.checkpoint_report import row_table
from pytest_linattn.parity import capture_records

QWEN3_5, QWEN3_NEXT = make_config("qwen3_5", 2), make_config("qwen3_next", 2)
CU = [0, 5, 12]


def check(spawn, config, io, *, rtol=1e-10, **arguments):
    assert_checkpoint_round_trip(spawn, linattn_layer(config), replicated_layer(config, 60), CU, io=io,
                                 hidden_size=config.hidden_size, seed=61, rtol=rtol, name=config.family,
                                 **arguments)


def failure(spawn, config, io, **arguments) -> str:
    with capture_records(), pytest.raises(AssertionError) as info:  # meant to fail: out of the run's summary
        check(spawn, config, io, **arguments)
    return str(info.value)


# ---- the correct clients -------------------------------------------------------------------------


@pytest.mark.parametrize("config", [QWEN3_5, QWEN3_NEXT], ids=lambda c: c.family)
def test_checkpoint_saved_and_loaded_at_other_tp_sizes(spawn, config):
    check(spawn, config, linattn_checkpoint_io(config))


def test_fp8_checkpoint_round_trips_at_its_bound(spawn):
    check(spawn, QWEN3_NEXT, quantized_checkpoint_io(QWEN3_NEXT), weight_rtol=QUANTIZED_RTOL, sizes=((2, 1), (1, 4)))


def test_fp8_error_is_what_the_bound_says(spawn):
    """The bound is the fake quantization's error, not slack: a tenth of it fails, on every pair."""
    report = failure(spawn, QWEN3_5, quantized_checkpoint_io(QWEN3_5), weight_rtol=QUANTIZED_RTOL / 10, sizes=((2, 1),))
    assert "1 of 1 size pair(s) fail: tp2->tp1" in report
    assert re.search(r"(?m)^merged checkpoint \(saved at tp2\): in_proj_qkv\.weight section q: error 2\.\de-02", report)


# ---- the plants: each located ----------------------------------------------------------------------


@pytest.mark.parametrize("config", [QWEN3_5, QWEN3_NEXT], ids=lambda c: c.family)
def test_loader_filling_the_first_scale_slot_only_is_located(spawn, config):
    """vLLM #38517: every section after the first of a fused weight dequantized with an unfilled
    slot: k and v of in_proj_qkv (Qwen3.5); k, v and z of in_proj_qkvz and a of in_proj_ba
    (Qwen3-Next); at every TP size, on every rank, the merged checkpoint right."""
    report = failure(spawn, config, quantized_checkpoint_io(config, fill_slots=fill_first_scale_slot_only),
                     weight_rtol=QUANTIZED_RTOL, sizes=((2, 1), (1, 2)))
    assert "2 of 2 size pair(s) fail: tp2->tp1, tp1->tp2" in report
    assert "merged checkpoint" not in report
    for tp, tp_rank in ((1, 0), (2, 0), (2, 1)):
        for line in unfilled_scale_lines(config, tp, tp_rank):
            assert re.search(line, report), f"{line}\n\n{report}"
    assert re.search(all_lines(unfilled_scale_lines(config, 1, 0)), report)  # the registry's form
    assert not re.search(r"section [qb]:", report)
    assert "parity failed for case" in report  # and the layer computes garbage at the loading size


def test_export_mapping_ssm_parameters_as_replicated_is_located(spawn):
    """Model-Optimizer #931: saved at TP 2, A_log, dt_bias and the conv weight hold TP rank 0's rows
    only; the loader then refuses the checkpoint. Saved at TP 1 it is right."""
    io = linattn_checkpoint_io(QWEN3_5, merge=merge_mapping_ssm_parameters_as_replicated)
    report = failure(spawn, QWEN3_5, io, sizes=((2, 1), (1, 2)))
    assert "1 of 2 size pair(s) fail: tp2->tp1 (passed: tp1->tp2)" in report
    lines = exported_as_replicated_lines(QWEN3_5, 2)
    assert len(lines) == 3
    for line in lines:
        assert re.search(line, report), f"{line}\n\n{report}"
    assert re.search(all_lines(lines), report)  # the registry's form
    assert "norm.weight" not in report
    conv = (QWEN3_5.conv_dim, 1, QWEN3_5.conv_size)
    assert re.search(re.escape(f"load at tp1, tp_rank 0 raised ValueError: conv1d.weight must have shape {conv}, got "
                               f"({QWEN3_5.conv_dim // 2}, 1, {QWEN3_5.conv_size})"), report)
    assert "no forward ran at tp1" in report


def test_sections_and_heads_follow_the_layouts():
    """The report's row table: Qwen3-Next's in_proj_qkvz grouped per key head, [q | k | v | z]."""
    rows = row_table(QWEN3_NEXT, "in_proj_qkvz.weight", (2 * 32 + 2 * 48, 20))
    group = 2 * 8 + 2 * 2 * 6
    assert rows.section[:group] == ("q",) * 8 + ("k",) * 8 + ("v",) * 12 + ("z",) * 12
    assert rows.head[group + 16] == 2 and rows.kind[group + 16] == "value"  # key head 1's first value head
    assert row_table(QWEN3_5, "out_proj.weight", (20, 48)).axis == "cols"


# ---- bad input ---------------------------------------------------------------------------------------


def _not_a_dict(module, placement, tp_rank):
    return [p.detach() for p in module.parameters()]


def test_bad_input_raises_naming_the_field(spawn):
    with pytest.raises(ValueError, match=r"CheckpointIO\.merge must be callable"):
        CheckpointIO(save=_not_a_dict, merge=None, load=load_by_section)
    with pytest.raises(ValueError, match=r"module-level"):
        CheckpointIO(save=lambda m, p, r: {}, merge=merge_by_section, load=load_by_section)
    with pytest.raises(ValueError, match=r"CheckpointIO\.config must be a linattn"):
        CheckpointIO(save=_not_a_dict, merge=merge_by_section, load=load_by_section, config="qwen3_5")
    io = linattn_checkpoint_io(QWEN3_5)
    with pytest.raises(ValueError, match=r"sizes\[1\] must be a pair of positive ints"):
        check(spawn, QWEN3_5, io, sizes=((2, 1), (0, 2)))
    with pytest.raises(ValueError, match=r"io must be a CheckpointIO"):
        check(spawn, QWEN3_5, {"save": None})
    with pytest.raises(ValueError, match=r"ShardedLayer\.shard is required by the checkpoint round trip"):
        assert_checkpoint_round_trip(spawn, ShardedLayer(linattn_layer(QWEN3_5).build, None), torch.nn.Linear(2, 2),
                                     CU, io=io, hidden_size=20, seed=1, rtol=1e-10)
    with pytest.raises(ValueError, match=r"CheckpointIO\.save must return a dict"):
        check(spawn, QWEN3_5, CheckpointIO(save=_not_a_dict, merge=merge_by_section, load=load_by_section),
              sizes=((1, 1),))
