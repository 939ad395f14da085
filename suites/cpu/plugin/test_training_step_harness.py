"""The public training-step check (pytest_linattn.harness.training_step) on a toy client.

The toy: y = fc2(norm_weight * fc1(x)), fc1 column-parallel, fc2 row-parallel, its hidden
features in heads of HEAD_DIM; `norm_weight` [HEAD_DIM] is TP-replicated and shared by every
head (like a q_norm), so on a TP rank its gradient is a partial sum over that rank's heads.

The trainer reduces it over TP once per step (`finalize_grads`): right. Reduced after every
backward instead (`after_backward`, the pattern of transformers' replicated_with_grad_allreduce),
the accumulated gradient is summed again on every micro-batch: one backward cannot see that, and
the one-backward harness passes it; the training-step check with two micro-batches must fail,
naming the step, the micro-batch count and the parameter. Bad input is a ValueError before any
rank runs.
"""

import functools
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn import Placement, ShardedLayer, TrainingStep, assert_sharded_parity, assert_training_parity
from pytest_linattn.parity import capture_records

DIM, HEADS, HEAD_DIM = 6, 4, 3
RTOL = 1e-10
MICRO_BATCHES = [[0, 3, 10, 16], [0, 9, 16]]


class HeadNormMLP(nn.Module):
    """The toy layer; at tp=1, the replicated reference."""

    def __init__(self, tp=1, group=None, dtype=torch.float64, device="cpu"):
        super().__init__()
        self.group, heads = group, HEADS // tp
        self.fc1 = nn.Linear(DIM, heads * HEAD_DIM, bias=False, dtype=dtype, device=device)
        self.norm_weight = nn.Parameter(torch.empty(HEAD_DIM, dtype=dtype, device=device))
        self.fc2 = nn.Linear(heads * HEAD_DIM, DIM, bias=False, dtype=dtype, device=device)

    def forward(self, x, cu_seqlens=None):
        x = copy_to_tensor_parallel_region(x, self.group)  # the input gradient summed over TP
        h = self.fc1(x).unflatten(-1, (-1, HEAD_DIM)) * self.norm_weight
        return reduce_from_tensor_parallel_region(self.fc2(h.flatten(-2)), self.group)


def _build(placement, groups, dtype, device):
    return HeadNormMLP(placement.tp, groups[0], dtype, device)


def _shard(full, placement, tp_rank):
    def rows(t, dim=0):
        return t.chunk(placement.tp, dim)[tp_rank]

    return {"fc1.weight": rows(full["fc1.weight"]), "norm_weight": full["norm_weight"],
            "fc2.weight": rows(full["fc2.weight"], 1)}


def _unshard(tensors, placement):
    return {"fc1.weight": torch.cat([t["fc1.weight"] for t in tensors]), "norm_weight": tensors[0]["norm_weight"],
            "fc2.weight": torch.cat([t["fc2.weight"] for t in tensors], 1)}


def _reduce_norm_weight(module, placement):
    """The replicated weight's gradient all-reduced over TP: the whole accumulated one."""
    dist.all_reduce(module.norm_weight.grad, group=module.group)


def _finalize_once(module, placement, groups):
    """Once per step: the replicated weight's gradient all-reduced over TP (no CP here)."""
    _reduce_norm_weight(module, placement)


RIGHT = ShardedLayer(_build, _shard, _unshard, replicated={"norm_weight"})
PER_BACKWARD = ShardedLayer(_build, _shard, _unshard, replicated={"norm_weight"}, after_backward=_reduce_norm_weight)
ONCE_PER_STEP = TrainingStep(steps=2, max_norm=0.05, finalize_grads=_finalize_once)


def _reference(seed=3):
    torch.manual_seed(seed)
    reference = HeadNormMLP()
    nn.init.normal_(reference.norm_weight, 1.0, 0.2)
    nn.init.normal_(reference.fc1.weight, 0.0, 0.4)
    nn.init.normal_(reference.fc2.weight, 0.0, 0.4)
    return reference


def test_one_reduction_per_step_matches(spawn):
    steps = assert_training_parity(spawn, RIGHT, _reference(), [Placement(tp=2)], MICRO_BATCHES, hidden_size=DIM,
                                   seed=5, rtol=RTOL, step=ONCE_PER_STEP)
    assert all(s["clipped"] for s in steps), steps


def test_a_reduction_per_backward_passes_one_backward_but_not_accumulation(spawn):
    # one backward: the per-backward reduction is right, and the one-backward harness passes it
    assert_sharded_parity(spawn, PER_BACKWARD, _reference(), [Placement(tp=2)], MICRO_BATCHES[0], hidden_size=DIM,
                          seed=5, rtol=RTOL)
    assert_training_parity(spawn, PER_BACKWARD, _reference(), [Placement(tp=2)], MICRO_BATCHES[:1], hidden_size=DIM,
                           seed=5, rtol=RTOL, step=TrainingStep(steps=2, max_norm=0.05))
    # two micro-batches: the first one's gradient is summed over TP twice
    with capture_records(), pytest.raises(AssertionError) as info:  # meant to fail: kept out of the table
        assert_training_parity(spawn, PER_BACKWARD, _reference(), [Placement(tp=2)], MICRO_BATCHES, hidden_size=DIM,
                               seed=5, rtol=RTOL, step=TrainingStep(steps=2, max_norm=0.05))
    text = str(info.value)
    assert "training-step parity failed for case tp2/seed5" in text, text
    assert "step 1/2 (2 micro-batches) grad norm: the reference's is" in text, text
    # after step 1's reduction only the replicated weight's gradient is wrong
    assert re.search(r"step 1/2 \(2 micro-batches\) grad: 1 of 3 tensor\(s\) off.*\n.*\n\s+norm_weight ", text), text


def forward_off_after_the_first_call(module, x, cu_seqlens, placement):
    """The layer's forward, its output scaled once the module has run before (something kept from one
    micro-batch to the next): the step's first micro-batch is right, every later one wrong."""
    y = module(x, cu_seqlens)
    ran = module.__dict__.setdefault("calls", 0)
    module.calls = ran + 1
    return y * 1.5 if ran else y


def test_the_first_micro_batch_whose_loss_is_off_is_named(spawn):
    layer = ShardedLayer(_build, _shard, _unshard, replicated={"norm_weight"}, forward=forward_off_after_the_first_call)
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_training_parity(spawn, layer, _reference(), [Placement(tp=2)], MICRO_BATCHES, hidden_size=DIM,
                               seed=5, rtol=RTOL, step=ONCE_PER_STEP)
    text = str(info.value)
    assert re.search(r"tp2/seed5 step 1/2 \(2 micro-batches\) loss by micro-batch: micro-batch 2 of 2 is the first off "
                     r"\(cu_seqlens \[0, 9, 16\]\): \S+, the reference's \S+ \(relative error 5\.00e-01\); off: "
                     r"micro-batches \[2\]; right: \[1\]", text), text
    assert "step 2/2 (2 micro-batches) loss by micro-batch: micro-batch 1 of 2 is the first off" in text, text
    # a bug that leaves every micro-batch's loss right (a reduction per backward) gets no such line
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_training_parity(spawn, PER_BACKWARD, _reference(), [Placement(tp=2)], MICRO_BATCHES, hidden_size=DIM,
                               seed=5, rtol=RTOL, step=TrainingStep(steps=1, max_norm=0.05))
    assert "loss by micro-batch" not in str(info.value), str(info.value)


# Data-parallel replicas: the client's groups add a DP group (the ranks of the same TP and CP rank),
# and its reduction sums every gradient over it; DP rank d trains micro-batches d, d + 2, ...
def _groups_with_dp(placement):
    from linattn.parallel import new_groups

    tp, cp, world, rank = placement.tp, placement.cp, dist.get_world_size(), dist.get_rank()
    dp_group = None
    for first in range(tp * cp):
        group = dist.new_group(list(range(first, world, tp * cp)))
        if rank % (tp * cp) == first:
            dp_group = group
    return (*new_groups(tp, cp), dp_group)


def _finalize_with_dp(module, placement, groups):
    _reduce_norm_weight(module, placement)
    for q in module.parameters():
        dist.all_reduce(q.grad, group=groups[2])


def _finalize_averaging_dp(module, placement, groups):
    """Averages over DP, as DDP does, while the loss already divides by every micro-batch of the step."""
    _finalize_with_dp(module, placement, groups)
    for q in module.parameters():
        q.grad /= dist.get_world_size(groups[2])


WITH_DP = ShardedLayer(_build, _shard, _unshard, replicated={"norm_weight"}, process_groups=_groups_with_dp)
FOUR_MICRO_BATCHES = MICRO_BATCHES + [[0, 16], [0, 5, 6, 16]]


def test_data_parallel_replicas_with_a_sum_over_dp_match(spawn):
    steps = assert_training_parity(spawn, WITH_DP, _reference(), [Placement(tp=2)], FOUR_MICRO_BATCHES,
                                   hidden_size=DIM, seed=5, rtol=RTOL, data_parallel=2,
                                   step=TrainingStep(steps=2, max_norm=0.05, finalize_grads=_finalize_with_dp))
    assert all(s["clipped"] for s in steps), steps


@pytest.mark.parametrize("finalize", [_finalize_averaging_dp, _finalize_once], ids=["averaged-over-dp", "no-dp-reduction"])
def test_a_wrong_reduction_over_data_parallel_replicas_is_caught(spawn, finalize):
    with capture_records(), pytest.raises(AssertionError) as info:  # meant to fail: kept out of the table
        assert_training_parity(spawn, WITH_DP, _reference(), [Placement(tp=2)], FOUR_MICRO_BATCHES, hidden_size=DIM,
                               seed=5, rtol=RTOL, data_parallel=2,
                               step=TrainingStep(steps=2, max_norm=0.05, finalize_grads=finalize))
    text = str(info.value)
    assert "training-step parity failed for case tp2/dp2/seed5" in text, text
    assert "step 1/2 (4 micro-batches) grad norm: the reference's is" in text, text
    for d in (0, 1):  # every gradient off on both replicas, each named
        assert re.search(rf"step 1/2 \(4 micro-batches\) grad \(CP rank 0, DP rank {d}\): 3 of 3 tensor", text), text


# A client that brings its groups, its reduction and its norm: the harness makes no group of its own
# (torch's count of process groups on the rank, after the client's, is the same at the norm).
_GROUPS_AFTER_CLIENT = None


def _group_count():
    return len(dist.distributed_c10d._world.pg_map)


def _groups_counted(placement):
    global _GROUPS_AFTER_CLIENT
    groups = _groups_with_dp(placement)
    _GROUPS_AFTER_CLIENT = _group_count()
    return groups


def _grad_norm_of_own(module, placement, groups):
    if _group_count() != _GROUPS_AFTER_CLIENT:
        raise RuntimeError(f"{_group_count() - _GROUPS_AFTER_CLIENT} process group(s) made after the client's")
    sharded = module.fc1.weight.grad.square().sum() + module.fc2.weight.grad.square().sum()
    dist.all_reduce(sharded, group=groups[0])
    return (sharded + module.norm_weight.grad.square().sum()).sqrt()


def test_a_client_with_its_own_groups_reduction_and_norm_gets_no_harness_groups(spawn):
    layer = ShardedLayer(_build, _shard, _unshard, replicated={"norm_weight"}, process_groups=_groups_counted)
    step = TrainingStep(steps=2, max_norm=0.05, finalize_grads=_finalize_with_dp, grad_norm=_grad_norm_of_own)
    steps = assert_training_parity(spawn, layer, _reference(), [Placement(tp=2)], FOUR_MICRO_BATCHES,
                                   hidden_size=DIM, seed=5, rtol=RTOL, data_parallel=2, step=step)
    assert all(s["clipped"] for s in steps), steps


def _optimizer_lambda():
    return lambda params: torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("make, rule", [
    (lambda: TrainingStep(steps=0), r"TrainingStep.steps must be a positive int, got 0"),
    (lambda: TrainingStep(max_norm=-1.0), r"TrainingStep.max_norm must be None or a positive finite number"),
    (lambda: TrainingStep(max_norm=float("nan")), r"TrainingStep.max_norm must be None or a positive finite"),
    (lambda: TrainingStep(optimizer=_optimizer_lambda()), r"TrainingStep's callables must be module-level"),
    (lambda: TrainingStep(grad_norm="l2"), r"TrainingStep.grad_norm must be callable or None"),
    (lambda: TrainingStep(zero_grads=True), r"TrainingStep.zero_grads must be callable or None"),
    (lambda: assert_training_parity(None, RIGHT, _reference(), [Placement(tp=2)], [], hidden_size=DIM, seed=1,
                                    rtol=RTOL), r"micro_batches must be a non-empty list of cu_seqlens"),
    (lambda: assert_training_parity(None, RIGHT, _reference(), [Placement(cp=2, cp_layout="zigzag")],
                                    MICRO_BATCHES, hidden_size=DIM, seed=1, rtol=RTOL),
     r"micro_batches\[0\] at placement cp2-zigzag: cu_seqlens: zigzag CP needs every sequence length divisible"),
    (lambda: assert_training_parity(None, RIGHT, _reference(), [Placement(tp=2)], MICRO_BATCHES, hidden_size=DIM,
                                    seed=1, rtol=RTOL, output_size=0), r"output_size must be a positive int"),
    (lambda: assert_training_parity(None, RIGHT, _reference(), [Placement(tp=2)], MICRO_BATCHES, hidden_size=DIM,
                                    seed=1, rtol=RTOL, step=functools.partial(TrainingStep)),
     r"step must be a TrainingStep"),
    (lambda: assert_training_parity(None, RIGHT, _reference(), [Placement(tp=2)], MICRO_BATCHES, hidden_size=DIM,
                                    seed=1, rtol=RTOL, data_parallel=0), r"data_parallel must be a positive int"),
    (lambda: assert_training_parity(None, RIGHT, _reference(), [Placement(tp=2)], MICRO_BATCHES[:1] * 3,
                                    hidden_size=DIM, seed=1, rtol=RTOL, data_parallel=2),
     r"micro_batches: 3 micro-batches cannot be dealt evenly to data_parallel=2 ranks"),
])
def test_bad_input_is_a_value_error_before_any_rank_runs(make, rule):
    with pytest.raises(ValueError, match=rule):
        make()
