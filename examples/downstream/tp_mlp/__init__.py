"""A toy tensor-parallel MLP: fc1 column-parallel (output features split), fc2 row-parallel
(input features split), so the hidden activation never leaves its rank.

Collectives follow Megatron's naming, each an autograd function named by what it does forward
and backward, so the layers never call a raw collective inline:

    copy_to_tensor_parallel      forward: identity     backward: all-reduce (sum)
    reduce_from_tensor_parallel  forward: all-reduce   backward: identity
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Every rank used the full input through its own shard: the input grad is the sum.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel(x, group=None):
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x, group=None):
    return _ReduceFromTensorParallel.apply(x, group)


class MLP(nn.Module):
    """The replicated reference: fc2(gelu(fc1(x)))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TensorParallelMLP(nn.Module):
    """MLP with fc1's rows and fc2's columns split over the ranks of `group`.

    fc2's bias is replicated and added once, after the all-reduce.
    """

    def __init__(self, dim: int, hidden: int, world_size: int, group=None):
        super().__init__()
        if hidden % world_size:
            raise ValueError(f"hidden={hidden} must be divisible by world_size={world_size}")
        shard = hidden // world_size
        self.group = group
        self.fc1 = nn.Linear(dim, shard)               # column-parallel: rows [r*shard, (r+1)*shard)
        self.fc2 = nn.Linear(shard, dim, bias=False)   # row-parallel: columns of the same range
        self.bias = nn.Parameter(torch.zeros(dim))

    @classmethod
    def from_replicated(cls, mlp: MLP, rank: int, world_size: int, group=None) -> "TensorParallelMLP":
        """This rank's shard of a replicated MLP's weights."""
        dim, hidden = mlp.fc1.in_features, mlp.fc1.out_features
        tp = cls(dim, hidden, world_size, group).to(mlp.fc1.weight)
        rows = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)
        with torch.no_grad():
            tp.fc1.weight.copy_(mlp.fc1.weight[rows])
            tp.fc1.bias.copy_(mlp.fc1.bias[rows])
            tp.fc2.weight.copy_(mlp.fc2.weight[:, rows])
            tp.bias.copy_(mlp.fc2.bias)
        return tp

    def forward(self, x):
        h = F.gelu(self.fc1(copy_to_tensor_parallel(x, self.group)))
        return reduce_from_tensor_parallel(self.fc2(h), self.group) + self.bias
