"""fla 0.6.0's DPLR delta rule and RWKV-7 ops computed with linattn's reference.

    chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule,
    chunk_rwkv7, fused_recurrent_rwkv7, fused_mul_recurrent_rwkv7

Each keeps fla's signature and defaults (chunk_rwkv7 and fused_mul_recurrent_rwkv7 scale 1.0, the
others K ** -0.5), raises what fla raises (``head_first``, a non-negative ``lower_bound``, a batch
other than 1 with ``cu_seqlens``, initial states of another count, ``initial_state`` /
``output_final_state`` with CP) and returns what fla returns: ``(o, final_state)``, o in q's dtype
(v's for fused_mul_recurrent_rwkv7), the state in float32 (float64 for float64 inputs). Inputs
are cast to ``compute_dtype()`` and run ``reference.dplr_delta_rule`` (exact); ``safe_gate``,
``lower_bound``, ``chunk_size``, ``disable_recompute`` and ``cu_seqlens_cpu`` are fla's kernel
choices and have no effect on the math. Gradients flow through the fused recurrent forms too
(fla's raise in backward or have none). Other ``**kwargs`` of chunk_dplr_delta_rule are refused.

``cp_context=`` (chunk_dplr_delta_rule, chunk_rwkv7): the tokens go to the contiguous piece (fla's
zigzag: one all-to-all), then ``linattn.parallel.cp.delta_rule``'s exchange passes the state of a
sequence crossing a rank boundary to the next rank (and dS back in backward) around this rank's
piece of the reference.
"""

from __future__ import annotations

import warnings

import torch

from linattn import reference
from linattn.parallel import cp as parallel_cp

from .delta_rule_options import _check_varlen, _cp_cu_seqlens, _refuse_head_first, _state_dtype, _to_compute
from .patching import check_packing, refuse


def _run(function, q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, reverse, o_dtype):
    """The reference on this process's tokens, fla's output dtypes."""
    check_packing(function, q, cu_seqlens, name="q")
    state_dtype = _state_dtype(q)
    q, k, v, a, b, gk = _to_compute(q, k, v, a, b, gk)
    o, final_state = reference.dplr_delta_rule(
        q, k, v, a, b, gk, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, reverse=reverse, compute_dtype=q.dtype,
    )
    if final_state is not None:
        final_state = final_state.to(state_dtype).contiguous()
    return o.to(o_dtype), final_state


def chunk_dplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context=None,
    lower_bound: float | None = None,
    **kwargs,
):
    """fla's chunk_dplr_delta_rule: q, k, a, b, gk `[B, T, H, K]`, v `[B, T, H, V]`, states `[N, H, K, V]`."""
    name = "chunk_dplr_delta_rule"
    if q.dtype == torch.float32:  # fla warns so; the emulation computes float32 inputs as any other
        warnings.warn("ChunkDeltaRuleFunction does not support float32 on some platforms. Please use "
                      "bfloat16/float16.", category=RuntimeWarning, stacklevel=2)
    _refuse_head_first(kwargs)
    for key in kwargs:  # fla reads none of them: a caller passing one expects something fla never did
        refuse(name, key, kwargs[key], "is not an argument of fla 0.6.0's chunk_dplr_delta_rule")
    if lower_bound is not None and lower_bound >= 0:
        raise ValueError(f"`lower_bound` must be negative (gk is a log-decay < 0), got {lower_bound}.")
    cu_seqlens = _cp_cu_seqlens(cp_context, initial_state, output_final_state, cu_seqlens)
    _check_varlen(q, cu_seqlens, initial_state)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if cp_context is not None:
        o = _context_parallel(*_to_compute(q, k, v, a, b, gk), scale, cp_context)
        return o.to(q.dtype), None
    return _run(name, q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, False, q.dtype)


def fused_recurrent_dplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's fused_recurrent_dplr_delta_rule (differentiable here; fla's raises in backward)."""
    _check_varlen(q, cu_seqlens, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _run("fused_recurrent_dplr_delta_rule", q, k, v, a, b, gk, scale, initial_state, output_final_state,
                cu_seqlens, bool(reverse), q.dtype)


def chunk_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context=None,
    lower_bound: float | None = None,
):
    """fla's chunk_rwkv7: chunk_dplr_delta_rule with q = r, gk = w."""
    return chunk_dplr_delta_rule(q=r, k=k, v=v, a=a, b=b, gk=w, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 cu_seqlens_cpu=cu_seqlens_cpu, safe_gate=safe_gate, chunk_size=chunk_size,
                                 disable_recompute=disable_recompute, cp_context=cp_context, lower_bound=lower_bound)


def fused_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
):
    """fla's fused_recurrent_rwkv7: fused_recurrent_dplr_delta_rule with q = r, gk = w (scale None: K ** -0.5)."""
    return fused_recurrent_dplr_delta_rule(q=r, k=k, v=v, a=a, b=b, gk=w, scale=scale, initial_state=initial_state,
                                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_mul_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's fused_mul_recurrent_rwkv7 (RWKV-7's decode): the DPLR rule with a = -kk, b = kk * a;
    o in v's dtype, as fla's."""
    _check_varlen(r, cu_seqlens, initial_state)
    scale = r.shape[-1] ** -0.5 if scale is None else scale
    kk, a = _to_compute(kk, a)
    return _run("fused_mul_recurrent_rwkv7", r, k, v, -kk, kk * a, w, scale, initial_state, output_final_state,
                cu_seqlens, bool(reverse), v.dtype)


def _context_parallel(q, k, v, a, b, gk, scale, cp_context):
    """This rank's outputs `[1, T_local, H, V]`, the state crossing rank boundaries."""
    from .cp import piece_context

    ctx = piece_context(cp_context)
    q, k, v, a, b, gk = ctx.relayout.to_contiguous(q, k, v, a, b, gk)
    # the exchange runs a piece op with the delta rules' (q, k, v, g, beta) slots: a and b ride
    # together in beta's, gk (per key channel, as KDA's g) in g's
    ab = torch.stack([a, b], dim=3)  # [1, T, H, 2, K]
    o = parallel_cp.delta_rule(q, k, v, gk, ab, op="kda", scale=scale, backend="exchange", piece_op=_dplr_piece,
                               cp_context=ctx)
    return ctx.relayout.from_contiguous(o)


def _dplr_piece(q, k, v, gk, ab, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    """One CP rank's piece, in the inputs' (compute) dtype."""
    a, b = ab.unbind(3)
    return reference.dplr_delta_rule(q, k, v, a, b, gk, scale=scale, initial_state=initial_state,
                                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                     compute_dtype=q.dtype)


PATCHES = {
    "fla.ops.generalized_delta_rule.dplr.chunk:chunk_dplr_delta_rule": chunk_dplr_delta_rule,
    "fla.ops.generalized_delta_rule.dplr.fused_recurrent:fused_recurrent_dplr_delta_rule":
        fused_recurrent_dplr_delta_rule,
    "fla.ops.rwkv7.chunk:chunk_rwkv7": chunk_rwkv7,
    "fla.ops.rwkv7.fused_recurrent:fused_recurrent_rwkv7": fused_recurrent_rwkv7,
    "fla.ops.rwkv7.fused_recurrent:fused_mul_recurrent_rwkv7": fused_mul_recurrent_rwkv7,
}
