"""The CP collectives, each an autograd function named by what it does forward and backward:

    relayout_tokens                   fwd all-to-all tokens by a plan   bwd the inverse all-to-all
    all_gather_from_cp_ranks          fwd all-gather into [cp, ...]     bwd reduce-scatter (sum)
    receive_state_from_previous_rank  fwd recv the incoming state       bwd send its gradient back
    send_state_to_next_rank           fwd send the final state          bwd recv its gradient
    sum_over_cp_ranks                 fwd all-reduce (sum)              bwd identity

The CP ops call these, never raw collectives. ``group`` is a real process group here: the ops
never communicate without one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import RelayoutPlan

__all__ = [
    "all_gather_from_cp_ranks",
    "global_rank",
    "grad_anchor",
    "receive_state_from_previous_rank",
    "relayout_tokens",
    "send_state_to_next_rank",
    "sum_over_cp_ranks",
]

# torch >= 2.13 renames the flat collectives; older builds (GPU images) have only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def global_rank(group, group_rank: int) -> int:
    if group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def grad_anchor(device) -> torch.Tensor | None:
    """An empty leaf that requires grad (see ``receive_state_from_previous_rank``); None without grad mode."""
    if not torch.is_grad_enabled():
        return None
    return torch.empty(0, device=device, requires_grad=True)


def _all_to_all(x: torch.Tensor, plan: RelayoutPlan, group) -> torch.Tensor:
    # send_index[d]: local rows going to rank d; recv_index[s]: where rows from rank s land
    rows = x[0]
    send = rows.index_select(0, torch.cat(plan.send_index).to(rows.device))
    recv = rows.new_empty((sum(len(i) for i in plan.recv_index),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(
        recv, send,
        output_split_sizes=[len(i) for i in plan.recv_index],
        input_split_sizes=[len(i) for i in plan.send_index],
        group=group,
    )
    out = torch.empty_like(recv)
    out[torch.cat(plan.recv_index).to(rows.device)] = recv
    return out.unsqueeze(0)


class _RelayoutTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.plan, ctx.group = plan, group
        return _all_to_all(x, plan, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.plan.inverse(), ctx.group), None, None


class _AllGatherFromCPRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x, group=group)
        return out.view((size,) + tuple(x.shape))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty(tuple(grad.shape[1:]))
        _reduce_scatter_single(out, grad.flatten(0, 1), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


class _ReceiveStateFromPreviousRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shape, dtype, device, group, src, anchor, *upstream):
        ctx.group, ctx.src, ctx.num_upstream = group, src, len(upstream)
        state = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(state, src=src, group=group)
        return state

    @staticmethod
    def backward(ctx, grad):
        dist.isend(grad.contiguous(), dst=ctx.src, group=ctx.group).wait()
        return (None,) * (6 + ctx.num_upstream)


class _SendStateToNextRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, out, anchor, group, dst):
        ctx.group, ctx.dst, ctx.shape, ctx.dtype = group, dst, state.shape, state.dtype
        dist.isend(state.detach().contiguous(), dst=dst, group=group).wait()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_state = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_out.device)
        dist.recv(grad_state, src=ctx.dst, group=ctx.group)
        return grad_state, grad_out, None, None, None


def relayout_tokens(x: torch.Tensor, plan: RelayoutPlan, group) -> torch.Tensor:
    """Tokens (dim 1 of ``[1, T, F]``) moved by ``plan``; the gradient goes back by the inverse plan."""
    return _RelayoutTokens.apply(x, plan, group)


def all_gather_from_cp_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` as ``[cp, ...]``. Backward sums the gradient over the ranks (reduce-scatter),
    so every rank gets the gradient of its own ``x`` from all users."""
    return _AllGatherFromCPRanks.apply(x, group)


def receive_state_from_previous_rank(shape, dtype, device, group, src: int, anchor, *upstream) -> torch.Tensor:
    """The incoming recurrent state from global rank ``src``; backward sends its gradient back.

    The previous rank waits for that send, so this node must run in every backward that reaches
    this rank's graph. Its inputs make sure of it: the op's inputs (``upstream``, no gradient
    flows to them from here), so a backward restricted to some inputs (``autograd.grad``,
    ``backward(inputs=...)``) keeps the node whenever it reaches anything upstream of the op; and
    ``anchor`` (``grad_anchor``) for a plain backward when no op input on this rank requires grad.
    """
    return _ReceiveStateFromPreviousRank.apply(shape, dtype, device, group, src, anchor, *upstream)


def send_state_to_next_rank(state: torch.Tensor, out: torch.Tensor, anchor, group, dst: int) -> torch.Tensor:
    """Sends this piece's final ``state`` to global rank ``dst`` and passes ``out`` through; backward
    receives the state's gradient from ``dst``.

    Riding on the op's output puts the receive before this rank's local backward, which needs it."""
    return _SendStateToNextRank.apply(state, out, anchor, group, dst)


class _SumOverCPRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()  # never reduce in place into a tensor autograd may still need
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_cp_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's ``x``, on every rank; backward passes each rank's gradient to its own
    ``x`` (as a layer's output all-reduce over TP), so the gradient given on each rank must be the
    whole one. No collective in backward: nothing to order against the other ops' backward."""
    return _SumOverCPRanks.apply(x, group)
