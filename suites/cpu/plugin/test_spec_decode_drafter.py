"""A drafter with its own recurrent state in the speculative-decoding check
(`SpecDecodePath.drafter`, `pytest_linattn.harness.spec_drafter`): a KDA draft layer beside a GDN
target, both linattn's, the drafter a draft context with a slot per sequence
(`clients.spec_drafter`): its propose advances the slot through the round's tokens and keeps a
checkpoint per position, its rollback restores the one at the accepted prefix. Float64.

The correct drafter passes at TP 2 and CP 2, and in vLLM's layout (a bonus token, rows of slots:
the drafter keeps one slot per sequence). A draft context that keeps no checkpoint (its removal
of the rejected positions fails, unchecked) leaves the target right and fails with the drafter's
state named: the round, the slot, the sequence, the token and the field.
"""

import dataclasses

import pytest
import torch

from bug_record import plants_serving as P
from cases.layer_parity import make_config, replicated_layer
from clients.spec_decode import linattn_row_spec_path, linattn_spec_path
from clients.spec_drafter import linattn_drafter, with_drafter
from pytest_linattn.harness import Placement, SpecDrafter, SpecPlan, assert_spec_decode_parity
from pytest_linattn.harness.spec_decode import spec_schedule
from pytest_linattn.harness.spec_drafter import drafter_calls
from pytest_linattn.parity import capture_records

CONFIG = make_config("qwen3_5", 1)
DRAFT_CONFIG = make_config("kda", 1)
K = 3
# round 1 accepts 2, 3 and 0 drafts; round 2 0, 1 and 3
PLANS = [SpecPlan((3,), (2, 0)), SpecPlan((1, 4), (3, 1)), SpecPlan((2,), (0, 3))]
RTOL = 1e-10


def check(spawn, path, placements=(Placement(tp=2),), plans=PLANS, num_draft=K):
    with capture_records():  # the plant's failing comparisons stay out of the session's parity records
        assert_spec_decode_parity(spawn, path, replicated_layer(CONFIG, 71), list(placements), plans,
                                  num_draft=num_draft, hidden_size=CONFIG.hidden_size, seed=72, rtol=RTOL,
                                  drafter_reference=replicated_layer(DRAFT_CONFIG, 73), name="drafter")


def test_drafter_client_and_plant(spawn):
    check(spawn, with_drafter(linattn_spec_path(CONFIG), DRAFT_CONFIG), [Placement(tp=2), Placement(cp=2)])
    with pytest.raises(AssertionError) as stale:
        check(spawn, with_drafter(linattn_spec_path(CONFIG), DRAFT_CONFIG,
                                  rollback=P.rollback_of_a_context_without_checkpoints))
    report = str(stale.value)
    # the target is right: the only report is the drafter's
    assert report.startswith("spec-decode parity failed for drafter/tp2/seed72, the drafter (its own state pool): ")
    assert "\n\n" not in report, report
    # round 1: sequence 0 accepted 2 of 3, its drafter slot still after all 3 (token 5 of a 3-token prompt)
    said = ("call 2 (verify round 1: 3 drafts each of sequences [0, 1, 2] in slots [3, 2, 1], accepted [2, 3, 0]): ")
    assert (f"{said}slot 3, sequence 0 (chunks 3, then verify rounds accepting [2, 0]), the drafter's state after "
            f"token 4, 2 of 3 drafts accepted: field conv error") in report, report
    assert "field recurrent error" in report, report
    # 3 of 3 accepted: nothing to remove, right
    assert f"{said}slot 2, sequence 1" not in report, report
    # the next round proposes from the stale state: its drafter outputs go wrong
    assert "call 3 (verify round 2: 3 drafts each of sequences [0, 1, 2] in slots [3, 2, 1], accepted [0, 1, 3]): " \
           "slot 1, sequence 2 (chunks 2, then verify rounds accepting [0, 3]), the drafter's token 2: output error" \
           in report, report


def test_drafter_in_rows_of_slots(spawn):
    # vLLM's layout for the target (a bonus token, rows of 1 + K slots); the drafter keeps one slot per
    # sequence (its row's first) and gets the bonus token in every round, 1 + j accepted
    plans = [SpecPlan((3,), (1, 2)), SpecPlan((1, 2), (2, 0))]
    check(spawn, with_drafter(linattn_row_spec_path(CONFIG, 2), DRAFT_CONFIG), plans=plans, num_draft=2)


def test_drafter_runs_the_target_s_calls_on_one_slot_per_sequence():
    plans = [SpecPlan((3,), (1,)), SpecPlan((2,), (2,))]
    bounds = torch.tensor([0, *(pl.length + 1 for pl in plans)]).cumsum(0).tolist()
    x = torch.randn(1, bounds[-1], 4, dtype=torch.float64)
    calls = spec_schedule(plans, bounds, x, 2, torch.Generator().manual_seed(0), bonus_token=True,
                          slots_per_sequence=3)
    drafted = drafter_calls(calls)
    assert calls[0].slots == ((2, 4, 6), (1, 3, 5)) and drafted[0].slots == (2, 1)
    assert drafted[1].accepted == calls[1].accepted == (2, 3) and drafted[1].x is calls[1].x


def test_bad_drafter_input_names_the_parameter_and_the_rule():
    base = dict(num_draft=K, hidden_size=CONFIG.hidden_size, seed=0, rtol=RTOL)
    target, drafted = linattn_spec_path(CONFIG), with_drafter(linattn_spec_path(CONFIG), DRAFT_CONFIG)
    ref = replicated_layer(CONFIG, 71)
    with pytest.raises(ValueError, match=r"drafter_reference .* is given with the path's drafter, and only then: "
                                         r"path.drafter is set, drafter_reference is None"):
        assert_spec_decode_parity(None, drafted, ref, [Placement(tp=2)], PLANS, **base)
    with pytest.raises(ValueError, match=r"path.drafter is None, drafter_reference is set"):
        assert_spec_decode_parity(None, target, ref, [Placement(tp=2)], PLANS, drafter_reference=ref, **base)
    with pytest.raises(ValueError, match=r"drafter_forward is for the path's drafter; the path has none"):
        assert_spec_decode_parity(None, target, ref, [Placement(tp=2)], PLANS, drafter_forward=print, **base)
    with pytest.raises(ValueError, match=r"drafter_reference must take the target's inputs \(\[1, T, hidden_size\] "
                                         r"with hidden_size 20\)"):
        wide = dataclasses.replace(DRAFT_CONFIG, hidden_size=24)
        assert_spec_decode_parity(None, drafted, ref, [Placement(tp=2)], PLANS, drafter_reference=replicated_layer(
            wide, 73), **base)
    with pytest.raises(ValueError, match=r"SpecDecodePath.drafter must be a SpecDrafter or None, got dict"):
        dataclasses.replace(target, drafter={})
    drafter = linattn_drafter(DRAFT_CONFIG)
    with pytest.raises(ValueError, match=r"SpecDrafter.rollback must be callable, got None"):
        dataclasses.replace(drafter, rollback=None)
    with pytest.raises(ValueError, match=r"SpecDrafter.shard_state and unshard_state are given together"):
        SpecDrafter(drafter.layer, drafter.prefill, drafter.propose, drafter.rollback, shard_state=drafter.shard_state)
