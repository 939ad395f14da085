"""Gated delta rule and Kimi delta attention: one entry each, variants as parameters.

On CPU tensors both run linattn.reference in the input's dtype (chunked form). On CUDA tensors
they run fla 0.6.0: `chunk_gated_delta_rule`, or for the "kda" route `chunk_kda` with the
per-head gate broadcast over the key channels (GDN is KDA with a gate constant across K), and
`chunk_kda` for KDA; with mode="recurrent" (a decode step, forward only) their `fused_recurrent_*`
kernels. Shapes follow fla: q, k `[B, T, H, K]`; v `[B, T, HV, V]` with HV a
multiple of H; g `[B, T, HV]` (GDN) or `[B, T, HV, K]` (KDA); beta `[B, T, HV]`;
initial_state `[N, HV, K, V]`. Returns (o `[B, T, HV, V]` in q's dtype, final state or None).

head_pairing (linattn.heads): which key head each value head reads. The references index it
directly; fla's kernels know the grouped pairing only, so for a tiled layer on CUDA the value-head
tensors (v, g, beta, the states, A_log and dt_bias of the in-kernel gate) move into grouped order
before the kernel and its outputs back after it.
"""

import torch
import torch.nn.functional as F

from linattn import selection
from linattn.checks import fail, require, wants_grad
from linattn.heads import check_head_pairing, from_grouped, to_grouped

from ._norm import at_least_float32

ROUTES = selection.GDN_ROUTES
MODES = ("chunk", "recurrent")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    route: str | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    mode: str = "chunk",
    head_pairing: str = "grouped",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """route None: for CUDA tensors `selection.gdn_route(needs_backward)`, else "gated_delta_rule".

    use_gate_in_kernel: g is the raw gate input and the kernel computes the log decay
    `-exp(A_log) * softplus(g + dt_bias)` (A_log, dt_bias `[HV]`); use_beta_sigmoid_in_kernel:
    beta holds logits. Both as fla's chunk_gated_delta_rule; on CPU tensors computed in at least
    float32 before the reference, on the "kda" route before the gate is broadcast.

    mode: "chunk" (the chunked form, every prefill) or "recurrent" (token by token, the decode
    step's form: on CUDA fla's fused_recurrent kernels, forward only, no host synchronisation, so
    a CUDA graph can capture a decode step). head_pairing: the module docstring's.
    """
    if not (route is None or route in ROUTES):
        fail("route", f"must be None or one of {ROUTES}, got {route!r}")
    _check_mode(mode, q, k, v, g, beta, initial_state, A_log, dt_bias)
    validate_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel_gate=False)
    _validate_gate_args(g, use_gate_in_kernel, A_log, dt_bias, None, per_channel_gate=False)
    check_head_pairing(head_pairing)
    if head_pairing != "grouped" and q.is_cuda and v.shape[2] != q.shape[2]:
        return _grouped_around(gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state,
                               cu_seqlens, use_qk_l2norm, route=route, use_gate_in_kernel=use_gate_in_kernel,
                               A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                               mode=mode, head_pairing=head_pairing)
    if route is None:
        needs_backward = wants_grad(q, k, v, g, beta, A_log, dt_bias)
        route = selection.gdn_route(needs_backward) if q.is_cuda else "gated_delta_rule"
    args = (scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm)
    if q.is_cuda and route == "gated_delta_rule":
        return _gated_delta_rule_fla(q, k, v, g, beta, *args, use_gate_in_kernel, A_log, dt_bias,
                                     use_beta_sigmoid_in_kernel, mode)
    if use_gate_in_kernel:
        g = log_decay(g, A_log, dt_bias)
    if route == "kda":
        q, k, g = gdn_as_kda_inputs(q, k, v, g, head_pairing)
        return kda(q, k, v, g, beta, *args, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, mode=mode)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(at_least_float32(beta))
    return _run_reference("gated_delta_rule", q, k, v, g, beta, *args, mode, head_pairing)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    route: str | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    mode: str = "chunk",
    head_pairing: str = "grouped",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """g is a per-channel log decay, or with use_gate_in_kernel the raw gate input, from which the
    kernel computes `-exp(A_log) * softplus(g + dt_bias)` or, with lower_bound,
    `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` (A_log `[HV]`, dt_bias `[HV * K]`);
    use_beta_sigmoid_in_kernel: beta holds logits. Both as fla's chunk_kda; on CPU tensors computed
    in at least float32 before the reference. route: None or "kda" only. mode, head_pairing: as
    gated_delta_rule's."""
    if route not in (None, "kda"):
        fail("route", f"must be None or 'kda' for KDA, got {route!r}")
    _check_mode(mode, q, k, v, g, beta, initial_state, A_log, dt_bias)
    validate_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel_gate=True)
    _validate_gate_args(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, per_channel_gate=True)
    check_head_pairing(head_pairing)
    if head_pairing != "grouped" and q.is_cuda and v.shape[2] != q.shape[2]:
        return _grouped_around(kda, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm, route=route, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                               dt_bias=dt_bias, lower_bound=lower_bound,
                               use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, mode=mode,
                               head_pairing=head_pairing)
    args = (scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm)
    if q.is_cuda:
        return _kda_fla(q, k, v, g, beta, *args, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                        use_beta_sigmoid_in_kernel, mode)
    if use_gate_in_kernel:
        g = log_decay(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(at_least_float32(beta))
    return _run_reference("kda", q, k, v, g, beta, *args, mode, head_pairing)


def log_decay(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None = None,
              lower_bound: float | None = None, *, per_channel: bool | None = None) -> torch.Tensor:
    """The log decay from the raw gate input g, in at least float32, as fla's in-kernel gate.

    GDN (g `[..., HV]`, A_log and dt_bias `[HV]`): `-exp(A_log) * softplus(g + dt_bias)`.
    KDA (g `[..., HV, K]`, A_log `[HV]`, dt_bias `[HV * K]`): the same per key channel, or with
    lower_bound `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`, in [lower_bound, 0); A_log
    may then be None (fla: `lower_bound * sigmoid(g + dt_bias)`). per_channel None: KDA when g is
    4-D (the entries' `[B, T, HV, K]`).
    """
    per_channel = g.dim() == 4 if per_channel is None else per_channel
    require(A_log is not None or lower_bound is not None, "A_log", "must be given unless lower_bound is")
    g = at_least_float32(g)
    shape = g.shape[-2:] if per_channel else g.shape[-1:]
    if dt_bias is not None:
        g = g + at_least_float32(dt_bias).reshape(shape)
    if A_log is not None:
        rate = at_least_float32(A_log).exp()
        rate = rate.reshape(-1, 1) if per_channel else rate.reshape(-1)
    if lower_bound is None:
        return -rate * F.softplus(g)
    return lower_bound * torch.sigmoid(g if A_log is None else rate * g)


def _validate_gate_args(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, per_channel_gate):
    if not use_gate_in_kernel:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            require(value is None, name, "is read only with use_gate_in_kernel=True; pass None otherwise")
        return
    HV = g.shape[2]
    if not (isinstance(A_log, torch.Tensor) and A_log.numel() == HV):
        fail("A_log", f"must be a tensor of HV={HV} elements with use_gate_in_kernel=True, got {getattr(A_log, 'shape', A_log)!r}")
    bias_numel = HV * g.shape[3] if per_channel_gate else HV
    if not (dt_bias is None or dt_bias.numel() == bias_numel):
        fail("dt_bias", f"must be None or a tensor of {bias_numel} elements, got {getattr(dt_bias, 'shape', dt_bias)!r}")
    if not (lower_bound is None or lower_bound < 0):
        fail("lower_bound", f"must be None or negative, got {lower_bound!r}")


def gdn_as_kda_inputs(q, k, v, g, head_pairing="grouped"):
    """q, k repeated to HV heads and g broadcast to `[B, T, HV, K]`; autograd sums the gradients back.

    fla maps value head i to key head i // (HV // H) (e.g. fla/ops/kda/chunk_intra.py), so the
    repeat is repeat_interleave, as fla/ops/kda/naive.py does; a tiled pairing (i % H) repeats
    the H key heads whole.
    """
    group = v.shape[2] // q.shape[2]
    if group > 1 and check_head_pairing(head_pairing) == "tiled":
        q, k = q.repeat(1, 1, group, 1), k.repeat(1, 1, group, 1)
    elif group > 1:
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1]).contiguous()
    return q, k, g


def validate_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens, per_channel_gate):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        require(isinstance(t, torch.Tensor) and t.is_floating_point(), name, "must be a floating-point tensor")
        if t.device != q.device:
            fail(name, f"must be on q's device {q.device}, got {t.device}")
    if q.dim() != 4:
        fail("q", f"must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        fail("k", f"must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    B, T, H, K = q.shape
    if not (v.dim() == 4 and v.shape[:2] == (B, T)):
        fail("v", f"must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        fail("v", f"must have a head count HV that is a multiple of H={H}, got HV={HV}")
    gate_shape = (B, T, HV, K) if per_channel_gate else (B, T, HV)
    if tuple(g.shape) != gate_shape:
        fail("g", f"must have shape {gate_shape}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        fail("beta", f"must have shape {(B, T, HV)}, got {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if not (cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2):
            fail("cu_seqlens", f"must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            fail("q", f"must have batch size 1 when cu_seqlens is given, got {B}")
    if initial_state is not None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if tuple(initial_state.shape) != (N, HV, K, V):
            fail("initial_state", f"must have shape {(N, HV, K, V)} (one state per sequence), got {tuple(initial_state.shape)}")


def _check_mode(mode, q, *tensors):
    if mode not in MODES:
        fail("mode", f"must be one of {MODES}, got {mode!r}")
    if mode == "recurrent" and q.is_cuda and wants_grad(q, *tensors):
        raise NotImplementedError("mode='recurrent' on CUDA runs fla 0.6.0's fused_recurrent kernels, which have no "
                                  "backward: run it under torch.no_grad() (a decode step), or use mode='chunk'")


def _run_reference(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                   mode="chunk", head_pairing="grouped"):
    from linattn import reference

    # the reference computes in float32 or float64; half-precision inputs compute in float32
    compute_dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    o, final_state = getattr(reference, op)(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
        compute_dtype=compute_dtype,
        mode=mode,
        head_pairing=head_pairing,
    )
    return o.to(q.dtype), final_state


def _grouped_around(entry, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                    *, head_pairing, A_log=None, dt_bias=None, **options):
    """`entry` (gated_delta_rule or kda) on a layer whose value heads pair as `head_pairing`, run by
    a kernel that knows the grouped pairing only: every value-head tensor moved into grouped order
    before it, the output and the final state back after it (autograd carries the gradients)."""
    H, HV = q.shape[2], v.shape[2]

    def grouped(t, dim=2):
        return None if t is None else to_grouped(t, H, HV, head_pairing, dim)

    dt_bias = None if dt_bias is None else grouped(dt_bias.reshape(-1), 0)  # KDA's: HV blocks of K
    o, final_state = entry(q, k, grouped(v), grouped(g), grouped(beta), scale, grouped(initial_state, 1),
                           output_final_state, cu_seqlens, use_qk_l2norm, A_log=grouped(A_log, 0), dt_bias=dt_bias,
                           head_pairing="grouped", **options)
    o = from_grouped(o, H, HV, head_pairing, 2)
    return o, (None if final_state is None else from_grouped(final_state, H, HV, head_pairing, 1))


def _fla_state_args(q, initial_state, cu_seqlens):
    # fla keeps recurrent states in float32 (chunk_kda asserts it) and wants long cu_seqlens.
    # The calls pass state_v_first=True, as fla's own layers do (its kernels run faster with the
    # state stored [V, K]); the entries' states stay [N, HV, K, V], transposed in and out.
    if initial_state is not None:
        initial_state = initial_state.float().transpose(-1, -2)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    return initial_state, cu_seqlens


def _gate_kwargs(use_gate_in_kernel, A_log, dt_bias):
    # as given, as fla's layers pass them: its gate kernels load them to float32 and return their
    # gradients summed in float32, rounded to their dtype once (no float32 copies per call)
    if not use_gate_in_kernel:
        return {}
    return dict(use_gate_in_kernel=True, A_log=A_log.reshape(-1),
                dt_bias=None if dt_bias is None else dt_bias.reshape(-1))


def _gated_delta_rule_fla(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                          use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                          mode="chunk"):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    initial_state, cu_seqlens = _fla_state_args(q, initial_state, cu_seqlens)
    entry = chunk_gated_delta_rule if mode == "chunk" else fused_recurrent_gated_delta_rule
    o, final_state = entry(
        q, k, v, g, beta=beta,  # by name: fused_recurrent's fifth parameter is gk
        scale=scale,
        state_v_first=True,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        cu_seqlens=cu_seqlens,
        **_gate_kwargs(use_gate_in_kernel, A_log, dt_bias),
    )
    return o.to(q.dtype), _state_k_first(final_state)


def _state_k_first(final_state):
    return None if final_state is None else final_state.transpose(-1, -2)


def _kda_fla(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False,
             mode="chunk"):
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    selection.kda_tilelang_setting()  # FLA_TILELANG must be in force before fla dispatches
    initial_state, cu_seqlens = _fla_state_args(q, initial_state, cu_seqlens)
    entry = chunk_kda if mode == "chunk" else fused_recurrent_kda
    o, final_state = entry(
        q, k, v, g, beta,
        scale=scale,
        state_v_first=True,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        lower_bound=lower_bound,
        cu_seqlens=cu_seqlens,
        **_gate_kwargs(use_gate_in_kernel, A_log, dt_bias),
    )
    return o.to(q.dtype), _state_k_first(final_state)
