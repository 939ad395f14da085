"""The fla clients of five families (GatedDeltaProduct, GatedDeltaNet2, RWKV7Attention,
PrecondGatedDeltaNet, PrecondKDA: suites/cases/fla_families.py's CLIENTS) under fla_on_cpu, float64,
<= 1e-10 against the same client replicated, beyond their own files' TP 2 / CP 2 parity:

- CP 4 in both of fla's layouts (contiguous, fla's zigzag), one packing (CP4_CU) with a sequence
  across three ranks' pieces.
- The training-step check (`assert_training_parity`) at TP 2 and CP 2: two micro-batches a step,
  the replicated weights' TP reduction and the CP sum once per step (`clients.fla_layers.training_setup`),
  the harness's gradient norm, clipping that bites, AdamW, 2 steps; loss, norm, every gradient and
  weight after every step.
- The continuation check (`assert_continuation_parity`) at TP 2: the client carrying its state
  (conv caches, recurrent state; RWKV-7 its token-shift cache; the preconditioned layers their ATK
  state too) through prefill chunks and decode steps, its state sharded by head, against one full
  forward; outputs, final states and the gradients of the inputs and initial states.
- CP with a state in or out is refused by every client, naming fla's refusal: fla 0.6.0's conv and
  chunk ops take no state under CP, so a continued prefill cannot be split over CP ranks on fla.

Two plants, each caught with a located report: the clients' own replicated-gradient reduction
(`after_backward`, right for one backward) left in a training step of two micro-batches, where
it reduces the first one's part twice (the replicated weights' gradients, and only theirs, O(1)
off); GatedDeltaProduct's step-major k / v conv caches dealt to the TP ranks in head blocks (wrong
from the first token read from the initial state).
"""

import pytest
import torch

from cases.fla_families import FAMILIES
from cases.layer_parity import report_row
from pytest_linattn import (Placement, TrainingStep, assert_continuation_parity, assert_sharded_parity,
                            assert_training_parity)
from pytest_linattn.parity import capture_records

RTOL = 1e-10
MAX_NORM = 0.05  # under every step's gradient norm below: clipping bites


@pytest.mark.parametrize("family", FAMILIES)
def test_cp4_in_both_fla_layouts_matches_replicated(fla_on_cpu, spawn, family):
    from cases.fla_families import CP4_CU, cpu_family

    layer, client = cpu_family(family, seed=81)
    placements = [Placement(cp=4), Placement(cp=4, cp_layout="fla-zigzag")]
    assert_sharded_parity(spawn, client, layer, placements, CP4_CU, hidden_size=layer.hidden_size, seed=82,
                          rtol=RTOL, name=f"fla {family}")


@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_at_tp2_and_cp2_match_replicated(fla_on_cpu, spawn, family):
    from clients.fla_layers import training_setup
    from cases.fla_families import TRAINING_MICRO_BATCHES, cpu_family

    layer, client = cpu_family(family, seed=83)
    client, step = training_setup(client, steps=2, max_norm=MAX_NORM)
    steps = assert_training_parity(spawn, client, layer, [Placement(tp=2), Placement(cp=2)], TRAINING_MICRO_BATCHES,
                                   hidden_size=layer.hidden_size, seed=84, rtol=RTOL, step=step, name=f"fla {family}")
    assert all(s["clipped"] for s in steps), f"clipping must bite on every step: {steps}"


def test_replicated_gradients_reduced_after_every_micro_batch_are_caught(fla_on_cpu, spawn):
    # the clients as the parity check runs them: after_backward all-reduces o_norm's accumulated
    # gradient after each of the two micro-batches, so the first one's part is summed twice
    from cases.fla_families import TRAINING_MICRO_BATCHES, cpu_family

    layer, client = cpu_family("gdn2", seed=83)
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_training_parity(spawn, client, layer, [Placement(tp=2)], TRAINING_MICRO_BATCHES,
                               hidden_size=layer.hidden_size, seed=84, rtol=RTOL,
                               step=TrainingStep(steps=1, max_norm=MAX_NORM), name="fla gdn2")
    report = str(info.value)
    assert report.startswith("training-step parity failed for case fla gdn2/tp2/seed84:")
    grads = report.split("fla gdn2/tp2/seed84 step 1/1 (2 micro-batches) grad: ")[1].split("\n\n")[0]
    assert grads.startswith("3 of 17 tensor(s) off")  # the replicated ones only, each O(1) off
    for name in ("f_proj.0.weight", "g_proj.0.weight", "o_norm.weight"):
        assert float(report_row(grads, name).split()[1]) > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_state_carried_across_calls_at_tp2_matches_one_forward(fla_on_cpu, spawn, family):
    from cases.fla_families import STATE_CU, cpu_family, cpu_state_path

    layer, _ = cpu_family(family, seed=85)
    path, reference_forward = cpu_state_path(family)
    assert_continuation_parity(spawn, path, layer, [Placement(tp=2)], STATE_CU, hidden_size=layer.hidden_size,
                               seed=86, rtol=RTOL, conv_width=4, reference_forward=reference_forward,
                               name=f"fla {family}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_state_under_cp_is_refused_naming_fla_s_refusal(fla_on_cpu, family):
    # the refusal comes before any collective: a stand-in CP group is enough
    from cases.fla_families import cpu_family

    layer, client = cpu_family(family, seed=87)
    module = client.build(Placement(cp=2), (None, object()), torch.float64, "cpu")
    x = torch.zeros(1, 8, layer.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"state / output_final_state at CP 2 refused: fla 0\.6\.0 takes no state "
                                         r"in or out under CP \(its causal_conv1d asserts 'Initial state is not "
                                         r"supported for CP'"):
        module(x, torch.tensor([0, 8]), None, output_final_state=True)


def test_delta_product_caches_sharded_in_head_blocks_are_caught(fla_on_cpu, spawn):
    # the plant: the k / v conv caches dealt to the TP ranks in head blocks, while their channels
    # are step-major like the k / v conv weights: each rank starts from other heads' cache columns
    from clients.delta_product import fla_delta_product_client
    from clients.fla_layers import client_state_path
    from cases.fla_families import STATE_CU, cpu_family

    layer, _ = cpu_family("delta_product", seed=85)
    path = client_state_path(fla_delta_product_client(), {"conv_q": 1, "conv_k": 1, "conv_v": 1, "recurrent": 1})
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_continuation_parity(spawn, path, layer, [Placement(tp=2)], STATE_CU, hidden_size=layer.hidden_size,
                                   seed=86, rtol=RTOL, conv_width=4, name="fla delta_product")
    report = str(info.value)
    assert report.startswith("continuation parity failed at 1 of 1 placement(s): tp2")
    # wrong from the first token read from the initial state; the step-major caches O(1) off at the end
    assert ("first wrong token: sequence 0 (chunks 1+3+14, then 2 decode steps), chunk 1 of 3 (tokens 0..0, a "
            "1-token chunk from the initial state), token 0") in report
    finals = report.split("fla delta_product/tp2/seed86 final state: ")[1].split("\n\n")[0]
    assert finals.startswith("3 of 4 tensor(s) off")
    for field in ("conv_k", "conv_v"):
        assert float(report_row(finals, field).split()[1]) > 0.5
