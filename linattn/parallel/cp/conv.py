"""CP short convolution: a token needs the ``W-1`` tokens before it in its own sequence, so the
first sequence of a piece that started on an earlier rank takes its halo from the rank(s) before
(a piece may be shorter than ``W-1`` tokens, then several ranks contribute)."""

from __future__ import annotations

from typing import Callable

import torch

from linattn import kernels
from linattn.checks import require

from . import fla as fla_backend
from .comm import all_gather_from_cp_ranks, sum_over_cp_ranks
from .context import CPContext, check_call

__all__ = ["short_conv"]


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    backend: str | None = None,
    piece_op: Callable | None = None,
    cp_context: CPContext,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """Causal depthwise short conv of this rank's contiguous piece ``x`` ``[1, T_local, D]`` with
    each sequence's ``W-1`` earlier tokens taken from the ranks that hold them; weight ``[D, W]``.

    backend: ``"exchange"`` gathers every rank's last tokens (all-gather; their gradient goes back
    by reduce-scatter) and runs ``piece_op`` on the piece with its halo prepended; ``"fla"`` runs
    fla's CP conv, which needs every piece to hold at least ``W-1`` tokens. None: ``"fla"`` for
    CUDA tensors of a CP group when ``W > 1`` and the pieces are long enough, else ``"exchange"``.
    piece_op: the single-process op of ``"exchange"``, ``piece_op(x, weight, cu_seqlens=, bias=,
    activation=)``; default ``linattn.kernels.short_conv``.

    initial_state: the conv state ``[N, D, W-1]`` of every sequence of the GLOBAL batch (the same
    on every rank): each sequence starts from its own, on whichever rank it starts, and a piece
    whose first sequence started earlier takes its halo from the state too where the earlier
    ranks hold fewer than W-1 of its tokens (a continued prefill). output_final_state: also
    return every sequence's final conv state ``[N, D, W-1]``, whole on every rank (each computed
    where its sequence ends; its gradient: ``sequences_ending_here``). Both run on the
    ``"exchange"`` backend only (fla's CP conv takes no cache: it asserts so), with a piece_op
    that takes them (``linattn.kernels.short_conv`` does).
    """
    check_call(cp_context, backend, piece_op)
    ctx = cp_context
    require(x.dim() == 3 and x.shape[0] == 1 and x.shape[1] == ctx.local_tokens, "x",
            f"must be this rank's packed piece [1, T_local={ctx.local_tokens}, D], got shape {tuple(x.shape)}")
    W = weight.shape[-1]
    with_state = initial_state is not None or output_final_state
    require(not (with_state and backend == "fla"), "backend",
            "'fla' takes no conv state in or out under CP (fla asserts so); use 'exchange'")
    if backend is None:
        fla_fits = ctx.group is not None and W > 1 and ctx.local_tokens >= W - 1 and not with_state
        backend = "fla" if x.is_cuda and fla_fits else "exchange"
    if backend == "fla":
        return fla_backend.short_conv(x, weight, bias, activation, cp_context=ctx)

    conv = piece_op or kernels.short_conv
    state = {}
    if with_state:
        state = dict(initial_state=_local_conv_state(initial_state, x, W, ctx), output_final_state=True)
    cu = ctx.local_cu_seqlens
    if W == 1 or not any(ctx.first_seq_offset):
        out = conv(x, weight, cu_seqlens=ctx.local_cu_seqlens_on(x.device), bias=bias, activation=activation, **state)
    else:
        # the halo goes in front of the piece as tokens of its first sequence (empty where that
        # sequence starts here), from that sequence's state where it is shorter than W-1
        halo = _halo(x, ctx, W)
        halo_len = halo.shape[0]
        x_ext = torch.cat([halo.unsqueeze(0), x], dim=1)
        cu_ext = cu + halo_len
        cu_ext[0] = 0
        out = conv(x_ext, weight, cu_seqlens=cu_ext.to(device=x.device, dtype=torch.int32), bias=bias,
                   activation=activation, **state)
        out = (out[0][:, halo_len:], out[1]) if with_state else out[:, halo_len:]
    if not with_state:
        return out
    y, final = out
    return (y, sequences_ending_here(final, ctx, ctx.cu_seqlens.numel() - 1)) if output_final_state else y


def _halo(x, ctx, W):
    """The last min(W-1, first_seq_offset) tokens before this piece in its first sequence,
    ``[halo_len, D]``. Collective: every rank contributes its last min(W-1, T_local) tokens, and
    the halo is read from the gathered tails in token order."""
    local = ctx.local_tokens
    n_tail = min(W - 1, local)
    tails = all_gather_from_cp_ranks(x[0, local - n_tail:], ctx.group)  # [cp, n_tail, ...]
    halo_len = min(W - 1, ctx.first_seq_offset[ctx.cp_rank])
    pos = torch.arange(ctx.start - halo_len, ctx.start)
    src = pos // local
    return tails[src, pos - (src * local + local - n_tail)]


def _local_conv_state(initial_state, x, W, ctx):
    """The conv state of the piece's sequences: each one's row of the global ``[N, D, W-1]``
    (zeros for None). A first sequence that started earlier gets its row too: its halo tokens go
    in front of it and shift that state out as far as they reach."""
    ctx.check_state_packing()
    D, N = x.shape[-1], ctx.cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = x.new_zeros(N, D, W - 1)
    require(tuple(initial_state.shape) == (N, D, W - 1), "initial_state",
            f"must be the conv state [N={N}, D={D}, W-1={W - 1}] of every sequence of the batch, "
            f"got {tuple(initial_state.shape)}")
    return initial_state[ctx.first_sequence:ctx.first_sequence + ctx.local_cu_seqlens.numel() - 1]


def sequences_ending_here(final: torch.Tensor, ctx, num_sequences: int) -> torch.Tensor:
    """``[N, ...]`` final states of the whole batch on every rank, each from the rank where its
    sequence ends (every rank fills its rows, zeros elsewhere; ``sum_over_cp_ranks``). Backward,
    each rank's gradient goes to the rows it computed: the gradient of the final states must be
    whole on every rank, as a TP layer's output gradient is. A caller chaining calls under
    autograd, where the next call uses each row on one rank only, sums that gradient over the CP
    ranks first (pytest_linattn's continuation check does, call by call)."""
    ending = ctx.ending_sequences
    before = final.new_zeros((ctx.first_sequence,) + tuple(final.shape[1:]))
    after = final.new_zeros((num_sequences - ctx.first_sequence - ending,) + tuple(final.shape[1:]))
    return sum_over_cp_ranks(torch.cat([before, final[:ending], after]), ctx.group)
