"""What fla 0.6.0's emulated delta-rule ops share: their options, checked in fla's words, and the run
on linattn's references.

The ops (``gated_delta_rule``: GDN's, ``kda``: KDA's) keep fla's signature (names, order, defaults,
``**kwargs``), raise what fla raises for bad option combinations, and return what fla returns:
``(o, final_state)`` with o in q's dtype (v's for the fused_recurrent ops, as fla allocates it) and
the state in float32, or float64 for float64 inputs. Inputs are cast to ``compute_dtype()`` and the
``chunk_*`` ops run the reference's chunked form, the ``fused_recurrent_*`` ops its token-by-token
form (both exact), so gradients reach every differentiable input, including those fla's
fused_recurrent ops do not differentiate.

In-kernel options, applied to the inputs before the recurrence as fla's kernels do per token:
``use_gate_in_kernel`` (each op module gives its gate), ``use_beta_sigmoid_in_kernel`` (times 2
with ``allow_neg_eigval``), ``use_qk_l2norm_in_kernel``. ``state_v_first`` states are ``[V, K]``.
``cp_context=`` (from the emulated ``build_cp_context``) runs the chunk ops over
``linattn.parallel.cp.delta_rule``, which passes the state rank to rank.

Accepted without effect on the result (exact math does not depend on them): ``chunk_size``,
``safe_gate`` (a promise that the gates lie in ``[lower_bound, 0)``: checked when the gate is
given precomputed), ``disable_recompute``, ``use_graph`` / ``max_num_seqs``, ``cu_seqlens_cpu``,
``chunk_indices``. Refused (NotImplementedError via ``refuse``): ``return_intermediate_states=True``,
``gv``, a beta per value channel, and the KDA gate with neither A_log nor lower_bound in
fused_recurrent_kda and fused_kda_gate (fla's kernels then take exp(1) for exp(A_log)).

The other emulated delta-rule families (``gdn2``, ``delta_product``, ``precond``, ``dplr``,
``serving``) take their checks, casts and refusals from here too.
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
# the run: the recurrence on the reference, and the inputs' dtypes, gates and beta on the way in


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
    return _in_fla_state_layout(
        lambda state: op(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, mode=mode, compute_dtype=q.dtype),
        initial_state, state_v_first, o_dtype, state_dtype)


def _in_fla_state_layout(run, initial_state, state_v_first, o_dtype, state_dtype):
    """run(initial_state) -> (o, final_state) on the references' `[N, HV, K, V]` states, in fla's
    layout on the way in and out (`[.., V, K]` with state_v_first) and fla's dtypes on the way out."""
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, final_state = run(initial_state)
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


# ----------------------------------------------------------------------------------------------
# fla's checks in fla's words and the emulation's refusals


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
