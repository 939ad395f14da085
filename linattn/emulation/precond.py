"""fla 0.6.0's preconditioned delta rules computed with linattn's reference (linattn.reference.precond).

    chunk_precond_gated_delta_rule, fused_recurrent_precond_gated_delta_rule,
    chunk_precond_kda, fused_recurrent_precond_kda

Each keeps fla's signature, raises what fla raises (``cp_context`` included: fla's chunk entries
refuse it, the preconditioned path has no CP plumbing), and returns ``(o, final_state,
final_A_state)``: o in q's dtype (v's for the fused_recurrent entries, as fla allocates it), the
states in float32 (float64 for float64 inputs). chunk entries run the reference's chunked form,
fused_recurrent ones its token-by-token form (both exact); gradients reach every differentiable
input, also through the fused_recurrent entries, which fla runs for inference only.

Options: ``use_qk_l2norm_in_kernel`` (always on in chunk_precond_kda, as in fla),
``transpose_state_layout`` (states ``[V, K]``), ``x``, ``eps``, ``log_atk_scale``; KDA's
``use_gate_in_kernel`` with ``A_log`` / ``dt_bias`` / ``lower_bound`` and ``safe_gate`` as in
linattn.emulation.gdn2; fused_recurrent_precond_gated_delta_rule's ``g`` and ``gk`` (added log
decays; neither: no decay) and ``beta=None`` (ones). Accepted without effect: ``cu_seqlens_cpu``,
``chunk_indices``, ``solve_tril_precision``, ``disable_recompute``. Refused (NotImplementedError):
``return_intermediate_states=True``, ``gv``, a beta per value channel, ``g_atk`` / ``beta_atk``
None, fused_recurrent_precond_kda with more value than key heads (fla's kernel then sizes the ATK
state by value heads) or with ``use_gate_in_kernel`` and neither ``A_log`` nor ``lower_bound``.
"""

from __future__ import annotations

import torch

from linattn import reference

from .delta_rule_options import (
    MAX_KEY_DIM,
    _check_initial_state_dtype,
    _check_safe_gate_bound,
    _check_varlen,
    _per_channel_gate,
    _refuse_beta_per_value_channel,
    _refuse_gate_without_A_log,
    _refuse_gv,
    _refuse_intermediate_states,
    _state_dtype,
    _to_compute,
)
from .patching import check_packing, refuse


def chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, scale=None, initial_state=None,
                                   initial_A_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
                                   transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None):
    """fla's chunk_precond_gated_delta_rule: q, k `[B,T,H,K]`; v `[B,T,HV,V]`; g_atk, beta_atk `[B,T,H]`; g, beta `[B,T,HV]`."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, "
                         f"but got q.shape[2]={q.shape[2]} and k.shape[2]={k.shape[2]}")
    H, HV = q.shape[2], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by "
                         f"num_heads (H={H}), but got HV % H = {HV % H}")
    _refuse_cp(cp_context, "chunk_precond_gated_delta_rule")
    _check_varlen(q, cu_seqlens, initial_state, sentence_gap=" ")
    o_dtype = q.dtype
    return _run(reference.precond_gated_delta_rule, "chunk", q, k, v, g_atk, g, beta_atk, beta, scale,
                initial_state, initial_A_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                transpose_state_layout, x, eps, log_atk_scale, o_dtype, "chunk_precond_gated_delta_rule")


def fused_recurrent_precond_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, g_atk=None, beta_atk=None,
                                             scale=None, initial_state=None, initial_A_state=None,
                                             output_final_state=False, use_qk_l2norm_in_kernel=True,
                                             cu_seqlens=None, transpose_state_layout=False, x=1.5, eps=1e-6,
                                             log_atk_scale=None):
    """fla's fused_recurrent_precond_gated_delta_rule: g `[B,T,HV]` and/or gk `[B,T,HV,K]` log decays."""
    function = "fused_recurrent_precond_gated_delta_rule"
    _refuse_gv(function, gv)
    _refuse_beta_per_value_channel(function, beta, v)
    _refuse_missing_atk(function, g_atk, beta_atk)
    _check_varlen(q, cu_seqlens, initial_state, sentence_gap=" ")
    if beta is None:
        beta = torch.ones_like(q[..., 0])
    B, T, HV, K = *v.shape[:3], k.shape[-1]
    decay = torch.zeros(B, T, HV, K, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                        device=q.device)
    decay = decay + (0 if g is None else g[..., None]) + (0 if gk is None else gk)
    return _run(reference.precond_kda, "recurrent", q, k, v, decay, g_atk, beta_atk, beta, scale, initial_state,
                initial_A_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout,
                x, eps, log_atk_scale, v.dtype, function)


def chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None, initial_A_state=None,
                      output_final_state=False, use_gate_in_kernel=False, safe_gate=False, lower_bound=None,
                      cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None,
                      transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None, solve_tril_precision=None,
                      disable_recompute=False, return_intermediate_states=False, **kwargs):
    """fla's chunk_precond_kda: q, k, g `[B,T,H,K]`; v `[B,T,H,V]`; g_atk, beta_atk, beta `[B,T,H]`;
    A_log `[H]` and dt_bias `[H*K]` in kwargs (read with use_gate_in_kernel only)."""
    function = "chunk_precond_kda"
    _refuse_intermediate_states(function, return_intermediate_states)
    _refuse_cp(cp_context, function)
    _check_varlen(q, cu_seqlens, initial_state, sentence_gap=" ")
    _check_initial_state_dtype(initial_state, q)
    _check_safe_gate_bound(safe_gate, use_gate_in_kernel, lower_bound)
    assert q.shape == k.shape == g.shape, "q, k, g must have the same shape."
    assert k.shape[-1] <= MAX_KEY_DIM, "Currently we only support key headdim <=256 for KDA :-("
    assert beta.shape == q.shape[:3], "beta must be of shape (batch size, seq len, num of head)."
    assert v.shape == (*q.shape[:3], v.shape[-1]), "v must be of shape (batch size, seq len, num of head, head dim)."
    if use_gate_in_kernel:
        assert "A_log" in kwargs, "A_log must be provided when use_gate_in_kernel=True."
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    g, A_log, dt_bias = _to_compute(g, A_log, dt_bias)
    g = _per_channel_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate)
    return _run(reference.precond_kda, "chunk", q, k, v, g, g_atk, beta_atk, beta, scale, initial_state,
                initial_A_state, output_final_state, True, cu_seqlens, transpose_state_layout, x, eps,
                log_atk_scale, q.dtype, function)


def fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, A_log=None, dt_bias=None, scale=None,
                                initial_state=None, initial_A_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, lower_bound=None,
                                cu_seqlens=None, transpose_state_layout=False, x=1.5, eps=1e-6,
                                log_atk_scale=None, **kwargs):
    """fla's fused_recurrent_precond_kda: g `[B,T,H,K]`; g_atk, beta_atk, beta `[B,T,H]`; A_log `[H]`, dt_bias `[H*K]`."""
    function = "fused_recurrent_precond_kda"
    if v.shape[2] != q.shape[2]:
        refuse(function, "v", f"tensor with {v.shape[2]} heads for {q.shape[2]} key heads",
               why="is not emulated: fla's kernel then keeps one ATK state per value head")
    _refuse_gate_without_A_log(function, use_gate_in_kernel, A_log, lower_bound)
    _check_varlen(q, cu_seqlens, initial_state, sentence_gap=" ")
    g, A_log, dt_bias = _to_compute(g, A_log, dt_bias)
    g = _per_channel_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    return _run(reference.precond_kda, "recurrent", q, k, v, g, g_atk, beta_atk, beta, scale, initial_state,
                initial_A_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout,
                x, eps, log_atk_scale, v.dtype, function)


def _refuse_cp(cp_context, function):
    """fla's words: its preconditioned chunk entries have no context parallelism."""
    if cp_context is not None:
        raise NotImplementedError(
            f"Context parallelism is not yet supported for {function}: "
            "the preconditioned path lacks the CP state compression/expansion plumbing. "
            "Please run without `cp_context`.")


def _refuse_missing_atk(function, g_atk, beta_atk):
    for name, value in (("g_atk", g_atk), ("beta_atk", beta_atk)):
        if value is None:
            refuse(function, name, None, why="is not emulated: the preconditioner needs it")


def _run(op, mode, q, k, v, g_first, g_second, beta_atk, beta, scale, initial_state, initial_A_state,
         output_final_state, use_qk_l2norm, cu_seqlens, transpose_state_layout, x, eps, log_atk_scale, o_dtype,
         function):
    """The reference on inputs cast to the compute dtype; fla's returns (states transposed when asked)."""
    _refuse_missing_atk(function, *((g_first, beta_atk) if op is reference.precond_gated_delta_rule
                                    else (g_second, beta_atk)))
    check_packing(function, q, cu_seqlens, name="q")
    state_dtype = _state_dtype(q)
    tensors = _to_compute(q, k, v, g_first, g_second, beta_atk, beta, initial_state, initial_A_state)
    h0, a0 = tensors[7:]
    if h0 is not None and transpose_state_layout:
        h0 = h0.transpose(-1, -2)
    if isinstance(log_atk_scale, torch.Tensor):
        (log_atk_scale,) = _to_compute(log_atk_scale)
    o, S, A = op(*tensors[:7], scale=scale, initial_state=h0, initial_A_state=a0,
                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                 x=x, eps=eps, log_atk_scale=log_atk_scale, mode=mode, compute_dtype=tensors[0].dtype)
    if S is not None:
        S = (S.transpose(-1, -2) if transpose_state_layout else S).to(state_dtype).contiguous()
        A = A.to(state_dtype)
    return o.to(o_dtype), S, A


PATCHES = {
    "fla.ops.precond_gated_delta_rule.chunk:chunk_precond_gated_delta_rule": chunk_precond_gated_delta_rule,
    "fla.ops.precond_gated_delta_rule.fused_recurrent:fused_recurrent_precond_gated_delta_rule":
        fused_recurrent_precond_gated_delta_rule,
    "fla.ops.precond_kda.chunk:chunk_precond_kda": chunk_precond_kda,
    "fla.ops.precond_kda.fused_recurrent:fused_recurrent_precond_kda": fused_recurrent_precond_kda,
}
