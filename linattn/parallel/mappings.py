"""Tensor- and sequence-parallel collectives as autograd functions (Megatron-LM mappings.py style).

Each function is named by what it does forward, and its backward is the adjoint:

    copy_to_tensor_parallel_region            fwd identity      bwd all-reduce
    reduce_from_tensor_parallel_region        fwd all-reduce    bwd identity
    scatter_to_sequence_parallel_region       fwd split tokens  bwd all-gather tokens
    gather_from_sequence_parallel_region      fwd all-gather    bwd reduce-scatter
    reduce_scatter_to_sequence_parallel_region fwd reduce-scatter bwd all-gather
    copy_to_key_head_replicas                 fwd identity      bwd all-reduce over the ranks
                                                                    holding the same key head

Layers call these, never raw collectives. A group of None (no parallelism) or of one rank makes
every function the identity. Sequence-parallel functions split / gather along `dim` (tokens are
dim 1 of a packed `[1, T, hidden]` tensor) in rank order: rank i holds the i-th contiguous slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import group_rank, group_size

__all__ = [
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "copy_to_key_head_replicas",
]

TOKEN_DIM = 1


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()  # never reduce in place into a tensor autograd may still need
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(f"sequence parallel needs dim {dim} of size {x.shape[dim]} divisible by the group size {size}")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    # collectives work on dim 0: move the gathered dim to the front and back
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((size * front.shape[0],) + tuple(front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size != 0:
        raise ValueError(f"sequence parallel needs dim {dim} of size {x.shape[dim]} divisible by the group size {size}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size,) + tuple(front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def _sum_over_replicas(x: torch.Tensor, group, replicas: int) -> torch.Tensor:
    """The sum of `x` over this rank's replica group: the `replicas` consecutive ranks of `group`
    that hold the same key head. One all-reduce over `group` of a buffer with a row per replica
    group, each rank writing its own row (the others' rows stay zero)."""
    size = group_size(group)
    if replicas == 1 or size == 1:
        return x
    index = group_rank(group) // replicas
    buffer = x.new_zeros((size // replicas,) + tuple(x.shape))
    buffer[index] = x
    dist.all_reduce(buffer, group=group)
    return buffer[index].clone()


class _CopyToKeyHeadReplicas(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, replicas):
        ctx.group, ctx.replicas = group, replicas
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _sum_over_replicas(grad, ctx.group, ctx.replicas), None, None


def copy_to_key_head_replicas(x: torch.Tensor, group, replicas: int) -> torch.Tensor:
    """A key-head weight that `replicas` consecutive ranks of `group` each hold whole (TP beyond
    the key heads): forward identity, backward its gradient summed over those ranks only (each
    holds a partial: the gradient through its own value heads)."""
    if replicas == 1:
        return x
    return _CopyToKeyHeadReplicas.apply(x, group, replicas)


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of column-parallel work, replicated weights)."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce forward (sum of row-parallel partial outputs); identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = TOKEN_DIM) -> torch.Tensor:
    """Keep this rank's contiguous slice of `dim` forward; all-gather the gradient backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = TOKEN_DIM) -> torch.Tensor:
    """All-gather along `dim` forward; reduce-scatter of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = TOKEN_DIM) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of `dim` forward; all-gather the gradient backward."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group, dim)
