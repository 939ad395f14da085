"""Activation recompute under TP and CP (`recompute=` of the parity and training-step checks).

linattn's layers at TP 2 and CP 2, their forward under torch.utils.checkpoint (reentrant and
non-reentrant), must give gradients bitwise equal to the same run without recompute and within
rtol of the float64 reference, and the backward's replay must issue the forward's collectives.
Two planted layers, each a bug that recompute alone exposes:

- a warm-up collective issued on the first forward only and cached on the module: the replay's
  collectives differ from the forward's (the check names the collective and its call site);
- a router-style balancing bias updated in forward from the tokens it saw: the replay computes
  on the updated bias, so the gradients differ from the run without recompute and from the
  reference.
"""

import dataclasses
import re

import pytest
import torch

from bug_record.plants_layer import balance_bias_layer, warm_up_layer
from cases.layer_parity import FAMILIES, linattn_layer, make_case, make_config, random_state_dict
from linattn.layers import build_layer
from pytest_linattn.harness import Placement, TrainingStep, assert_parity_cases, assert_sharded_parity
from pytest_linattn.harness import assert_training_parity
from pytest_linattn.harness.recompute import recorded_forward
from pytest_linattn.parity import capture_records

CU = [0, 5, 6, 13, 16]  # 16 tokens: a one-token sequence, a sequence across the CP edge at 8
PLACEMENTS = (Placement(tp=2), Placement(cp=2))
MODES = ("reentrant", "non-reentrant")
RTOL = 1e-10


def recompute_cases(config, modes=MODES, layer=None, seed=11):
    cases = []
    for placement in PLACEMENTS:
        for mode in modes:
            case = make_case(config, CU, seed=seed, tp=placement.tp, cp=placement.cp, rtol=RTOL)
            cases.append(dataclasses.replace(case, name=f"{case.name}/recompute-{mode}", recompute=mode,
                                             layer=layer or case.layer))
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_under_recompute_matches_the_run_without_it(spawn, family):
    # TP 2 and CP 2, both modes: one spawn call, each case run with and without recompute
    with capture_records() as records:
        assert_parity_cases(spawn, recompute_cases(make_config(family, 2)), world_size=2)
    names = {r["group"] for r in records}
    assert all(any(f"recompute-{mode}" in n for n in names) for mode in MODES), sorted(names)


def replayed_collectives(mode):
    """On a rank: a CP-2 layer's checkpointed forward and backward; the collectives of each call."""
    from linattn.parallel import new_groups

    _, cp_group = new_groups(1, 2)
    config = make_config("qwen3_5", 1)
    layer = build_layer(config, cp_group=cp_group, dtype=torch.float64)
    x = torch.randn(1, 8, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3),
                    requires_grad=True)
    cu = torch.tensor(CU, dtype=torch.int32)
    y, calls = recorded_forward(lambda x_in: layer(x_in, cu), x, mode)
    y.sum().backward()
    return calls


@pytest.mark.parametrize("mode", MODES)
def test_replay_records_the_forwards_collectives(spawn, mode):
    for rank, calls in enumerate(spawn(replayed_collectives, 2, mode)):
        assert len(calls) == 2, f"rank {rank}: the forward and one replay, got {len(calls)} call(s)"
        forward, replay = calls
        assert forward and all(c["site"].startswith("linattn/") for c in forward), forward
        assert replay == forward


# ---- plants: the bug record's (suites/bug_record/plants_layer.py: VeOmni #1085, Automodel #3247) --


def failure_of(check):
    with capture_records(), pytest.raises(AssertionError) as info:
        check()
    return str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_warm_up_collective_outside_the_replay_is_caught(spawn, mode):
    config = make_config("qwen3_5", 2)
    layer = warm_up_layer(config)
    message = failure_of(lambda: assert_parity_cases(spawn, recompute_cases(config, (mode,), layer), world_size=2))
    # the first failing case (TP 2), on both ranks, naming the collective and its call site; values are right
    assert re.search(rf"^recompute check failed for case tp2/qwen3_5/float64/recompute-{mode}: 1 failing check\(s\)"
                     rf"\n\ntp2/qwen3_5/float64/recompute-{mode} recompute='{mode}': the replay issued other "
                     r"collectives than the checkpointed forward \(\d+ in the forward, \d+ in the replay\)", message)
    assert message.endswith("[on rank 0 (TP rank 0, CP rank 0), rank 1 (TP rank 1, CP rank 0)]"), message
    assert re.search(r"at collective 1 the forward issued c10d.allgather_ at suites/bug_record/plants_layer.py:\d+ "
                     r"\(forward_with_warm_up\), group of 2, the replay issued c10d\.\w+ at linattn/", message)
    assert "not bitwise equal" not in message and "parity failed" not in message, message


@pytest.mark.parametrize("mode", MODES)
def test_state_mutated_in_forward_is_caught(spawn, mode):
    config = make_config("qwen3_5", 2)
    layer = balance_bias_layer(config)
    message = failure_of(lambda: assert_parity_cases(spawn, recompute_cases(config, (mode,), layer), world_size=2))
    case = f"tp2/qwen3_5/float64/recompute-{mode}"
    # caught twice: against the run without recompute (bitwise) and against the reference
    assert re.search(rf"{case} recompute='{mode}': on rank 0 \(TP rank 0, CP rank 0\), \d+ of \d+ tensors are not "
                     r"bitwise equal to the same run without recompute", message), message
    assert re.search(r"\n  grad in_proj_qkv.weight: \d+ of \d+ elements differ, the worst at \(\d+, \d+\)", message)
    # its first line names the tensors: the input gradient and every parameter gradient differ, the output is equal
    grads = ", ".join(f"grad {n}" for n, _ in build_layer(config).named_parameters())
    assert (f"not bitwise equal to the same run without recompute: dx, {grads}; bitwise equal: output (the replay "
            "computed something else than the forward") in message, message
    assert re.search(rf"parity failed for case {case}: \d+ failing check\(s\)", message), message
    # the output comes from the first forward, which is right: what went wrong is the replay
    assert f"{case} output" not in message and "\n  output:" not in message, message
    # the same layer without recompute passes: the bug shows only under recompute
    plain = [dataclasses.replace(c, recompute=False) for c in recompute_cases(config, (mode,), layer)]
    with capture_records():
        assert_parity_cases(spawn, plain, world_size=2)


# ---- the training step -------------------------------------------------------------------------


def _reference(config, seed):
    reference = build_layer(config, dtype=torch.float64)
    reference.load_state_dict(random_state_dict(config, seed))
    return reference


@pytest.mark.parametrize("mode", MODES)
def test_training_steps_under_recompute_match(spawn, mode):
    config = make_config("qwen3_5", 2)
    with capture_records() as records:
        assert_training_parity(spawn, linattn_layer(config), _reference(config, 5), PLACEMENTS, [CU, [0, 9, 16]],
                               hidden_size=config.hidden_size, seed=5, rtol=RTOL, step=TrainingStep(steps=2),
                               recompute=mode)
    assert any(f"recompute-{mode} step 2/2" in r["group"] for r in records)


def test_training_step_catches_the_warm_up_collective(spawn):
    config = make_config("qwen3_5", 2)
    message = failure_of(lambda: assert_training_parity(
        spawn, warm_up_layer(config), _reference(config, 5), [Placement(cp=2)], [CU, [0, 9, 16]],
        hidden_size=config.hidden_size, seed=5, rtol=RTOL, step=TrainingStep(steps=1), recompute=True))
    # the first micro-batch's forward warms up; the second's forward and every replay do not
    assert re.search(r"recompute check failed for case cp2-contiguous/seed5/recompute-non-reentrant: 1 failing "
                     r"check\(s\)\n\ncp2-contiguous/seed5/recompute-non-reentrant step 1 micro-batch 1 "
                     r"recompute='non-reentrant': the replay issued other collectives", message), message
    assert "(forward_with_warm_up)" in message and "micro-batch 2" not in message, message


# ---- bad input ---------------------------------------------------------------------------------


def no_spawn(*args, **kwargs):
    raise AssertionError("bad input must fail before any rank runs")


@pytest.mark.parametrize("value", ["yes", "checkpoint", 1, None, "Reentrant"])
def test_bad_recompute_raises_value_error(value):
    config = make_config("qwen3_5", 1)
    rule = r"recompute must be one of False, 'reentrant', 'non-reentrant' \(True means 'non-reentrant'\).*got "
    case = make_case(config, CU, seed=1, tp=2, rtol=RTOL)
    with pytest.raises(ValueError, match="ParityCase." + rule):
        dataclasses.replace(case, recompute=value)
    with pytest.raises(ValueError, match=rule):
        assert_sharded_parity(no_spawn, case.layer, case.reference, [Placement(tp=2)], CU,
                              hidden_size=config.hidden_size, seed=1, rtol=RTOL, recompute=value)
    with pytest.raises(ValueError, match=rule):
        assert_training_parity(no_spawn, case.layer, case.reference, [Placement(tp=2)], [CU],
                               hidden_size=config.hidden_size, seed=1, rtol=RTOL, recompute=value)
    if value is not None:  # None: each case's own
        with pytest.raises(ValueError, match=rule):
            assert_parity_cases(no_spawn, [case], recompute=value)
