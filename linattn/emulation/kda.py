"""fla 0.6.0's Kimi delta attention (KDA) ops and its gate, computed with linattn's references.

    chunk_kda, fused_recurrent_kda, fused_kda_gate

g is a log decay per key channel, or with ``use_gate_in_kernel`` the raw pre-activation, turned per
token as fla's kernels do into ``-exp(A_log) softplus(g + dt_bias)`` per key channel, or
``lower_bound * sigmoid(exp(A_log) (g + dt_bias))`` when ``lower_bound`` is set (without the
``exp(A_log)`` factor when A_log is None). ``safe_gate`` promises gates in ``[lower_bound, 0)``:
checked when the gate is given precomputed. Refused: ``return_intermediate_states=True``, a beta
per value channel, and the gate with neither A_log nor lower_bound in fused_recurrent_kda and
fused_kda_gate (fla's kernels then take exp(1) for exp(A_log); chunk_kda raises, as fla's does).
What every emulated delta-rule op keeps of fla's (signature, errors, returned dtypes, the other
in-kernel options, CP, the options accepted without effect) is in ``delta_rule_options``.
"""

from __future__ import annotations

import torch

from linattn import reference
from linattn.kernels import log_decay

from .delta_rule_options import (
    _beta,
    _check_beta_options,
    _check_cp,
    _check_initial_state_dtype,
    _check_safe_gate_bound,
    _gate_dtype,
    _per_channel_gate,
    _refuse_beta_per_value_channel,
    _refuse_gate_without_A_log,
    _refuse_intermediate_states,
    _refuse_pool_arguments,
    _require_gate_A_log,
    _run,
    _state_dtype,
    _state_v_first,
    _to_compute,
)
from .patching import refuse


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """fla's chunk_kda: g `[B, T, HV, K]`; A_log `[HV]` and dt_bias `[HV*K]` come in kwargs."""
    function = "chunk_kda"
    state_v_first = _state_v_first(state_v_first, kwargs)
    _refuse_intermediate_states(function, return_intermediate_states)
    _check_cp(cp_context, initial_state, output_final_state)
    if use_graph and cu_seqlens is not None and cp_context is None:
        num_seqs = cu_seqlens.shape[0] - 1
        assert max_num_seqs is None or num_seqs == max_num_seqs, (
            f"cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 entries, "
            f"got {num_seqs} sequences with max_num_seqs={max_num_seqs}")
    _check_initial_state_dtype(initial_state, q)
    A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
    _require_gate_A_log(use_gate_in_kernel, A_log, lower_bound)
    chunk_size = kwargs.get("chunk_size", 64)  # no effect on exact math, checked as fla does
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    _check_safe_gate_bound(safe_gate, use_gate_in_kernel, lower_bound)
    _check_beta_options(allow_neg_eigval, use_beta_sigmoid_in_kernel)

    o_dtype, state_dtype = q.dtype, _state_dtype(q)
    q, k, v, g, beta, A_log, dt_bias = _to_compute(q, k, v, g, beta, A_log, dt_bias)
    g = _per_channel_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run(reference.kda, "chunk", q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, cp_context, o_dtype, state_dtype,
                "chunk_kda")


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """fla's fused_recurrent_kda (its other kwargs, as in fla, are not read; the pool's refused)."""
    function = "fused_recurrent_kda"
    _refuse_pool_arguments(function, kwargs, "fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd takes it")
    state_v_first = _state_v_first(state_v_first, kwargs)
    _refuse_beta_per_value_channel(function, beta, v)
    _refuse_gate_without_A_log(function, use_gate_in_kernel, A_log, lower_bound)
    _check_beta_options(allow_neg_eigval, use_beta_sigmoid_in_kernel)

    o_dtype, state_dtype = v.dtype, _state_dtype(q)
    q, k, v, g, beta, A_log, dt_bias = _to_compute(q, k, v, g, beta, A_log, dt_bias)
    g = _per_channel_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run(reference.kda, "recurrent", q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, state_v_first, cu_seqlens, None, o_dtype, state_dtype,
                "fused_recurrent_kda")


def fused_kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fla's fused_kda_gate: the KDA log decay of g `[..., H, K]`, in output_dtype (float64 when g
    is float64 and output_dtype float32: fla's float32 is its internal precision)."""
    if A_log is None and lower_bound is None:  # fla's kernel then takes exp(1) for exp(A_log)
        refuse("fused_kda_gate", "A_log", None, why="without lower_bound is not emulated")
    out_dtype = _gate_dtype(g, output_dtype)
    return log_decay(*_to_compute(g, A_log, dt_bias), lower_bound, per_channel=True).to(out_dtype)


PATCHES = {
    "fla.ops.kda.chunk:chunk_kda": chunk_kda,
    "fla.ops.kda.fused_recurrent:fused_recurrent_kda": fused_recurrent_kda,
    "fla.ops.kda.gate:fused_kda_gate": fused_kda_gate,
}
