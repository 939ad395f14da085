"""``backend="fla"`` of the CP ops: fla 0.6.0's own context parallelism, imported on first use.

fla facts this relies on (fla 0.6.0, ``fla/ops/cp``):

- ``fla.ops.cp.build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None,
  layout="contiguous")`` takes the GLOBAL cu_seqlens and returns an ``FLACPContext`` with the
  rank's local cu_seqlens and chain metadata. Its ``"zigzag"`` cuts the whole packed batch, so
  the ops here always pass the contiguous layout (they work on the contiguous piece).
- ``chunk_gated_delta_rule`` / ``chunk_kda`` accept ``cp_context=``: they then take cu_seqlens
  from the context, refuse ``initial_state``/``output_final_state``, and compose the incoming
  state from an all-gather of every rank's affine state map (TF32x3 on Ampere+).
- ``fla.modules.causal_conv1d.causal_conv1d(..., cp_context=)`` takes the previous rank's last
  ``W-1`` tokens (all-gather) as the first sequence's initial state and returns their gradient in
  backward; it handles only one previous rank, so it needs every piece to hold at least ``W-1``
  tokens.
"""

from __future__ import annotations

import weakref

import torch

from linattn import kernels, selection
from linattn.checks import require

__all__ = ["delta_rule", "fla_context", "short_conv"]

# CPContext -> {(conv1d_kernel_size, device): fla's context of its piece}
_FLA_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fla_context(ctx, conv1d_kernel_size: int | None = None, device=None):
    """The fla CP context of ``ctx``'s contiguous piece, built once per context and key."""
    require(ctx.group is not None, "cp_context", "has no process group (None: no CP); backend='fla' needs one")
    contexts = _FLA_CONTEXTS.setdefault(ctx, {})
    key = (conv1d_kernel_size, str(device))
    if key not in contexts:
        from fla.ops.cp import build_cp_context

        contexts[key] = build_cp_context(
            ctx.cu_seqlens.to(device=device, dtype=torch.int32), group=ctx.group,
            conv1d_kernel_size=conv1d_kernel_size, cu_seqlens_cpu=ctx.cu_seqlens, layout="contiguous",
        )
    return contexts[key]


def short_conv(x, weight, bias, activation, *, cp_context):
    """fla's CP causal conv on the contiguous piece ``x`` ``[1, T_local, D]``; weight ``[D, W]``."""
    W = weight.shape[-1]
    require(cp_context.local_tokens >= W - 1, "backend",
            f"'fla' needs every piece to hold at least W-1={W - 1} tokens, got {cp_context.local_tokens}")
    fctx = fla_context(cp_context, conv1d_kernel_size=W, device=x.device)
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(
        x, weight=weight.reshape(weight.shape[0], W).to(x.dtype), bias=None if bias is None else bias.to(x.dtype),
        activation=activation,
        backend="triton", cp_context=fctx,
    )
    return y


def delta_rule(q, k, v, g, beta, *, op: str, scale, use_qk_l2norm, cp_context):
    """fla's chunk kernel with its CP context on the contiguous piece.

    The gated delta rule takes the route `linattn.selection.gdn_route()` picks, as the
    single-GPU entry does: where fla refuses its backward (Hopper, Triton in [3.4.0, 3.7.1)) it
    runs as chunk_kda with the gate broadcast over the key channels."""
    fctx = fla_context(cp_context, device=q.device)
    if op == "gated_delta_rule" and selection.gdn_route() == "kda":
        q, k, g = kernels.gdn_as_kda_inputs(q, k, v, g)
        op = "kda"
    if op == "gated_delta_rule":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                      cp_context=fctx)
    else:
        from fla.ops.kda import chunk_kda

        selection.kda_tilelang_setting()  # FLA_TILELANG must be in force before fla dispatches
        o, _ = chunk_kda(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                         use_gate_in_kernel=False, cp_context=fctx)
    return o.to(q.dtype)
