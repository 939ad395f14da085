"""The tensor-parallel MLP trained beside the replicated one: the public harness's training-step
check (docs/harness.md), two micro-batches of different packings, two AdamW steps, clipping that
bites; after every step the loss, the gradient norm, every gradient and every weight must match."""

import torch

from pytest_linattn import Placement, ShardedLayer, TrainingStep, assert_training_parity
from tp_mlp import MLP, TensorParallelMLP

DIM, HIDDEN = 16, 64


def build(placement, groups, dtype, device):
    tp_group, _ = groups  # the default process_groups: linattn.parallel.new_groups(tp, cp)
    return TensorParallelMLP(DIM, HIDDEN, placement.tp, tp_group).to(device, dtype)


def shard(full, placement, tp_rank):
    def rows(t, dim=0):
        return t.chunk(placement.tp, dim)[tp_rank]

    return {"fc1.weight": rows(full["fc1.weight"]), "fc1.bias": rows(full["fc1.bias"]),
            "fc2.weight": rows(full["fc2.weight"], 1), "bias": full["fc2.bias"]}


def unshard(tensors, placement):  # gradients, and weights after a step: one layout
    def cat(name, dim=0):
        return torch.cat([t[name] for t in tensors], dim)

    return {"fc1.weight": cat("fc1.weight"), "fc1.bias": cat("fc1.bias"),
            "fc2.weight": cat("fc2.weight", 1), "fc2.bias": tensors[0]["bias"]}


def forward(module, x, cu_seqlens, placement):
    return module(x)  # an MLP ignores the packing


MLP_TP = ShardedLayer(build, shard, unshard, replicated={"bias"}, forward=forward)


def test_tp_mlp_trains_like_the_replicated_one(spawn, tp_size):
    torch.manual_seed(0)
    steps = assert_training_parity(
        spawn, MLP_TP, MLP(DIM, HIDDEN).double(), [Placement(tp=tp_size)],
        micro_batches=[[0, 5, 6, 16], [0, 11, 16]],  # two micro-batches, different packings
        hidden_size=DIM, seed=1, rtol=1e-10, step=TrainingStep(steps=2, max_norm=0.05),
        reference_forward=lambda m, x, cu: m(x))
    assert all(s["clipped"] for s in steps), steps  # the norm was over max_norm on every step


def test_tp_mlp_with_data_parallel_replicas(spawn, tp_size):
    # 2 replicas of the TP layer (a world of 2 * tp ranks), each training 2 of the step's 4
    # micro-batches; the default reduction sums their gradients (over the CP and DP ranks)
    torch.manual_seed(0)
    assert_training_parity(
        spawn, MLP_TP, MLP(DIM, HIDDEN).double(), [Placement(tp=tp_size)],
        micro_batches=[[0, 5, 6, 16], [0, 11, 16], [0, 16], [0, 2, 9, 16]],
        hidden_size=DIM, seed=2, rtol=1e-10, step=TrainingStep(steps=2, max_norm=0.05),
        reference_forward=lambda m, x, cu: m(x), data_parallel=2)
