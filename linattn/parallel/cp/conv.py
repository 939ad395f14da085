"""CP short convolution: a token needs the ``W-1`` tokens before it in its own sequence, so the
first sequence of a piece that started on an earlier rank takes its halo from the rank(s) before
(a piece may be shorter than ``W-1`` tokens, then several ranks contribute)."""

from __future__ import annotations

from typing import Callable

import torch

from linattn import kernels
from linattn.checks import require

from . import fla as fla_backend
from .comm import all_gather_from_cp_ranks
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
) -> torch.Tensor:
    """Causal depthwise short conv of this rank's contiguous piece ``x`` ``[1, T_local, D]`` with
    each sequence's ``W-1`` earlier tokens taken from the ranks that hold them; weight ``[D, W]``.

    backend: ``"exchange"`` gathers every rank's last tokens (all-gather; their gradient goes back
    by reduce-scatter) and runs ``piece_op`` on the piece with its halo prepended; ``"fla"`` runs
    fla's CP conv, which needs every piece to hold at least ``W-1`` tokens. None: ``"fla"`` for
    CUDA tensors of a CP group when ``W > 1`` and the pieces are long enough, else ``"exchange"``.
    piece_op: the single-process op of ``"exchange"``, ``piece_op(x, weight, cu_seqlens=, bias=,
    activation=)``; default ``linattn.kernels.short_conv``.
    """
    check_call(cp_context, backend, piece_op)
    ctx = cp_context
    require(x.dim() == 3 and x.shape[0] == 1 and x.shape[1] == ctx.local_tokens, "x",
            f"must be this rank's packed piece [1, T_local={ctx.local_tokens}, D], got shape {tuple(x.shape)}")
    W = weight.shape[-1]
    if backend is None:
        fla_fits = ctx.group is not None and W > 1 and ctx.local_tokens >= W - 1
        backend = "fla" if x.is_cuda and fla_fits else "exchange"
    if backend == "fla":
        return fla_backend.short_conv(x, weight, bias, activation, cp_context=ctx)

    conv = piece_op or kernels.short_conv
    cu = ctx.local_cu_seqlens
    if W == 1 or not any(ctx.first_seq_offset):
        return conv(x, weight, cu_seqlens=ctx.local_cu_seqlens_on(x.device), bias=bias, activation=activation)

    # every rank contributes its last min(W-1, T_local) tokens; the halo is the last
    # min(W-1, first_seq_offset) tokens before this piece, read from the gathered tails in token order
    local = ctx.local_tokens
    n_tail = min(W - 1, local)
    tails = all_gather_from_cp_ranks(x[0, local - n_tail:], ctx.group)  # [cp, n_tail, ...]
    halo_len = min(W - 1, ctx.first_seq_offset[ctx.cp_rank])
    pos = torch.arange(ctx.start - halo_len, ctx.start)
    src = pos // local
    halo = tails[src, pos - (src * local + local - n_tail)]
    x_ext = torch.cat([halo.unsqueeze(0), x], dim=1)
    cu_ext = cu + halo_len
    cu_ext[0] = 0
    y = conv(x_ext, weight, cu_seqlens=cu_ext.to(device=x.device, dtype=torch.int32), bias=bias, activation=activation)
    return y[:, halo_len:]
