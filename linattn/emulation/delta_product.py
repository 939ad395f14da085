"""fla 0.6.0's gated DeltaProduct op computed with linattn's reference.

    chunk_gated_delta_product

It keeps fla's signature (no ``**kwargs``: fla's takes none), raises what fla raises (float32
inputs, shapes other than fla's, CP with ``g=None``, an initial state or a final state), and
returns what fla returns: ``(o, final_state)``, o in q's dtype, the state in float32 (float64 for
float64 inputs). Inputs are cast to ``compute_dtype()`` and run the reference's chunked form
(exact); ``cu_seqlens_cpu`` is accepted without effect.

``cp_context=`` (from the emulated ``build_cp_context``): the tokens go to the contiguous piece
(fla's zigzag: one all-to-all, a token's steps with it), then the gated delta rule over the
piece's stream of steps runs ``linattn.parallel.cp.delta_rule`` with a context of the same
partition counted in steps, which passes the state of a sequence crossing a rank boundary to the
next rank (and dS back in backward); each token's output is its last step's.

fla 0.6.0 has no fused recurrent DeltaProduct entry: fla's GatedDeltaProduct layer, in its
``fused_recurrent`` mode, runs ``fused_recurrent_gated_delta_rule`` over the step stream, which
``gated_delta_rule`` emulates.
"""

from __future__ import annotations

import torch

from linattn import reference
from linattn.parallel import cp as parallel_cp
from linattn.reference.delta_product import last_step, token_to_steps

from .delta_rule_options import _check_varlen, _cp_cu_seqlens, _state_dtype, _to_compute
from .patching import check_packing


def chunk_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_householder: int,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
):
    """fla's chunk_gated_delta_product: q `[B, T, H, K]`; k, v `[B, T*num_householder, H, ...]`
    (step j of token t at row t*num_householder + j); g `[B, T, H]` or None; beta `[B, T*n, H]`."""
    # fla's checks, in fla's order and words
    assert q.dtype != torch.float32, "ChunkGatedDeltaProductFunction does not support float32. Please use bfloat16."
    B, T, H, K, V = *q.shape, v.shape[-1]
    n = num_householder
    assert k.shape == (B, T * n, H, K)
    assert v.shape == (B, T * n, H, V)
    assert beta.shape == (B, T * n, H)
    if g is not None:
        assert g.shape == (B, T, H)
    if cp_context is not None:
        assert g is not None, "Non-gated GDP is not supported for CP"
    cu_seqlens = _cp_cu_seqlens(cp_context, initial_state, output_final_state, cu_seqlens)
    _check_varlen(q, cu_seqlens, initial_state)
    if scale is None:
        scale = k.shape[-1] ** -0.5

    o_dtype, state_dtype = q.dtype, _state_dtype(q)
    q, k, v, g, beta = _to_compute(q, k, v, g, beta)
    if cp_context is not None:
        return _context_parallel(q, k, v, g, beta, n, scale, use_qk_l2norm_in_kernel, cp_context).to(o_dtype), None
    check_packing("chunk_gated_delta_product", q, cu_seqlens, name="q")
    o, final_state = reference.gated_delta_product(
        q, k, v, g, beta, n, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm_in_kernel, mode="chunk", compute_dtype=q.dtype,
    )
    if final_state is not None:
        final_state = final_state.to(state_dtype).contiguous()
    return o.to(o_dtype), final_state


def _context_parallel(q, k, v, g, beta, n, scale, use_qk_l2norm, cp_context):
    """This rank's outputs `[1, T_local, H, V]`, the state crossing rank boundaries step by step."""
    from .cp import piece_context

    ctx = piece_context(cp_context)
    T_local = q.shape[1]
    # a token's steps travel with it: k, v, beta as [1, T_local, n, ...] through the relayout
    q, g, k, v, beta = ctx.relayout.to_contiguous(q, g, *(t.unflatten(1, (T_local, n)) for t in (k, v, beta)))
    k, v, beta = (t.flatten(1, 2) for t in (k, v, beta))
    q_steps, g_steps = token_to_steps(q, g, v.shape[2], n, q.dtype)
    # the same contiguous partition, counted in steps: rank r's steps are its tokens' steps
    steps_ctx = parallel_cp.build_context(ctx.cu_seqlens * n, ctx.group)
    o_steps = parallel_cp.delta_rule(q_steps, k, v, g_steps, beta, op="gated_delta_rule", scale=scale,
                                     use_qk_l2norm=use_qk_l2norm, backend="exchange", piece_op=_steps_piece,
                                     cp_context=steps_ctx)
    return ctx.relayout.from_contiguous(last_step(o_steps, n).contiguous())


def _steps_piece(q, k, v, g, beta, **kwargs):
    """One CP rank's piece of the step stream, in the inputs' (compute) dtype."""
    return reference.gated_delta_rule(q, k, v, g, beta, mode="chunk", compute_dtype=q.dtype, **kwargs)


PATCHES = {
    "fla.ops.gated_delta_product.chunk:chunk_gated_delta_product": chunk_gated_delta_product,
}
