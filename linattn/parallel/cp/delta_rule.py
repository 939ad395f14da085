"""CP (gated) delta rule: the recurrent state of a sequence that crosses a rank boundary is passed
along the ranks (receive, run the piece, send the final state); backward passes ``dS`` back the
same way. Only boundaries crossed by a sequence exchange anything (every rank knows which from
the global ``cu_seqlens``), so unrelated pieces never wait on each other."""

from __future__ import annotations

from typing import Callable

import torch

from linattn import kernels
from linattn.checks import require
from linattn.heads import check_head_pairing, from_grouped, to_grouped

from . import fla as fla_backend
from .comm import global_rank, grad_anchor, receive_state_from_previous_rank, send_state_to_next_rank
from .context import CPContext, check_call
from .conv import sequences_ending_here

OPS = ("gated_delta_rule", "kda")

__all__ = ["OPS", "delta_rule"]


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    op: str,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: str | None = None,
    piece_op: Callable | None = None,
    cp_context: CPContext,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    head_pairing: str = "grouped",
):
    """Output ``[1, T_local, HV, V]`` of the (gated) delta rule over this rank's contiguous piece,
    with the recurrent state of sequences crossing rank boundaries carried exactly (forward and
    backward).

    op: ``"gated_delta_rule"`` (g ``[1, T, HV]``) or ``"kda"`` (g ``[1, T, HV, K]``), the
    ``linattn.kernels`` entry names.
    backend: ``"exchange"`` passes the state rank to rank around ``piece_op``; ``"fla"`` runs fla's
    chunk kernels with an fla CP context. None: ``"fla"`` for CUDA tensors of a CP group, else
    ``"exchange"``.
    piece_op: the single-process op of ``"exchange"``, with ``linattn.kernels``' signature;
    default the ``linattn.kernels`` entry named ``op``.

    initial_state ``[N, HV, K, V]``: every sequence of the GLOBAL batch starts from its own, on
    whichever rank it starts (a continued prefill: what fla's CP refuses). output_final_state:
    also return every sequence's final state ``[N, HV, K, V]``, whole on every rank (each
    computed where its sequence ends; gradient as ``conv.sequences_ending_here``): ``(o, final_state)``. Both run on
    the ``"exchange"`` backend only.

    head_pairing: which key head each value head reads (linattn.heads). Both backends and a
    ``piece_op`` run the grouped pairing: a tiled layer's value-head tensors move into grouped
    order here and the output (and final state) back.
    """
    require(op in OPS, "op", f"must be one of {OPS}, got {op!r}")
    if check_head_pairing(head_pairing) != "grouped" and v.shape[2] != q.shape[2]:
        H, HV = q.shape[2], v.shape[2]

        def grouped(t, dim=2):
            return None if t is None else to_grouped(t, H, HV, head_pairing, dim)

        out = delta_rule(q, k, grouped(v), grouped(g), grouped(beta), op=op, scale=scale, use_qk_l2norm=use_qk_l2norm,
                         backend=backend, piece_op=piece_op, cp_context=cp_context,
                         initial_state=grouped(initial_state, 1), output_final_state=output_final_state)
        if output_final_state:
            return from_grouped(out[0], H, HV, head_pairing, 2), from_grouped(out[1], H, HV, head_pairing, 1)
        return from_grouped(out, H, HV, head_pairing, 2)
    check_call(cp_context, backend, piece_op)
    ctx = cp_context
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        require(t.dim() >= 3 and t.shape[0] == 1 and t.shape[1] == ctx.local_tokens, name,
                f"must be this rank's packed piece [1, T_local={ctx.local_tokens}, ...], got shape {tuple(t.shape)}")
    with_state = initial_state is not None or output_final_state
    require(not (with_state and backend == "fla"), "backend",
            "'fla' takes no initial state and returns no final state under CP (fla 0.6.0 asserts so, "
            "sglang #34059); use 'exchange'")
    if backend is None:
        backend = "fla" if q.is_cuda and ctx.group is not None and not with_state else "exchange"
    if backend == "fla":
        return fla_backend.delta_rule(q, k, v, g, beta, op=op, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                      cp_context=ctx)

    fn = piece_op or getattr(kernels, op)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    # the state travels in float64 for float64 runs, float32 otherwise (fla's state dtype)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_seqs = ctx.local_cu_seqlens.numel() - 1
    anchor = grad_anchor(q.device)
    given, N = initial_state, ctx.cu_seqlens.numel() - 1
    if with_state:
        ctx.check_state_packing()
        require(given is None or tuple(given.shape) == (N, HV, K, V), "initial_state",
                f"must be the state [N={N}, HV={HV}, K={K}, V={V}] of every sequence of the batch, "
                f"got {None if given is None else tuple(given.shape)}")
    local_given = None if given is None else given[ctx.first_sequence:ctx.first_sequence + num_seqs].to(state_dtype)
    initial_state = local_given
    if ctx.first_seq_continues:
        src = global_rank(ctx.group, ctx.cp_rank - 1)
        upstream = [t for t in (q, k, v, g, beta) if t.requires_grad]
        state_in = receive_state_from_previous_rank((HV, K, V), state_dtype, q.device, ctx.group, src,
                                                    anchor, *upstream)
        rest = state_in.new_zeros((num_seqs - 1, HV, K, V)) if local_given is None else local_given[1:]
        initial_state = torch.cat([state_in.unsqueeze(0), rest], dim=0)
    o, final_state = fn(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=ctx.last_seq_continues or output_final_state,
        cu_seqlens=ctx.local_cu_seqlens_on(q.device),
        use_qk_l2norm=use_qk_l2norm,
    )
    if ctx.last_seq_continues:
        dst = global_rank(ctx.group, ctx.cp_rank + 1)
        o = send_state_to_next_rank(final_state[-1].to(state_dtype), o, anchor, ctx.group, dst)
    if output_final_state:
        return o, sequences_ending_here(final_state.to(state_dtype), ctx, N)
    return o
