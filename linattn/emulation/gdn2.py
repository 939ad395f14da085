"""fla 0.6.0's Gated DeltaNet 2 ops computed with linattn's reference (linattn.reference.gdn2).

    chunk_gdn2, fused_recurrent_gdn2

Each keeps fla's signature (names, order, defaults, ``**kwargs``), raises what fla raises for bad
option combinations and shapes, and returns what fla returns: ``(o, final_state)``, o in q's dtype
(v's for fused_recurrent_gdn2, as fla allocates it), the state in float32 (float64 for float64
inputs). Inputs are cast to ``compute_dtype()``; chunk_gdn2 runs the reference's chunked form,
fused_recurrent_gdn2 its token-by-token form (both exact), so gradients reach every
differentiable input, also through fused_recurrent_gdn2, which fla runs for inference only.

In-kernel options, applied to the inputs before the recurrence as fla's kernels do per token:
``use_gate_in_kernel`` (``-exp(A_log) softplus(g + dt_bias)`` per key channel, or
``lower_bound * sigmoid(exp(A_log) (g + dt_bias))`` when ``lower_bound`` is set, without the
``exp(A_log)`` factor when A_log is None), ``use_qk_l2norm_in_kernel``. ``state_v_first`` states
are ``[V, K]``. chunk_gdn2's ``cp_context=`` (from the emulated ``build_cp_context``) runs
``linattn.parallel.cp.delta_rule`` with this reference as the piece op, which passes the state of
a sequence crossing a rank boundary to the next rank (and dS back in backward); fla's zigzag layout
goes through the context's relayout to the contiguous piece and back.

Accepted without effect on the result (exact math does not depend on them): ``safe_gate`` (a
promise that gates lie in ``[lower_bound, 0)``: checked when the gate is given precomputed),
``disable_recompute``, ``cu_seqlens_cpu``. Refused (NotImplementedError via ``refuse``):
``return_intermediate_states=True``; in fused_recurrent_gdn2 the state-pool arguments fla's public
entry drops into ``**kwargs`` and the gate with neither A_log nor lower_bound (fla's kernel then
takes exp(1) for exp(A_log), where chunk_gdn2 raises).
"""

from __future__ import annotations

import torch

from linattn import reference
from linattn.parallel import cp as parallel_cp

from .delta_rule_options import (
    MAX_KEY_DIM,
    _check_initial_state_dtype,
    _check_safe_gate_bound,
    _check_varlen,
    _cp_cu_seqlens,
    _in_fla_state_layout,
    _per_channel_gate,
    _refuse_gate_without_A_log,
    _refuse_intermediate_states,
    _refuse_pool_arguments,
    _require_gate_A_log,
    _state_dtype,
    _state_v_first,
    _to_compute,
)
from .patching import check_packing


def chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cp_context=None,
    **kwargs,
):
    """fla's chunk_gdn2: q, k, g, b `[B, T, H, K]`; v, w `[B, T, H, V]`; A_log `[H]` and dt_bias
    `[H*K]` come in kwargs (read with use_gate_in_kernel only)."""
    function = "chunk_gdn2"
    state_v_first = _state_v_first(state_v_first, kwargs)
    _refuse_intermediate_states(function, return_intermediate_states)
    # fla's checks, in fla's order and words
    cu_seqlens = _cp_cu_seqlens(cp_context, initial_state, output_final_state, cu_seqlens)
    _check_varlen(q, cu_seqlens, initial_state, sentence_gap=" ")
    _check_initial_state_dtype(initial_state, q)
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    _require_gate_A_log(use_gate_in_kernel, A_log, lower_bound)
    chunk_size = kwargs.pop("chunk_size", 64)  # no effect on exact math, checked as fla does
    if chunk_size != 64:
        raise ValueError(f"`chunk_size` must be 64 for GDN-2, got {chunk_size}.")
    _check_safe_gate_bound(safe_gate, use_gate_in_kernel, lower_bound)
    assert q.shape == k.shape == g.shape, "q, k, g must have the same shape."
    assert k.shape[-1] <= MAX_KEY_DIM, f"GDN-2 only supports key headdim <= 256, got {k.shape[-1]}."
    assert b.shape == q.shape, (f"b (channel-wise erase gate) must have shape [B, T, H, K] matching q; "
                                f"got {tuple(b.shape)} vs q {tuple(q.shape)}.")
    assert w.shape == v.shape, (f"w (channel-wise write gate) must have shape [B, T, H, V] matching v; "
                                f"got {tuple(w.shape)} vs v {tuple(v.shape)}.")
    assert v.shape == (*q.shape[:3], v.shape[-1]), (f"v must have shape [B, T, H, V] matching q on (B, T, H); "
                                                    f"got {tuple(v.shape)} vs q {tuple(q.shape)}.")

    o_dtype, state_dtype = q.dtype, _state_dtype(q)
    q, k, v, g, b, w, A_log, dt_bias = _to_compute(q, k, v, g, b, w, A_log, dt_bias)
    g = _per_channel_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate)
    if cp_context is not None:
        return _context_parallel(q, k, v, g, b, w, scale, use_qk_l2norm_in_kernel, cp_context).to(o_dtype), None
    return _run("chunk", q, k, v, g, b, w, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, o_dtype, state_dtype, function)


def fused_recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """fla's fused_recurrent_gdn2: q, k `[B, T, H, K]`; g, b `[B, T, HV, K]`; v, w `[B, T, HV, V]`
    (GVA: value head j reads key head j // (HV // H)); A_log `[HV]`, dt_bias `[HV*K]`."""
    function = "fused_recurrent_gdn2"
    _refuse_pool_arguments(function, kwargs, "fla.ops.gdn2.fused_recurrent.fused_recurrent_gdn2_fwd takes it")
    state_v_first = _state_v_first(state_v_first, kwargs)
    _check_varlen(q, cu_seqlens, initial_state, sentence_gap=" ")
    assert b.shape == (*v.shape[:3], k.shape[-1]), (f"b must have shape [B, T, HV, K]; got {tuple(b.shape)} "
                                                    f"vs expected {(*v.shape[:3], k.shape[-1])}.")
    assert w.shape == v.shape, f"w must have shape [B, T, HV, V] matching v; got {tuple(w.shape)} vs v {tuple(v.shape)}."
    _refuse_gate_without_A_log(function, use_gate_in_kernel, A_log, lower_bound)

    o_dtype, state_dtype = v.dtype, _state_dtype(q)
    q, k, v, g, b, w, A_log, dt_bias = _to_compute(q, k, v, g, b, w, A_log, dt_bias)
    g = _per_channel_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    return _run("recurrent", q, k, v, g, b, w, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                state_v_first, cu_seqlens, o_dtype, state_dtype, function)


def _run(mode, q, k, v, g, b, w, scale, initial_state, output_final_state, use_qk_l2norm, state_v_first,
         cu_seqlens, o_dtype, state_dtype, function):
    """The recurrence on inputs already in the compute dtype, the gate applied; fla's returns."""
    check_packing(function, q, cu_seqlens, name="q")
    return _in_fla_state_layout(
        lambda state: reference.gdn2(q, k, v, g, b, w, scale=scale, initial_state=state,
                                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                     use_qk_l2norm=use_qk_l2norm, mode=mode, compute_dtype=q.dtype),
        initial_state, state_v_first, o_dtype, state_dtype)


def _context_parallel(q, k, v, g, b, w, scale, use_qk_l2norm, cp_context):
    """This rank's outputs `[1, T_local, H, V]`, the state crossing rank boundaries."""
    from .cp import piece_context

    ctx = piece_context(cp_context)
    # both gates ride in the exchange's one per-token gate slot: [.., K + V], split in the piece op
    gates = torch.cat([b, w], dim=-1)
    o = parallel_cp.delta_rule(*ctx.relayout.to_contiguous(q, k, v, g, gates), op="kda", scale=scale,
                               use_qk_l2norm=use_qk_l2norm, backend="exchange", piece_op=_chunk_gdn2_piece,
                               cp_context=ctx)
    return ctx.relayout.from_contiguous(o)


def _chunk_gdn2_piece(q, k, v, g, gates, **kwargs):
    """One CP rank's piece for linattn.parallel.cp.delta_rule, in the inputs' (compute) dtype."""
    b, w = gates.split([k.shape[-1], v.shape[-1]], dim=-1)
    return reference.gdn2(q, k, v, g, b, w, mode="chunk", compute_dtype=q.dtype, **kwargs)


PATCHES = {
    "fla.ops.gdn2.chunk:chunk_gdn2": chunk_gdn2,
    "fla.ops.gdn2.fused_recurrent:fused_recurrent_gdn2": fused_recurrent_gdn2,
}
