"""The op entries on CPU tensors: dispatch to the references, dtype kept, bad variants refused."""

import pytest
import torch
import torch.nn.functional as F

from linattn import kernels, reference

SEED = 1234
CU_SEQLENS = [0, 5, 6, 19]  # three packed sequences, one of them a single token


def rel_err(actual, expected):
    """Relative Frobenius error in float64; NaN or Inf in either tensor never passes."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), "non-finite values"
    return ((actual - expected).norm() / expected.norm()).item()


def conv_inputs(dtype, seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    T, D, W = CU_SEQLENS[-1], 6, 4
    x = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(D, W, generator=gen, dtype=torch.float64) / W
    bias = torch.randn(D, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (x, weight, bias)], torch.tensor(CU_SEQLENS)


def delta_inputs(dtype, per_channel_gate, H=2, HV=4, K=8, V=6, seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    T, N = CU_SEQLENS[-1], len(CU_SEQLENS) - 1
    q = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    gate_shape = (1, T, HV, K) if per_channel_gate else (1, T, HV)
    g = F.logsigmoid(torch.randn(*gate_shape, generator=gen, dtype=torch.float64))
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g, beta, h0)], torch.tensor(CU_SEQLENS)


# ---- short conv ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [None, "torch"])
def test_short_conv_float64_is_the_reference(backend):
    (x, weight, bias), cu = conv_inputs(torch.float64)
    y = kernels.short_conv(x, weight, cu, bias, "silu", backend=backend)
    expected = reference.short_conv(x, weight, cu, bias, "silu")
    assert y.dtype == torch.float64
    assert torch.equal(y, expected)


@pytest.mark.parametrize("activation", ["silu", None])
def test_short_conv_float32_keeps_dtype(activation):
    (x, weight, bias), cu = conv_inputs(torch.float32)
    y = kernels.short_conv(x, weight, cu, bias, activation)
    expected = reference.short_conv(x.double(), weight.double(), cu, bias.double(), activation)
    assert y.dtype == torch.float32
    assert rel_err(y, expected) <= 1e-5


def test_short_conv_bfloat16_keeps_dtype():
    (x, weight, bias), cu = conv_inputs(torch.bfloat16)
    y = kernels.short_conv(x, weight, cu, bias)
    expected = reference.short_conv(x.double(), weight.double(), cu, bias.double())
    assert y.dtype == torch.bfloat16
    assert rel_err(y, expected) <= 1e-2


@pytest.mark.parametrize("backend", ["triton", "mix", "cuda"])
def test_short_conv_gpu_backend_on_cpu_tensor_raises(backend):
    (x, weight, bias), cu = conv_inputs(torch.float32)
    with pytest.raises(ValueError, match="^backend"):
        kernels.short_conv(x, weight, cu, bias, backend=backend)


@pytest.mark.parametrize("backend", ["mix", "cuda"])
@pytest.mark.parametrize("state", ["initial_state", "output_final_state"])
def test_short_conv_stateless_backend_with_a_state_raises(backend, state):
    # fla 0.6.0's "mix" and "cuda" carry no conv state; without a backend named, CUDA tensors
    # with a state take "triton" instead (the GPU suites' state path runs that)
    (x, weight, bias), cu = conv_inputs(torch.float64)
    given = {"initial_state": torch.randn(3, 6, 3, dtype=torch.float64)} if state == "initial_state" else \
        {"output_final_state": True}
    with pytest.raises(ValueError, match=f"^backend '{backend}' carries no conv state"):
        kernels.short_conv(x, weight, cu, bias, backend=backend, **given)


@pytest.mark.parametrize("backend", ["mix", "cuda"])
def test_short_conv_causal_conv1d_backend_past_int32_raises(backend):
    # causal-conv1d's CUDA kernels go wrong past 2**31 elements of x (docs/live-bugs.md); a meta
    # tensor of that size costs nothing, and the refusal comes before any kernel
    x = torch.empty(1, (1 << 18) + 1, 8192, device="meta")
    weight = torch.empty(8192, 4, device="meta")
    with pytest.raises(ValueError, match=rf"^backend '{backend}' runs causal-conv1d's CUDA kernels, wrong past 2\*\*31"):
        kernels.short_conv(x, weight, backend=backend)


def test_short_conv_unknown_backend_raises():
    (x, weight, bias), cu = conv_inputs(torch.float32)
    with pytest.raises(ValueError, match="^backend.*'fast'"):
        kernels.short_conv(x, weight, cu, bias, backend="fast")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_short_conv_step_is_one_more_token_of_the_reference(dtype):
    # each of N sequences: W-1 tokens from the state, then the step's token; the step's output is the
    # reference's last token, its new state the reference's final state
    gen = torch.Generator().manual_seed(3)
    N, D, W = 3, 6, 4
    past, token = torch.randn(N, D, W - 1, generator=gen, dtype=torch.float64), torch.randn(1, N, D, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(D, W, generator=gen, dtype=torch.float64), torch.randn(D, generator=gen, dtype=torch.float64)
    y, state = kernels.short_conv_step(token.to(dtype), weight.to(dtype), past.to(dtype), bias.to(dtype))
    assert y.dtype == state.dtype == dtype and y.shape == (1, N, D) and state.shape == (N, D, W - 1)
    rounded = [t.to(dtype).double() for t in (token, weight, past, bias)]
    ref_y, ref_state = reference.short_conv(rounded[0].transpose(0, 1), rounded[1], None, rounded[3], "silu",
                                            initial_state=rounded[2], output_final_state=True)
    rtol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert ((y.double() - ref_y.transpose(0, 1)).norm() / ref_y.norm()) < rtol
    assert torch.equal(state.double(), ref_state)  # the window moves by one: a copy, exact
    zeros_y, _ = kernels.short_conv_step(token, weight, None, bias)
    y0, _ = kernels.short_conv_step(token, weight, torch.zeros_like(past), bias)
    assert torch.equal(zeros_y, y0)


def test_short_conv_step_refuses_bad_shapes():
    token, weight = torch.randn(1, 2, 4), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"x must be one token per sequence, \[1, N, D\]"):
        kernels.short_conv_step(token[0], weight, None)
    with pytest.raises(ValueError, match=r"state must be \[N, D, W-1\] = \(2, 4, 2\)"):
        kernels.short_conv_step(token, weight, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="weight must be"):
        kernels.short_conv_step(token, torch.randn(5, 3), None)


# ---- gated delta rule and KDA ---------------------------------------------------------------

@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("op, per_channel_gate", [("gated_delta_rule", False), ("kda", True)])
def test_delta_rule_float64_is_the_reference(op, per_channel_gate, use_qk_l2norm):
    (q, k, v, g, beta, h0), cu = delta_inputs(torch.float64, per_channel_gate)
    o, state = getattr(kernels, op)(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    use_qk_l2norm=use_qk_l2norm)
    o_ref, state_ref = getattr(reference, op)(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, mode="chunk",
        use_qk_l2norm=use_qk_l2norm,
    )
    assert o.dtype == torch.float64
    assert torch.equal(o, o_ref) and torch.equal(state, state_ref)


@pytest.mark.parametrize("op, per_channel_gate", [("gated_delta_rule", False), ("kda", True)])
def test_delta_rule_float32_keeps_dtype(op, per_channel_gate):
    (q, k, v, g, beta, h0), cu = delta_inputs(torch.float32, per_channel_gate)
    o, state = getattr(kernels, op)(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    as64 = [t.double() for t in (q, k, v, g, beta, h0)]
    o_ref, state_ref = getattr(reference, op)(*as64[:5], initial_state=as64[5], output_final_state=True, cu_seqlens=cu)
    assert o.dtype == torch.float32
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(state, state_ref) <= 1e-5


@pytest.mark.parametrize("H, HV, use_qk_l2norm", [(2, 2, False), (2, 4, False), (2, 4, True)])
def test_gdn_kda_route_matches_gdn_with_gradients(H, HV, use_qk_l2norm):
    # the route fla needs on Hopper: GDN as KDA with the gate broadcast over K, q/k repeated
    (q, k, v, g, beta, h0), cu = delta_inputs(torch.float64, False, H=H, HV=HV)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, h0)]
    common = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm)
    o_ref, s_ref = reference.gated_delta_rule(*inputs[:5], **common)
    o, s = kernels.gated_delta_rule(*inputs[:5], **common, route="kda")
    gen = torch.Generator().manual_seed(SEED + 1)
    do, ds = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(s.shape, generator=gen, dtype=torch.float64)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), inputs)
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), inputs)
    assert rel_err(o, o_ref) <= 1e-10
    assert rel_err(s, s_ref) <= 1e-10
    for name, grad, grad_ref in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_ref):
        assert grad.shape == grad_ref.shape, name
        assert rel_err(grad, grad_ref) <= 1e-10, name


@pytest.mark.parametrize("route", ["fast", "recurrent", ""])
def test_gdn_bad_route_raises(route):
    (q, k, v, g, beta, _), cu = delta_inputs(torch.float32, False)
    with pytest.raises(ValueError, match="^route"):
        kernels.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, route=route)


def test_kda_route_other_than_kda_raises():
    (q, k, v, g, beta, _), cu = delta_inputs(torch.float32, True)
    with pytest.raises(ValueError, match="^route"):
        kernels.kda(q, k, v, g, beta, cu_seqlens=cu, route="gated_delta_rule")


@pytest.mark.parametrize("op, per_channel_gate", [("gated_delta_rule", True), ("kda", False)])
def test_wrong_gate_shape_raises(op, per_channel_gate):
    (q, k, v, g, beta, _), cu = delta_inputs(torch.float32, per_channel_gate)
    with pytest.raises(ValueError, match="^g must have shape"):
        getattr(kernels, op)(q, k, v, g, beta, cu_seqlens=cu)


def test_wrong_initial_state_count_raises():
    (q, k, v, g, beta, h0), cu = delta_inputs(torch.float32, False)
    with pytest.raises(ValueError, match="^initial_state"):
        kernels.gated_delta_rule(q, k, v, g, beta, initial_state=h0[:1], cu_seqlens=cu)


# ---- in-kernel gate and beta (fla's use_gate_in_kernel / use_beta_sigmoid_in_kernel) ------------

@pytest.mark.parametrize("op, lower_bound", [("gated_delta_rule", None), ("kda", None), ("kda", -5.0)])
def test_gate_in_kernel_is_the_precomputed_gate(op, lower_bound):
    per_channel = op == "kda"
    (q, k, v, raw, logits, _), cu = delta_inputs(torch.float64, per_channel)
    gen = torch.Generator().manual_seed(SEED + 1)
    HV, K = v.shape[2], q.shape[3]
    A_log = torch.rand(HV, generator=gen, dtype=torch.float64).mul(3).log1p()
    dt_bias = torch.randn(HV * K if per_channel else HV, generator=gen, dtype=torch.float64)
    gate = dict(A_log=A_log, dt_bias=dt_bias) if lower_bound is None else dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    fn = getattr(kernels, op)
    fused, _ = fn(q, k, v, raw, logits, cu_seqlens=cu, use_qk_l2norm=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, **gate)
    g = kernels.log_decay(raw, A_log, dt_bias, lower_bound)
    separate, _ = fn(q, k, v, g, torch.sigmoid(logits), cu_seqlens=cu, use_qk_l2norm=True)
    assert torch.equal(fused, separate)
    # the decay itself, written out
    shape = (HV, K) if per_channel else (HV,)
    rate = A_log.exp().view(-1, 1) if per_channel else A_log.exp()
    pre = raw + dt_bias.view(shape)
    expected = -rate * F.softplus(pre) if lower_bound is None else lower_bound * torch.sigmoid(rate * pre)
    assert torch.equal(g, expected)
    if lower_bound is not None:
        assert (g >= lower_bound).all() and (g < 0).all()


def test_log_decay_computes_in_at_least_float32():
    raw = torch.randn(1, 5, 3, dtype=torch.bfloat16)
    A_log = torch.zeros(3, dtype=torch.bfloat16)
    assert kernels.log_decay(raw, A_log).dtype == torch.float32


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_gate_arguments_refused_without_gate_in_kernel(op):
    (q, k, v, g, beta, _), cu = delta_inputs(torch.float64, op == "kda")
    with pytest.raises(ValueError, match="A_log is read only with use_gate_in_kernel=True"):
        getattr(kernels, op)(q, k, v, g, beta, cu_seqlens=cu, A_log=torch.zeros(v.shape[2]))
    with pytest.raises(ValueError, match="A_log must be a tensor of HV=4 elements"):
        getattr(kernels, op)(q, k, v, g, beta, cu_seqlens=cu, use_gate_in_kernel=True, A_log=torch.zeros(3))


# ---- gated RMSNorm -------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm_torch(activation):
    gen = torch.Generator().manual_seed(SEED)
    x, gate = (torch.randn(1, 7, 3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.rand(8, generator=gen, dtype=torch.float64) + 0.5
    y = kernels.gated_rms_norm(x, gate, weight, 1e-6, activation)
    act = F.silu(gate) if activation == "silu" else torch.sigmoid(gate)
    expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight * act
    assert rel_err(y, expected) <= 1e-14
    assert kernels.gated_rms_norm(x.bfloat16(), gate.bfloat16(), weight.bfloat16(), 1e-6, activation).dtype == torch.bfloat16


def test_gated_rms_norm_refuses_bad_arguments():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="backend must be None or one of"):
        kernels.gated_rms_norm(x, x, torch.ones(4), 1e-6, "silu", backend="triton")
    with pytest.raises(ValueError, match="backend 'fla' runs fla's GPU kernel and needs CUDA tensors"):
        kernels.gated_rms_norm(x, x, torch.ones(4), 1e-6, "silu", backend="fla")
    with pytest.raises(ValueError, match="activation must be one of"):
        kernels.gated_rms_norm(x, x, torch.ones(4), 1e-6, "relu")


# ---- float32 linear ------------------------------------------------------------------------

def test_float32_linear_torch_is_the_upcast_linear():
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, 5, 8, generator=gen).bfloat16()
    weight = torch.randn(3, 8, generator=gen).bfloat16()
    y = kernels.float32_linear(x, weight)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x.float(), weight.float()))
    assert kernels.float32_linear(x.double(), weight).dtype == torch.float64


def test_float32_linear_torch_adds_the_bias_before_rounding_once():
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, 64, 16, generator=gen)
    weight = torch.randn(32, 16, generator=gen).bfloat16()
    bias = torch.randn(32, generator=gen) * 4
    y = kernels.float32_linear(x, weight, bias=bias, round_to=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (F.linear(x, weight.float()) + bias).bfloat16())
    assert torch.equal(kernels.float32_linear(x, weight, bias=bias), F.linear(x, weight.float(), bias))


def test_bf16_split_folds_the_bias_into_one_bf16_matmul():
    # the arithmetic of bf16_split's fused gate on a CPU (the entry runs it on CUDA only): the
    # float32 input's hi and lo parts and the bias's three bf16 parts against columns of ones, one
    # float32 accumulation, one rounding; so it is the exact sum rounded once, but where the
    # split's error (about 2^-16 of the product) crosses a rounding boundary
    from linattn.kernels._linear import _mm_with_bias_to_bf16, _parts

    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(512, 128, generator=gen)
    weight = (torch.randn(256, 128, generator=gen) / 128 ** 0.5).bfloat16()
    bias = torch.randn(256, generator=gen) * 4  # dt_bias-like: most of the product cancels
    y = _mm_with_bias_to_bf16(_parts(x), [weight.t()], bias)
    exact = x.double() @ weight.double().T + bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == (512, 256)
    assert (y == exact.bfloat16()).double().mean() > 0.99
    assert rel_err(y, exact) < 2 ** -8


def test_float32_linear_refuses_bad_arguments():
    x, weight = torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="backend 'bf16_split' needs CUDA tensors"):
        kernels.float32_linear(x, weight, "bf16_split")
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.float32_linear(x, weight, "tf32")
    with pytest.raises(ValueError, match=r"weight must be \[out, 4\]"):
        kernels.float32_linear(x, torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"bias must be None or \[3\], got shape \(4,\)"):
        kernels.float32_linear(x, weight, bias=torch.randn(4))
    with pytest.raises(ValueError, match="round_to must be None or a floating dtype, got torch.int32"):
        kernels.float32_linear(x, weight, round_to=torch.int32)


def test_conv_sequence_ids_built_once_per_boundaries_tensor():
    # causal-conv1d's seq_idx (the "cuda" and "mix" backends): one tensor per cu_seqlens tensor, so a
    # layer's three convs share it and a step allocates none; a changed or new tensor gets its own
    from linattn.kernels import _short_conv

    cu = torch.tensor([0, 2, 5, 6])
    ids = _short_conv._int32_sequence_ids(cu, 6)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 0, 1, 1, 1, 2]]
    assert _short_conv._int32_sequence_ids(cu, 6) is ids
    other = torch.tensor([0, 3, 6])
    assert _short_conv._int32_sequence_ids(other, 6).tolist() == [[0, 0, 0, 1, 1, 1]]
    cu[1] = 1  # changed in place: its _version moved on
    assert _short_conv._int32_sequence_ids(cu, 6).tolist() == [[0, 1, 1, 1, 1, 2]]
    key = id(other)
    del other
    assert key not in _short_conv._SEQUENCE_IDS
