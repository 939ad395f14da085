"""fla 0.6.0's gated delta rule (GDN) ops and its gate, computed with linattn's references.

    chunk_gated_delta_rule (= chunk_gdn), fused_recurrent_gated_delta_rule (= fused_recurrent_gdn),
    fused_gdn_gate

g is a log decay per value head, or with ``use_gate_in_kernel`` the raw pre-activation, turned into
``-exp(A_log) softplus(g + dt_bias)`` per token as fla's kernels do. fused_recurrent_gated_delta_rule
also takes ``gk``, a log decay per key channel added to the head's; it refuses ``gv`` (a decay per
value channel) and a beta per value channel. What every emulated delta-rule op keeps of fla's
(signature, errors, returned dtypes, the other in-kernel options, CP, the options accepted without
effect) is in ``delta_rule_options``.
"""

from __future__ import annotations

import torch

from linattn import reference
from linattn.kernels import log_decay

from .delta_rule_options import (
    _beta,
    _check_beta_options,
    _check_cp,
    _gate_dtype,
    _refuse_beta_per_value_channel,
    _refuse_gv,
    _refuse_head_first,
    _refuse_pool_arguments,
    _run,
    _state_dtype,
    _state_v_first,
    _to_compute,
)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
):
    """fla's chunk_gated_delta_rule: g `[B, T, HV]` (log decay, or raw with use_gate_in_kernel)."""
    state_v_first = _state_v_first(state_v_first, kwargs)
    _refuse_head_first(kwargs)
    chunk_size = kwargs.get("chunk_size", 64)  # no effect on exact math, checked as fla does
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    use_gate_in_kernel = kwargs.get("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if use_gate_in_kernel:
        assert A_log is not None, "A_log must be provided when use_gate_in_kernel=True."
    _check_beta_options(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    _check_cp(cp_context, initial_state, output_final_state)

    o_dtype, state_dtype = q.dtype, _state_dtype(q)
    q, k, v, g, beta, A_log, dt_bias = _to_compute(q, k, v, g, beta, A_log, dt_bias)
    if use_gate_in_kernel:
        g = log_decay(g, A_log, dt_bias, per_channel=False)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run(reference.gated_delta_rule, "chunk", q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, cp_context, o_dtype, state_dtype,
                "chunk_gated_delta_rule")


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """fla's fused_recurrent_gated_delta_rule: decay exp(g) per head (g None: none) times exp(gk)
    per key channel (gk `[B, T, HV, K]`, optional); beta None means 1."""
    function = "fused_recurrent_gated_delta_rule"
    _refuse_pool_arguments(function, kwargs, "fla 0.6.0 has no GDN state pool")
    state_v_first = _state_v_first(state_v_first, kwargs)
    _refuse_gv(function, gv)
    _refuse_beta_per_value_channel(function, beta, v)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
    _check_beta_options(allow_neg_eigval, use_beta_sigmoid_in_kernel)

    o_dtype, state_dtype = v.dtype, _state_dtype(q)
    q, k, v, g, gk, beta, A_log, dt_bias = _to_compute(q, k, v, g, gk, beta, A_log, dt_bias)
    if beta is None:  # one per value head (fla's ones_like(q[..., 0]) has the key heads' count)
        beta = v.new_ones(v.shape[:3])
    if use_gate_in_kernel:
        g = log_decay(g, A_log, dt_bias, per_channel=False)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if gk is None:
        op, decay = reference.gated_delta_rule, (g if g is not None else v.new_zeros(v.shape[:3]))
    else:  # the head's decay and the channels' multiply: one per-channel log decay
        op, decay = reference.kda, (gk if g is None else gk + g.unsqueeze(-1))
    return _run(op, "recurrent", q, k, v, decay, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, None, o_dtype, state_dtype,
                "fused_recurrent_gated_delta_rule")


def fused_gdn_gate(
    g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fla's fused_gdn_gate: -exp(A_log) softplus(g + dt_bias) for g `[..., HV]` (dtype as fused_kda_gate)."""
    out_dtype = _gate_dtype(g, output_dtype)
    return log_decay(*_to_compute(g, A_log, dt_bias), per_channel=False).to(out_dtype)


PATCHES = {
    "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule": chunk_gated_delta_rule,  # chunk_gdn too
    "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule":
        fused_recurrent_gated_delta_rule,
    "fla.ops.gated_delta_rule.gate:fused_gdn_gate": fused_gdn_gate,
}
