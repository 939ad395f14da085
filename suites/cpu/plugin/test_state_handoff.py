"""The state handoff check (`pytest_linattn.harness.assert_state_handoff_parity`) on linattn's
layer, float64: every prompt prefilled whole at one TP size, each sequence's conv and recurrent
state handed to the ranks of another TP size (suites/clients/state_handoff.py: unshard the source
ranks' states, shard them for the target rank), then decoded there, against the replicated layer.

The layer has the record's 2 key heads (8 value heads), so TP 4 is beyond the key heads (each
key head replicated over 2 ranks). The correct client passes from TP 2 to TP 1, 2 and 4, and
into TP 2 from TP 1 and TP 4. Three plants of public transfer bugs (suites/bug_record/
plants_handoff.py) each fail with the handed-off state located: the target placement, the
target TP rank, the sequence, the field and the conv section and head (or the recurrent value
head). The expected place is derived here from the config and the plant, by handing off states
whose every conv channel (recurrent value head) holds its own global index.
"""

import dataclasses
import re

import pytest
import torch

from bug_record.plants_handoff import (handoff_merging_conv_in_one_shot, handoff_splitting_conv_flat,
                                       handoff_with_heads_per_rank_floored, wrong_region)
from cases.layer_parity import linattn_layer, make_config, replicated_layer
from clients.state_handoff import handoff_by_section, linattn_handoff_path
from linattn.layers import LayerState, shard_layer_state
from pytest_linattn.harness import Placement, StateHandoffPath, assert_state_handoff_parity
from pytest_linattn.parity import capture_records

CONFIG = dataclasses.replace(make_config("qwen3_5", 2), num_k_heads=2)  # TP 4: 2 replicas per key head
CU = [0, 9, 15, 22]
PROMPTS = (9, 6, 7)
STEPS = 3
TP1, TP2, TP4 = Placement(), Placement(tp=2), Placement(tp=4)


def check(spawn, source, targets, handoff=handoff_by_section, **arguments):
    with capture_records():
        assert_state_handoff_parity(spawn, linattn_handoff_path(CONFIG, handoff), replicated_layer(CONFIG, 50), source,
                                    targets, CU, decode_steps=STEPS, hidden_size=CONFIG.hidden_size, seed=51,
                                    rtol=1e-10, name="qwen3_5", **dict(arguments))


def failure(spawn, source, targets, handoff) -> str:
    with pytest.raises(AssertionError) as info:
        check(spawn, source, targets, handoff)
    return str(info.value)


# ---- where a plant must be located, from the config and the plant -------------------------------


def first_wrong(handoff, source, target, tp_rank, field) -> str | None:
    return wrong_region(CONFIG, handoff, source, target, tp_rank, field)


def located(target, tp_rank, field, region) -> str:
    """The handed-off state's line: target placement, rank, the first (wrong) sequence, field, region."""
    return (rf"handed-off state at tp{target.tp}, tp_rank {tp_rank}, sequence 0 \(a {PROMPTS[0]}-token prompt\), "
            rf"field {field}: error \S+; wrong in {re.escape(region)}(?=[ ,;])")


# ---- the correct client ----------------------------------------------------------------------------


def test_handoff_from_tp2_to_fewer_the_same_and_more_ranks_than_key_heads(spawn):
    check(spawn, TP2, [TP1, TP2, TP4])


def test_handoff_into_tp2_from_tp1_and_from_beyond_the_key_heads(spawn):
    check(spawn, TP1, [TP2])
    check(spawn, TP4, [TP2])


# ---- the plants: each located on the handed-off state, before any decode step -------------------


def test_flat_conv_split_is_located_by_section_and_head(spawn):
    """vLLM #55208 / #37638 (and sglang #23746 part b): TP 1 -> TP 2 crosses the sections on both
    ranks; at TP 4 the even slice is not the rank's conv size at all."""
    report = failure(spawn, TP1, [TP2, TP4], handoff_splitting_conv_flat)
    assert "2 of 2 target(s) fail: tp2, tp4" in report
    for r in range(2):
        region = first_wrong(handoff_splitting_conv_flat, TP1, TP2, r, "conv")
        assert re.search(located(TP2, r, "conv", region), report), (region, report)
    assert "field recurrent" not in report.split("decoded outputs")[0]  # the recurrent state moved right
    flat, local = CONFIG.conv_dim // 4, CONFIG.local(4).conv_dim
    assert re.search(rf"handed-off state at tp4, tp_rank 0: handoff returned field conv of shape \(3, {flat}, 3\); "
                     rf"the target rank's layout \(shard_state of the reference's state\) has \(3, {local}, 3\)",
                     report)
    assert "no decode step ran at tp4" in report


def test_one_shot_merge_of_conv_shards_is_located_by_section_and_head(spawn):
    """sglang #22060: TP 2 -> TP 1, the second rank's q channels where the first rank's k belong."""
    report = failure(spawn, TP2, [TP1], handoff_merging_conv_in_one_shot)
    region = first_wrong(handoff_merging_conv_in_one_shot, TP2, TP1, 0, "conv")
    assert region == "section q key head 1"  # what the mechanism predicts: [q0 | k0 | ...] read as [q0 | q1 | ...]
    assert re.search(located(TP1, 0, "conv", region), report), report
    assert "the prefill at tp2 itself is wrong" not in report


def test_heads_per_rank_floored_beyond_the_key_heads_is_located_on_the_replica_ranks(spawn):
    """sglang #23746 part (a): TP 1 -> TP 4 with 2 key heads; TP 2 (not beyond them) passes, and at
    TP 4 only the ranks of key head 1 are handed the wrong state."""
    report = failure(spawn, TP1, [TP2, TP4], handoff_with_heads_per_rank_floored)
    assert "1 of 2 target(s) fail: tp4 (passed: tp2)" in report
    replicas = CONFIG.key_head_replicas(4)
    for r in range(4):
        conv = first_wrong(handoff_with_heads_per_rank_floored, TP1, TP4, r, "conv")
        recurrent = first_wrong(handoff_with_heads_per_rank_floored, TP1, TP4, r, "recurrent")
        assert (conv is None) == (recurrent is None) == (r < replicas)  # key head 0's ranks are right
        if conv is None:
            assert f"handed-off state at tp4, tp_rank {r}," not in report
        else:
            assert re.search(located(TP4, r, "conv", conv), report), (conv, report)
            assert re.search(located(TP4, r, "recurrent", recurrent), report), (recurrent, report)


# ---- NaN and bad input ------------------------------------------------------------------------------


def handoff_with_a_nan(config, states, source, target, target_tp_rank):
    """The right state, but value head 1 of sequence 0 holds one NaN."""
    state = handoff_by_section(config, states, source, target, target_tp_rank)
    recurrent = state.recurrent.clone()
    recurrent[0, 1, 0, 0] = float("nan")
    return LayerState(state.conv, recurrent)


def test_a_nan_never_passes(spawn):
    report = failure(spawn, TP1, [TP1], handoff_with_a_nan)
    assert re.search(located(TP1, 0, "recurrent", "value head 1 (key head 0)").replace(r"error \S+", "error nan"),
                     report), report


def test_bad_input_names_the_parameter():
    path = linattn_handoff_path(CONFIG)
    run = dict(decode_steps=2, hidden_size=CONFIG.hidden_size, seed=0, rtol=1e-10)
    reference = replicated_layer(CONFIG, 50)
    with pytest.raises(ValueError, match="targets must be a non-empty sequence of Placement"):
        assert_state_handoff_parity(None, path, reference, TP2, [], CU, **run)
    with pytest.raises(ValueError, match="decode_steps must be a positive int, got 0"):
        assert_state_handoff_parity(None, path, reference, TP2, [TP1], CU, **{**run, "decode_steps": 0})
    with pytest.raises(NotImplementedError, match=r"^source: not implemented: TP only .* got tp2/cp2-contiguous"):
        assert_state_handoff_parity(None, path, reference, Placement(tp=2, cp=2), [TP1], CU, **run)
    with pytest.raises(NotImplementedError, match=r"^targets\[1\]: not implemented: TP only .* got cp2-contiguous"):
        assert_state_handoff_parity(None, path, reference, TP2, [TP1, Placement(cp=2)], CU, **run)
    with pytest.raises(ValueError, match="StateHandoffPath.handoff must be callable"):
        StateHandoffPath(linattn_layer(CONFIG), None)
    with pytest.raises(ValueError, match="StateHandoffPath's callables must be module-level"):
        StateHandoffPath(linattn_layer(CONFIG), lambda states, source, target, rank: states[0])
    with pytest.raises(ValueError, match="StateHandoffPath.config must be a linattn.layers.LinearAttentionConfig"):
        StateHandoffPath(linattn_layer(CONFIG), handoff_with_a_nan, config={"num_k_heads": 2})
    with pytest.raises(ValueError, match="targets\\[0\\] tp4: tp > 1 needs StateHandoffPath.shard_state"):
        assert_state_handoff_parity(None, dataclasses.replace(path, shard_state=None, unshard_state=None), reference,
                                    TP1, [TP4], CU, **run)
