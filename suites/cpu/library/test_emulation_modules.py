"""linattn.emulation's conv, norm and cp modules: fla's short convolution, gated norms and CP
context, against direct float64 formulas and linattn.reference, with gradchecks, the switch's
swap and restore, refusals (CP 2/4: test_emulation_cp.py)."""

import pytest
import torch
import torch.nn.functional as F

from linattn.emulation import conv, cp as emulation_cp, fla_on_cpu, norm
from linattn.reference import short_conv
from pytest_linattn import assert_parity

F64 = torch.float64
RTOL = 1e-12
D, W = 3, 4
CU = torch.tensor([0, 1, 6, 9])  # a length-1 sequence, one longer than W, one shorter


def _randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _direct_conv(x, weight, bias, activation, cu, initial_state=None):
    """y[t] = act(bias + sum_s weight[:, W-1-s] * z[t-s]), z = the cache's last W-1 slots then the sequence."""
    W_ = weight.shape[1]
    out = torch.empty_like(x)
    bounds = cu.tolist()
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        history = initial_state[n, :, 1:].T if initial_state is not None else x.new_zeros(W_ - 1, x.shape[2])
        z = torch.cat([history, x[0, a:b]])
        for t in range(b - a):
            window = z[t: t + W_]  # [W, D], oldest first
            y = (window.T * weight).sum(1) + (bias if bias is not None else 0)
            out[0, a + t] = F.silu(y) if activation else y
    return out


def _direct_final_state(x, W_, cu, initial_state=None):
    bounds = cu.tolist()
    states = []
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        before = initial_state[n] if initial_state is not None else x.new_zeros(x.shape[2], W_)
        states.append(torch.cat([before, x[0, a:b].T], dim=1)[:, -W_:])
    return torch.stack(states)


# ------------------------------------------------------------------------------------------
# causal_conv1d, its decode step, ShortConvolution


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_matches_reference(activation, with_bias):
    gen = torch.Generator().manual_seed(11 + with_bias)
    T, N = int(CU[-1]), CU.numel() - 1
    x, weight = _randn(gen, 1, T, D), _randn(gen, D, W)
    bias = _randn(gen, D) if with_bias else None
    cache, residual = _randn(gen, N, D, W), _randn(gen, 1, T, D)

    y, state = conv.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=CU)
    assert state is None
    assert_parity(y, short_conv(x, weight, CU, bias, activation), rtol=RTOL, name="y", cu_seqlens=CU)

    for backend in conv.BACKENDS:
        y, state = conv.causal_conv1d(x, weight, bias, residual, cache, True, activation, backend, cu_seqlens=CU)
        expected = _direct_conv(x, weight, bias, activation, CU, cache) + residual
        assert state.shape == (N, D, W) and state.dtype == x.dtype
        assert_parity(y, expected, rtol=RTOL, name=f"{backend}/y with cache", cu_seqlens=CU)
        assert_parity(state, _direct_final_state(x, W, CU, cache), rtol=RTOL, name="final state")
    _, state = conv.causal_conv1d(x, weight, bias, output_final_state=True, activation=activation, cu_seqlens=CU)
    assert_parity(state, _direct_final_state(x, W, CU), rtol=RTOL, name="final state without cache")


def test_causal_conv1d_batched_heads_and_dtype():
    gen = torch.Generator().manual_seed(5)
    B, T, H, K = 2, 5, 2, 2
    x, weight, cache = _randn(gen, B, T, H, K), _randn(gen, H * K, W), _randn(gen, B, H * K, W)
    y, state = conv.causal_conv1d(x, weight, initial_state=cache, output_final_state=True, activation="silu")
    assert y.shape == x.shape
    flat = x.flatten(2)
    for b in range(B):
        cu = torch.tensor([0, T])
        expected = _direct_conv(flat[b: b + 1], weight, None, "silu", cu, cache[b: b + 1])
        assert_parity(y[b: b + 1].flatten(2), expected, rtol=RTOL, name=f"batch {b}")
        assert_parity(state[b: b + 1], _direct_final_state(flat[b: b + 1], W, cu, cache[b: b + 1]), rtol=RTOL,
                      name="state")
    y32, state32 = conv.causal_conv1d(x.float(), weight.float(), initial_state=cache.float(), output_final_state=True)
    assert y32.dtype == state32.dtype == torch.float32


def test_causal_conv1d_gradcheck_with_cache():
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 1, 4])
    W_ = 3
    inputs = [_randn(gen, *s).requires_grad_() for s in ((1, 4, 2), (2, W_), (2,), (1, 4, 2), (2, 2, W_))]

    def f(x, weight, bias, residual, cache):
        return conv.causal_conv1d(x, weight, bias, residual, cache, True, "silu", cu_seqlens=cu)

    assert torch.autograd.gradcheck(f, inputs)
    y, state = f(*inputs)
    (y.sum() + state.sum()).backward()
    assert inputs[4].grad[:, :, 1:].abs().sum() > 0  # the cache's used slots get gradient


def test_causal_conv1d_update_shifts_cache_in_place():
    gen = torch.Generator().manual_seed(4)
    N = 3
    x, weight, bias, cache, residual = (_randn(gen, N, D), _randn(gen, D, W), _randn(gen, D), _randn(gen, N, D, W),
                                        _randn(gen, N, D))
    old = cache.clone()
    y, out_cache = conv.causal_conv1d_update(x.unsqueeze(1), cache, residual.unsqueeze(1), weight, bias, "silu")
    assert out_cache is cache and y.shape == (N, 1, D)
    window = torch.cat([old[:, :, 1:], x.unsqueeze(-1)], dim=-1)
    assert_parity(cache, window, rtol=RTOL, name="cache")
    assert_parity(y[:, 0], F.silu((window * weight).sum(-1) + bias) + residual, rtol=RTOL, name="y")


def test_short_convolution_through_the_switch():
    import fla.modules
    from fla.modules.causal_conv1d import ops

    originals = (ops.ShortConvolution.forward, ops.ShortConvolution.step, ops.causal_conv1d, ops.causal_conv1d_update)
    gen = torch.Generator().manual_seed(6)
    T, N = int(CU[-1]), CU.numel() - 1
    x, cache = _randn(gen, 1, T, D), _randn(gen, N, D, W)
    with fla_on_cpu():
        import fla.modules.convolution as alias

        patched = conv.PATCHES
        assert alias.causal_conv1d is patched["fla.modules.causal_conv1d.ops:causal_conv1d"]
        assert alias.causal_conv1d_update is patched["fla.modules.causal_conv1d.ops:causal_conv1d_update"]
        layer = fla.modules.ShortConvolution(D, W, bias=True, activation="silu", dtype=F64)
        with torch.no_grad():
            layer.weight.copy_(_randn(gen, D, 1, W))
            layer.bias.copy_(_randn(gen, D))
        y, state = layer(x, cache=cache, output_final_state=True, cu_seqlens=CU)
        weight = layer.weight[:, 0].detach()
        assert_parity(y, _direct_conv(x, weight, layer.bias.detach(), "silu", CU, cache), rtol=RTOL, name="y",
                      cu_seqlens=CU)
        y.sum().backward()
        assert layer.weight.grad is not None and layer.bias.grad is not None  # the module's own parameters
        # decode: autograd off, one token per sequence -> step, the cache updated in place
        token, step_cache = _randn(gen, N, 1, D), state.detach().clone()
        with torch.no_grad():
            y_step, new_cache = layer(token, cache=step_cache, output_final_state=True)
            y_full, _ = conv.causal_conv1d(token, weight, layer.bias, initial_state=state.detach(), activation="silu")
        assert new_cache is step_cache
        assert_parity(y_step, y_full, rtol=RTOL, name="step")
    assert (ops.ShortConvolution.forward, ops.ShortConvolution.step, ops.causal_conv1d,
            ops.causal_conv1d_update) == originals
    assert alias.causal_conv1d is ops.causal_conv1d


# ------------------------------------------------------------------------------------------
# gated norms


def _direct_norm(x, g, weight, bias, activation, residual, eps, is_rms):
    h = x + residual if residual is not None else x
    if is_rms:
        h_hat = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    else:
        mu = h.mean(-1, keepdim=True)
        h_hat = (h - mu) / torch.sqrt(((h - mu) ** 2).mean(-1, keepdim=True) + eps)
    y = h_hat * (weight if weight is not None else 1) + (bias if bias is not None else 0)
    return (y * g * torch.sigmoid(g) if activation != "sigmoid" else y * torch.sigmoid(g)), h


@pytest.mark.parametrize("is_rms", [True, False])
@pytest.mark.parametrize("activation", ["swish", "silu", "sigmoid"])
def test_gated_norms_match_formula(is_rms, activation):
    gen = torch.Generator().manual_seed(21 + is_rms)
    fn = norm.rms_norm_gated if is_rms else norm.layer_norm_gated
    x, g, residual = _randn(gen, 2, 3, 5), _randn(gen, 2, 3, 5), _randn(gen, 2, 3, 5)
    for weight, bias in ((None, None), (_randn(gen, 5), None), (_randn(gen, 5), _randn(gen, 5))):
        y = fn(x, g, weight, bias, activation, eps=1e-5)
        expected, _ = _direct_norm(x, g, weight, bias, activation, None, 1e-5, is_rms)
        assert_parity(y, expected, rtol=RTOL, name="y")
        y, res = fn(x, g, weight, bias, activation, residual=residual, prenorm=True, eps=1e-5)
        expected, h = _direct_norm(x, g, weight, bias, activation, residual, 1e-5, is_rms)
        assert_parity({"y": y, "residual_out": res}, {"y": expected, "residual_out": h}, rtol=RTOL, name="prenorm")
    # residual stream: x itself without residual; float32 with residual_in_fp32
    _, res = fn(x, g, None, None, activation, prenorm=True)
    assert torch.equal(res, x)
    xb = x.to(torch.bfloat16)
    y, res = fn(xb, g.to(torch.bfloat16), None, None, activation, prenorm=True, residual_in_fp32=True)
    assert y.dtype == torch.bfloat16 and res.dtype == torch.float32


@pytest.mark.parametrize("is_rms", [True, False])
def test_gate_linear_matches_formula(is_rms):
    gen = torch.Generator().manual_seed(31)
    fn = norm.rms_norm_swish_gate_linear if is_rms else norm.layer_norm_swish_gate_linear
    x, g, residual = _randn(gen, 4, 5), _randn(gen, 4, 5), _randn(gen, 4, 5)
    nw, nb, lw, lb = _randn(gen, 5), _randn(gen, 5), _randn(gen, 2, 5), _randn(gen, 2)
    out, res = fn(x, g, nw, nb, lw, lb, residual=residual, prenorm=True)
    y, h = _direct_norm(x, g, nw, nb, "swish", residual, 1e-6, is_rms)
    assert_parity({"out": out, "res": res}, {"out": y @ lw.T + lb, "res": h}, rtol=RTOL, name="gate linear")


def test_gated_norm_gradcheck():
    gen = torch.Generator().manual_seed(41)
    inputs = [_randn(gen, *s).requires_grad_() for s in ((3, 4), (3, 4), (4,), (4,), (3, 4))]

    def f(x, g, weight, bias, residual):
        y, res = norm.layer_norm_gated(x, g, weight, bias, "swish", residual, prenorm=True)
        y2 = norm.rms_norm_gated(x, g, weight, None, "sigmoid")
        return y, res, y2

    assert torch.autograd.gradcheck(f, inputs)


def test_fused_norm_modules_through_the_switch():
    import fla.modules
    from fla.modules.norm import fused_norm_gate as fng

    originals = (fng.FusedRMSNormGated.forward, fng.rms_norm_gated)
    gen = torch.Generator().manual_seed(51)
    x, g = _randn(gen, 2, 3, 4, dtype=torch.bfloat16), _randn(gen, 2, 3, 4, dtype=torch.bfloat16)
    with fla_on_cpu():
        for cls, activation in ((fla.modules.FusedRMSNormGated, "sigmoid"), (fla.modules.FusedRMSNormSwishGate, "swish")):
            layer = cls(4, eps=1e-5, **({"activation": activation} if activation == "sigmoid" else {}))
            y = layer(x, g)
            assert y.dtype == torch.bfloat16
            expected, _ = _direct_norm(x.to(F64), g.to(F64), None, None, activation, None, 1e-5, True)
            assert_parity(y, expected, rtol=1e-2, name=cls.__name__)
        layer = fla.modules.FusedLayerNormGated(4, bias=True)
        assert layer(x, g).dtype == torch.bfloat16
    assert (fng.FusedRMSNormGated.forward, fng.rms_norm_gated) == originals


# ------------------------------------------------------------------------------------------
# refusals


def test_conv_seq_idx_beside_cu_seqlens_is_accepted():
    # what the project's layers pass fla's "cuda" and "mix" backends (kernels._short_conv)
    from linattn.kernels._short_conv import _int32_sequence_ids

    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(1, 9, D, generator=gen, dtype=F64), torch.randn(D, W, generator=gen, dtype=F64)
    cu = torch.tensor([0, 4, 4, 9])  # an empty sequence too
    plain, _ = conv.causal_conv1d(x, weight, cu_seqlens=cu, backend="cuda")
    with_ids, _ = conv.causal_conv1d(x, weight, cu_seqlens=cu, backend="cuda", seq_idx=_int32_sequence_ids(cu, 9))
    assert torch.equal(plain, with_ids)


@pytest.mark.parametrize("call, match", [
    (lambda: conv.causal_conv1d(torch.ones(1, 2, D), torch.ones(D, W), activation="relu"),
     r"causal_conv1d\(activation='relu'\)"),
    (lambda: conv.causal_conv1d(torch.ones(1, 2, D), None), r"causal_conv1d\(weight=None\)"),
    (lambda: conv.causal_conv1d(torch.ones(1, 2, D), torch.ones(D, W), seq_idx=torch.zeros(1, 2)),
     r"causal_conv1d\(seq_idx='<tensor>'\) is emulated only beside cu_seqlens"),
    (lambda: conv.causal_conv1d(torch.ones(1, 3, D), torch.ones(D, W), cu_seqlens=torch.tensor([0, 1, 3]),
                                seq_idx=torch.zeros(1, 3, dtype=torch.int32)),
     r"causal_conv1d\(seq_idx='<tensor>'\) differs from cu_seqlens' per-token sequence index \[\[0, 1, 1\]\]"),
    (lambda: conv.causal_conv1d_update(torch.ones(2, D), None, weight=torch.ones(D, W)),
     r"causal_conv1d_update\(cache=None\)"),
    (lambda: norm.rms_norm_gated(torch.ones(2, 3), torch.ones(2, 3), None, None, "tanh"),
     r"rms_norm_gated\(activation='tanh'\)"),
    (lambda: norm.layer_norm_swish_gate_linear(torch.ones(2, 3), torch.ones(2, 3), None, None, None, None),
     r"layer_norm_swish_gate_linear\(linear_weight=None\)"),
    (lambda: emulation_cp.piece_context(type("Ctx", (), {"group": None})()), r"cp_context\(group=None\)"),
])
def test_unsupported_values_raise(call, match):
    with pytest.raises(NotImplementedError, match=match):
        call()


@pytest.mark.parametrize("with_state", [True, False], ids=["initial-state", "no-state"])
def test_conv_cu_seqlens_not_ending_at_the_token_count_is_refused_naming_both(with_state):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 21, 16, generator=gen, dtype=F64)
    w = torch.randn(16, 4, generator=gen, dtype=F64)
    h0 = torch.randn(2, 16, 4, generator=gen, dtype=F64) if with_state else None
    with pytest.raises(ValueError, match=r"causal_conv1d: cu_seqlens\[-1\] = 23 must equal T = 21, the token count "
                                         r"of x \(1, 21, 16\)"):
        conv.causal_conv1d(x, w, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor([0, 10, 23]))
