"""The project's layers inside a trainer's steps (the public harness's assert_training_parity).

Every family (GDN in the qwen3_next and qwen3_5 layouts, KDA) at TP 2/4 (SP off and on), CP 2/4
in both layouts, TP x CP = 2 x 2 (SP, both layouts), and 2 data-parallel replicas of TP 2 and of
CP 2: micro-batches of different packings accumulating (2 a step; with DP 4, 2 on each replica),
the harness's own reduction (gradients summed over CP and DP) and gradient norm (each
parameter counted once), clipping that bites (max_norm under every step's norm), AdamW, 2 steps.
After every step the loss, every rank's gradient norm, every gradient and every parameter match
the replicated layer trained alike (float64, <= 1e-10).

The trainer bugs it must catch (planted below, each must fail with a report naming it):
a replicated weight's gradient reduced twice, a gradient norm that counts replicated parameters
tp times, a loss averaged per CP rank instead of over the whole batch.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from cases.layer_parity import FAMILIES, linattn_layer, make_config, random_state_dict
from linattn.layers import build_layer
from pytest_linattn import Placement, TrainingStep, assert_training_parity
from pytest_linattn.parity import capture_records

RTOL = 1e-10
MAX_NORM = 0.05  # under the gradient norm of every step below, so clipping always bites
# two micro-batches of 32 tokens with different packings; sequences cross every shard edge
CONTIGUOUS = [[0, 1, 14, 24, 32], [0, 5, 24, 32]]  # a 1-token sequence; 5..24 spans ranks at cp 4
ZIGZAG = [[0, 8, 24, 32], [0, 24, 32]]  # every length divisible by 2 * cp for cp 2 and 4
CLIPPED = TrainingStep(steps=2, max_norm=MAX_NORM)


def _reference(config, seed):
    reference = build_layer(config, dtype=torch.float64)
    reference.load_state_dict(random_state_dict(config, seed))
    return reference


def _check(spawn, family, placements, packings, seed, step=CLIPPED, layer=None, ratio=2, data_parallel=1):
    config = make_config(family, ratio)
    steps = assert_training_parity(spawn, layer or linattn_layer(config), _reference(config, seed), placements,
                                   packings, hidden_size=config.hidden_size, seed=seed, rtol=RTOL, step=step,
                                   name=family, data_parallel=data_parallel)
    assert all(s["clipped"] for s in steps), f"clipping must bite on every step: {steps}"


@pytest.mark.tp_sizes(2, 4)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_training_steps_match_replicated(spawn, tp_size, family):
    _check(spawn, family, [Placement(tp=tp_size), Placement(tp=tp_size, sequence_parallel=True)], CONTIGUOUS, seed=11)


@pytest.mark.cp_sizes(2, 4)
@pytest.mark.parametrize("family", FAMILIES)
def test_cp_training_steps_match_replicated(spawn, cp_size, family):
    _check(spawn, family, [Placement(cp=cp_size)], CONTIGUOUS, seed=12)
    _check(spawn, family, [Placement(cp=cp_size, cp_layout="zigzag")], ZIGZAG, seed=13, ratio=3)


@pytest.mark.tp_sizes(2)
@pytest.mark.cp_sizes(2)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_cp_training_steps_match_replicated(spawn, tp_size, cp_size, family):
    _check(spawn, family, [Placement(tp_size, cp_size, "contiguous", True)], CONTIGUOUS, seed=14, ratio=1)
    _check(spawn, family, [Placement(tp_size, cp_size, "zigzag", True), Placement(tp_size, cp_size, "zigzag")],
           ZIGZAG, seed=15)


@pytest.mark.parametrize("family", FAMILIES)
def test_data_parallel_replicas_training_steps_match_replicated(spawn, family):
    # 2 replicas of TP 2 + SP, then of CP 2: 4 micro-batches a step, 2 on each DP rank, the
    # default reduction summing over CP and DP
    _check(spawn, family, [Placement(tp=2, sequence_parallel=True)], CONTIGUOUS + CONTIGUOUS[::-1], seed=16,
           data_parallel=2)
    _check(spawn, family, [Placement(cp=2, cp_layout="zigzag")], ZIGZAG + ZIGZAG[::-1], seed=17, data_parallel=2)


# ---- planted trainer bugs ------------------------------------------------------------------------


def _failure(spawn, *args, **kwargs) -> str:
    """The report of a `_check` that must fail (its checks kept out of the run's parity table)."""
    with capture_records(), pytest.raises(AssertionError) as info:
        _check(spawn, *args, **kwargs)
    return str(info.value)


def _reduce_replicated_twice(replicated, module, placement, groups):
    """A finalize that sums over CP, then all-reduces the replicated gradients over TP although
    the layer already did (the class of transformers' replicated_with_grad_allreduce bug)."""
    tp_group, cp_group = groups
    for name, q in module.named_parameters():
        if cp_group is not None:
            dist.all_reduce(q.grad, group=cp_group)
        if name in replicated:
            dist.all_reduce(q.grad, group=tp_group)


def _norm_counting_replicated_tp_times(module, placement, groups):
    """Every parameter's squares summed over TP, the replicated ones too (NeMo-RL #3788's class)."""
    squares = sum(q.grad.double().pow(2).sum() for q in module.parameters())
    dist.all_reduce(squares, group=groups[0])
    return squares.sqrt()


def _loss_averaged_per_rank(y, dy, tokens, micro_batches):
    """The mean over this rank's tokens instead of the whole micro-batch's."""
    return (y * dy).sum() / (y.shape[1] * micro_batches)


@pytest.mark.tp_sizes(2)
def test_catches_a_replicated_gradient_reduced_twice(spawn, tp_size):
    config = make_config("qwen3_5", 2)
    layer = linattn_layer(config)
    step = TrainingStep(steps=2, max_norm=MAX_NORM,
                        finalize_grads=functools.partial(_reduce_replicated_twice, layer.replicated))
    text = _failure(spawn, "qwen3_5", [Placement(tp=tp_size)], CONTIGUOUS, seed=21, step=step)
    assert "step 1/2 (2 micro-batches) grad" in text and "norm.weight" in text, text
    assert "grad norm: the reference's is" in text, text


@pytest.mark.tp_sizes(2)
def test_catches_a_grad_norm_counting_replicated_parameters_tp_times(spawn, tp_size):
    step = TrainingStep(steps=2, max_norm=MAX_NORM, grad_norm=_norm_counting_replicated_tp_times)
    text = _failure(spawn, "kda", [Placement(tp=tp_size)], CONTIGUOUS, seed=22, step=step)
    assert "step 1/2 (2 micro-batches) grad norm: the reference's is" in text, text
    assert "TP rank 0, CP rank 0" in text and "TP rank 1, CP rank 0" in text, text


@pytest.mark.cp_sizes(2)
def test_catches_a_loss_averaged_per_cp_rank(spawn, cp_size):
    step = TrainingStep(steps=2, max_norm=MAX_NORM, loss=_loss_averaged_per_rank)
    text = _failure(spawn, "qwen3_next", [Placement(cp=cp_size)], CONTIGUOUS, seed=23, step=step)
    assert "step 1/2 (2 micro-batches) loss" in text and "grad norm" in text, text
