"""fla 0.6.0's delta-rule ops, their gates and l2norm, computed with linattn's references.

    chunk_gated_delta_rule (= chunk_gdn), fused_recurrent_gated_delta_rule (= fused_recurrent_gdn),
    chunk_kda, fused_recurrent_kda, fused_kda_gate, fused_gdn_gate, l2norm (= l2_norm; L2Norm
    calls it)

Each keeps fla's signature (names, order, defaults, ``**kwargs``), raises what fla raises for bad
option combinations, and returns what fla returns: ``(o, final_state)`` with o in q's dtype (v's
for the fused_recurrent ops, as fla allocates it) and the state in float32, or float64 for
float64 inputs. Inputs are cast to ``compute_dtype()`` and the ``chunk_*`` ops run the
reference's chunked form, the ``fused_recurrent_*`` ops its token-by-token form (both exact), so
gradients reach every differentiable input, including those fla's fused_recurrent ops do not
differentiate.

In-kernel options, applied to the inputs before the recurrence as fla's kernels do per token:
``use_gate_in_kernel`` (GDN: ``-exp(A_log) softplus(g + dt_bias)``; KDA: the same per key
channel, or ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))`` when ``lower_bound`` is set,
without the ``exp(A_log)`` factor when A_log is None), ``use_beta_sigmoid_in_kernel`` (times 2
with ``allow_neg_eigval``), ``use_qk_l2norm_in_kernel``. ``state_v_first`` states are ``[V, K]``.
``cp_context=`` (from the emulated ``build_cp_context``) runs the chunk ops over
``linattn.parallel.cp.delta_rule``, which passes the state rank to rank.

Accepted without effect on the result (exact math does not depend on them): ``chunk_size``,
``safe_gate`` (a promise that the gates lie in ``[lower_bound, 0)``: checked when the gate is
given precomputed), ``disable_recompute``, ``use_graph`` / ``max_num_seqs``, ``cu_seqlens_cpu``,
``chunk_indices``. Refused (NotImplementedError via ``refuse``): ``return_intermediate_states=True``,
``gv``, a beta per value channel, and the KDA gate with neither A_log nor lower_bound in
fused_recurrent_kda and fused_kda_gate (fla's kernels then take exp(1) for exp(A_log)).
"""

from __future__ import annotations

import warnings

import torch

from linattn import reference
from linattn.kernels import log_decay
from linattn.parallel import cp as parallel_cp

from .patching import check_packing, compute_dtype, refuse

SAFE_GATE_LOWEST = -5.0  # fla's safe range for bounded gates is [-5, 0)
MAX_KEY_DIM = 256  # fla's KDA-family chunk kernels (GDN-2, preconditioned KDA) take key heads of at most 256 channels


# ----------------------------------------------------------------------------------------------
# the ops


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


def fused_gdn_gate(
    g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fla's fused_gdn_gate: -exp(A_log) softplus(g + dt_bias) for g `[..., HV]` (dtype as fused_kda_gate)."""
    out_dtype = _gate_dtype(g, output_dtype)
    return log_decay(*_to_compute(g, A_log, dt_bias), per_channel=False).to(out_dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x²) + eps) over the last dim, in output_dtype (None: x's)."""
    (y,) = _to_compute(x)
    y = y * torch.rsqrt((y * y).sum(-1, keepdim=True) + eps)
    return y.to(x.dtype if output_dtype is None else output_dtype)


# ----------------------------------------------------------------------------------------------
# shared option handling: fla's checks in fla's words and the emulation's refusals, for every
# emulated delta-rule family (gdn2, delta_product, precond, dplr and serving import them)


def _run(op, mode, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
         state_v_first, cu_seqlens, cp_context, o_dtype, state_dtype, function):
    """The recurrence on inputs already in the compute dtype, gates and beta applied; fla's returns."""
    if cp_context is None:  # under CP cu_seqlens is the whole batch's, q this rank's piece
        check_packing(function, q, cu_seqlens, name="q")
    if cp_context is not None:
        from .cp import piece_context

        ctx = piece_context(cp_context)
        name = "kda" if op is reference.kda else "gated_delta_rule"
        piece_op = _chunk_kda_piece if op is reference.kda else _chunk_gated_delta_rule_piece
        o = parallel_cp.delta_rule(*ctx.relayout.to_contiguous(q, k, v, g, beta), op=name, scale=scale,
                                   use_qk_l2norm=use_qk_l2norm, backend="exchange", piece_op=piece_op, cp_context=ctx)
        return ctx.relayout.from_contiguous(o).to(o_dtype), None
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, final_state = op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                        use_qk_l2norm=use_qk_l2norm, mode=mode, compute_dtype=q.dtype)
    if final_state is not None:
        if state_v_first:
            final_state = final_state.transpose(-1, -2)
        final_state = final_state.to(state_dtype).contiguous()
    return o.to(o_dtype), final_state


def _chunk_kda_piece(q, k, v, g, beta, **kwargs):
    """One CP rank's piece for linattn.parallel.cp.delta_rule, in the inputs' (compute) dtype."""
    return reference.kda(q, k, v, g, beta, mode="chunk", compute_dtype=q.dtype, **kwargs)


def _chunk_gated_delta_rule_piece(q, k, v, g, beta, **kwargs):
    return reference.gated_delta_rule(q, k, v, g, beta, mode="chunk", compute_dtype=q.dtype, **kwargs)


def _to_compute(*tensors):
    dtype = compute_dtype()
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _state_dtype(q):
    """fla keeps recurrent states in float32; float64 runs keep them in float64."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _gate_dtype(g, output_dtype):
    return torch.float64 if g.dtype == torch.float64 and output_dtype == torch.float32 else output_dtype


def _beta(beta, use_sigmoid, allow_neg_eigval):
    if not use_sigmoid:
        return beta
    return torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)


def _per_channel_gate(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate=False):
    """KDA's log decay per key channel, inputs in the compute dtype: fla's in-kernel gate from the raw
    g, or g as given (checked against its promised bound with safe_gate)."""
    if use_gate_in_kernel:
        return log_decay(g, A_log, dt_bias, lower_bound, per_channel=True)
    if safe_gate:
        _check_bounded_gate(g, lower_bound)
    return g


def _check_bounded_gate(g, lower_bound):
    """safe_gate with a precomputed gate: fla's kernels assume log decays in [lower_bound, 0)."""
    lowest = SAFE_GATE_LOWEST if lower_bound is None else lower_bound
    if g.numel() and not (g.min() >= lowest and g.max() <= 0):
        raise ValueError(f"g must lie in [{lowest}, 0] with safe_gate=True (fla's kernels assume it), "
                         f"got values in [{g.min().item():.3g}, {g.max().item():.3g}]")


def _check_beta_options(allow_neg_eigval, use_beta_sigmoid_in_kernel):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")


def _check_safe_gate_bound(safe_gate, use_gate_in_kernel, lower_bound):
    """fla's checks of lower_bound when the in-kernel gate promises safe_gate."""
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not (SAFE_GATE_LOWEST <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")


def _require_gate_A_log(use_gate_in_kernel, A_log, lower_bound):
    """The chunk entries' check, in fla's words: the in-kernel gate needs A_log unless lower_bound is set."""
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")


def _refuse_gate_without_A_log(function, use_gate_in_kernel, A_log, lower_bound):
    """The fused_recurrent entries' case of it: fla's kernel then takes exp(1) for exp(A_log), where
    the chunk entries raise."""
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        refuse(function, "A_log", None, why="with use_gate_in_kernel=True and no lower_bound is not emulated")


def _check_initial_state_dtype(initial_state, q):
    if initial_state is not None:  # fla asserts float32; float64 runs keep float64 states
        assert initial_state.dtype in (torch.float32, _state_dtype(q)), "initial_state must be in float32."


def _check_cp(cp_context, initial_state, output_final_state):
    if cp_context is not None:  # fla's assertions
        assert initial_state is None, "Initial state is not supported for CP"
        assert output_final_state is False, "Output final state is not supported for CP"


def _cp_cu_seqlens(cp_context, initial_state, output_final_state, cu_seqlens):
    """The cu_seqlens a call packs by: under CP the context's, the whole batch's (fla's checks first)."""
    if cp_context is None:
        return cu_seqlens
    _check_cp(cp_context, initial_state, output_final_state)
    assert cp_context.cu_seqlens is not None, "cu_seqlens is required for CP"
    return cp_context.cu_seqlens


def _check_varlen(q, cu_seqlens, initial_state, sentence_gap=""):
    """fla's checks of a packed call, in its words. fla joins the batch message's two sentences
    with a space in some entries and with none in others: sentence_gap keeps each entry's."""
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.{sentence_gap}"
            f"Please flatten variable-length inputs before processing.")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            f"The number of initial states is expected to be equal to the number of input sequences, "
            f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")


def _refuse_head_first(kwargs):
    if "head_first" in kwargs:  # fla raises it, it does not warn
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")


def _state_v_first(state_v_first, kwargs):
    """fla's deprecated alias transpose_state_layout."""
    if "transpose_state_layout" not in kwargs:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                  DeprecationWarning, stacklevel=3)
    return kwargs.pop("transpose_state_layout")


def _refuse_pool_arguments(function, kwargs, where):
    """The state-pool arguments: fla's public entry drops them into **kwargs (a pool call that ran
    as one without indices)."""
    for name in ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state"):
        if name in kwargs:
            refuse(function, name, type(kwargs[name]).__name__, why=f"is not emulated: fla 0.6.0's {function} "
                   f"does not pass it to its kernel (it lands in **kwargs, unread); {where}")


def _refuse_beta_per_value_channel(function, beta, v):
    if beta is not None and beta.dim() == v.dim():
        refuse(function, "beta", f"tensor of shape {tuple(beta.shape)}",
               why="(a beta per value channel) is not emulated")


def _refuse_gv(function, gv):
    if gv is not None:
        refuse(function, "gv", f"tensor of shape {tuple(gv.shape)}", why="(a decay per value channel) is not emulated")


def _refuse_intermediate_states(function, return_intermediate_states):
    if return_intermediate_states:
        refuse(function, "return_intermediate_states", return_intermediate_states,
               why="(per-chunk states for inference) is not emulated")


PATCHES = {
    "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule": chunk_gated_delta_rule,  # chunk_gdn too
    "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule":
        fused_recurrent_gated_delta_rule,
    "fla.ops.kda.chunk:chunk_kda": chunk_kda,
    "fla.ops.kda.fused_recurrent:fused_recurrent_kda": fused_recurrent_kda,
    "fla.ops.kda.gate:fused_kda_gate": fused_kda_gate,
    "fla.ops.gated_delta_rule.gate:fused_gdn_gate": fused_gdn_gate,
    "fla.modules.norm.l2norm:l2norm": l2norm,  # l2_norm too; L2Norm.forward calls it
}
