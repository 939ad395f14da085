"""linattn.reference: chunk vs recurrent, packing, dtypes, fla's naive oracles, short conv, input rules."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn.reference import delta_rule, gated_delta_rule, kda, short_conv
from linattn.checks import validate_cu_seqlens

F64 = torch.float64


def rel_error(actual, ref):
    """‖actual − ref‖ / ‖ref‖; NaN/Inf never passes, the worst element is named on failure."""
    assert torch.isfinite(actual).all(), "actual has NaN/Inf"
    assert torch.isfinite(ref).all(), "reference has NaN/Inf"
    assert ref.norm() > 0, "reference is all zeros: the comparison could not fail"
    return ((actual.to(F64) - ref.to(F64)).norm() / ref.to(F64).norm()).item()


def assert_close(actual, ref, tol, what):
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    err = rel_error(actual, ref)
    if not err <= tol:
        worst = torch.unravel_index((actual.to(F64) - ref.to(F64)).abs().argmax(), ref.shape)
        pytest.fail(f"{what}: relative error {err:.3e} > {tol:.0e}, worst at index {tuple(int(i) for i in worst)}")


def delta_inputs(seed, B, T, H, HV, K, V, per_channel, strong=0, N=None, normalize_keys=True):
    """Fresh random q, k, v, g, beta, initial_state in float64; keys unit-norm unless the op normalizes them."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, HV, V)
    if normalize_keys:
        k = F.normalize(k, dim=-1)
    gate_shape = (B, T, HV, K) if per_channel else (B, T, HV)
    if strong:  # KDA-like gates: log decay uniform in (-strong, 0), -5 per token by default
        g = -float(strong) * torch.rand(*gate_shape, generator=gen, dtype=F64)
    else:
        g = F.logsigmoid(rand(*gate_shape))
    beta = torch.rand(B, T, HV, generator=gen, dtype=F64)
    h0 = rand(B if N is None else N, HV, K, V)
    return q, k, v, g, beta, h0


def run_with_grads(op, inputs, seed, **kwargs):
    """Forward, then backward of a random projection of (o, final_state); returns o, S, grads."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    o, S = op(*inputs[:5], initial_state=inputs[5], output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    wo = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ws = torch.randn(S.shape, generator=gen, dtype=S.dtype)
    grads = torch.autograd.grad((o * wo).sum() + (S * ws).sum(), inputs)
    return o, S, grads


CASES = [
    # (op, H, HV, batch, T or packed lengths, strongest log decay per token (0: logsigmoid), use_qk_l2norm)
    pytest.param(gated_delta_rule, 2, 2, 2, 100, 0, False, id="gdn-hv=h-T100"),
    pytest.param(gated_delta_rule, 2, 4, 1, [70, 1, 64, 29], 0, True, id="gdn-hv=2h-packed-l2norm"),
    pytest.param(gated_delta_rule, 1, 3, 1, 130, 5, False, id="gdn-hv=3h-T130-strong"),
    pytest.param(kda, 2, 2, 2, 100, 5, False, id="kda-hv=h-T100-strong"),
    pytest.param(kda, 2, 4, 1, [1, 65, 40], 0, True, id="kda-hv=2h-packed-l2norm"),
    pytest.param(kda, 1, 3, 1, [33, 1, 96], 5, False, id="kda-hv=3h-packed-strong"),
    # exp(-cumulative decay) over a chunk would overflow even float64 here: the chunk form must not form it
    pytest.param(kda, 1, 1, 1, 64, 30, False, id="kda-extreme-decay-30"),
    pytest.param(gated_delta_rule, 1, 1, 1, 64, 30, False, id="gdn-extreme-decay-30"),
]


@pytest.mark.parametrize("op, H, HV, B, T, strong, l2norm", CASES)
@pytest.mark.parametrize("one_chunk_groups", [False, True], ids=["grouped", "chunk-per-group"])
def test_chunk_matches_recurrent(op, H, HV, B, T, strong, l2norm, one_chunk_groups, monkeypatch):
    if one_chunk_groups:  # every chunk its own group: the state must cross group boundaries intact
        monkeypatch.setattr(delta_rule, "GROUP_BYTES", 1)
    seed = 1000 + 7 * H + HV + (len(T) if isinstance(T, list) else T)
    cu = None
    if isinstance(T, list):
        cu = torch.tensor([0] + torch.tensor(T).cumsum(0).tolist())
        N, T = len(T), sum(T)
    else:
        N = B
    inputs = delta_inputs(seed, B, T, H, HV, 16, 12, op is kda, strong, N=N, normalize_keys=not l2norm)
    chunk = run_with_grads(op, inputs, seed, cu_seqlens=cu, use_qk_l2norm=l2norm, mode="chunk")
    recurrent = run_with_grads(op, inputs, seed, cu_seqlens=cu, use_qk_l2norm=l2norm, mode="recurrent")
    assert_close(chunk[0], recurrent[0], 1e-12, "o")
    assert_close(chunk[1], recurrent[1], 1e-12, "final_state")
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), chunk[2], recurrent[2]):
        assert_close(a, r, 1e-12, name)


@pytest.mark.parametrize("op", [gated_delta_rule, kda], ids=["gdn", "kda"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_equals_each_sequence_alone(op, mode):
    lengths = [37, 1, 0, 90]  # includes a length-1 and an empty sequence
    cu = torch.tensor([0, 37, 38, 38, 128])
    q, k, v, g, beta, h0 = delta_inputs(21, 1, 128, 2, 4, 8, 8, op is kda, N=4)
    o, S = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, mode=mode)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if lengths[n] == 0:
            assert torch.equal(S[n], h0[n]), "an empty sequence must hand back its initial state"
            continue
        piece = [x[:, bos:eos] for x in (q, k, v, g, beta)]
        o_n, S_n = op(*piece, initial_state=h0[n:n + 1], output_final_state=True, mode=mode)
        assert_close(o[:, bos:eos], o_n, 1e-12, f"o of sequence {n}")
        assert_close(S[n:n + 1], S_n, 1e-12, f"final_state of sequence {n}")


def test_gdn_equals_kda_with_channel_constant_decay():
    # GDN's scalar-decay path against KDA's per-channel path (and GVA grouping of both)
    q, k, v, g, beta, h0 = delta_inputs(5, 1, 150, 2, 6, 16, 8, per_channel=False, N=1)
    o1, S1 = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, S2 = kda(q, k, v, g[..., None].expand(-1, -1, -1, 16), beta, initial_state=h0, output_final_state=True)
    assert_close(o1, o2, 1e-12, "o")
    assert_close(S1, S2, 1e-12, "final_state")


@pytest.mark.parametrize("op", [gated_delta_rule, kda], ids=["gdn", "kda"])
def test_use_qk_l2norm_is_fla_l2norm(op):
    # fla's l2norm_fwd: x / sqrt(sum(x²) + 1e-6); small inputs make the eps visible
    q, k, v, g, beta, h0 = delta_inputs(6, 1, 70, 2, 2, 16, 8, op is kda, normalize_keys=False)
    q, k = q * 1e-3, k * 1e-3
    ref_norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    o, _ = op(q, k, v, g, beta, use_qk_l2norm=True)
    o_ref, _ = op(ref_norm(q), ref_norm(k), v, g, beta)
    o_unit, _ = op(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, beta)
    assert_close(o, o_ref, 1e-12, "o")
    assert rel_error(o, o_unit) > 1e-3, "eps-free normalization should differ at this scale"


def test_default_scale_is_inverse_sqrt_k():
    q, k, v, g, beta, _ = delta_inputs(8, 1, 20, 1, 1, 16, 8, per_channel=False)
    o_default, _ = gated_delta_rule(q, k, v, g, beta)
    o_explicit, _ = gated_delta_rule(q, k, v, g, beta, scale=16 ** -0.5)
    o_other, _ = gated_delta_rule(q, k, v, g, beta, scale=1.0)
    assert torch.equal(o_default, o_explicit)
    assert rel_error(o_other, o_default) > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_is_float64_for_low_precision_input(dtype):
    q, k, v, g, beta, h0 = delta_inputs(9, 1, 40, 2, 2, 8, 8, per_channel=True)
    low = [x.to(dtype) for x in (q, k, v, g, beta, h0)]
    o, S = kda(*low[:5], initial_state=low[5], output_final_state=True)
    o64, S64 = kda(*(x.to(F64) for x in low[:5]), initial_state=low[5].to(F64), output_final_state=True)
    assert o.dtype == S.dtype == F64
    assert torch.equal(o, o64) and torch.equal(S, S64)
    o, _ = gated_delta_rule(*(x.to(dtype) for x in (q, k, v, g[..., 0], beta)))
    assert o.dtype == F64
    x, w = torch.randn(2, 10, 6, dtype=dtype), torch.randn(6, 4, dtype=dtype)
    y = short_conv(x, w)
    assert y.dtype == F64 and torch.equal(y, short_conv(x.to(F64), w.to(F64)))


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_compute_dtype_float32(mode):
    cu = torch.tensor([0, 50, 51, 120])
    for op in (gated_delta_rule, kda):
        q, k, v, g, beta, h0 = delta_inputs(10, 1, 120, 2, 4, 16, 8, op is kda, strong=5 if op is kda else 0, N=3)
        o64, S64 = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, mode=mode)
        o32, S32 = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, mode=mode,
                      compute_dtype=torch.float32)
        assert o32.dtype == S32.dtype == torch.float32
        assert_close(o32, o64, 1e-5, f"{op.__name__} o")
        assert_close(S32, S64, 1e-5, f"{op.__name__} final_state")
    x, w, b = torch.randn(1, 120, 6, dtype=F64), torch.randn(6, 4, dtype=F64), torch.randn(6, dtype=F64)
    y32 = short_conv(x, w, cu, b, compute_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert_close(y32, short_conv(x, w, cu, b), 1e-5, "short_conv")


# ---- oracle: fla's naive references (float32), single sequences -----------------------------

@pytest.fixture(scope="module")
def fla_naive():
    with warnings.catch_warnings():  # fla warns that Triton cannot run on a CPU: its naive refs do not need it
        warnings.simplefilter("ignore")
        pytest.importorskip("fla", reason="fla-core not installed (pip install -e .[test])")
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
    return dict(gdn_recurrent=naive_recurrent_gated_delta_rule, gdn_chunk=naive_chunk_gated_delta_rule,
                kda_recurrent=naive_recurrent_kda, kda_chunk=naive_chunk_kda)


@pytest.mark.parametrize("naive", ["recurrent", "chunk"])
def test_gdn_matches_fla_naive(fla_naive, naive):
    # fla's naive GDN has no GVA (HV = H); GVA grouping is checked through KDA's naive below
    q, k, v, g, beta, h0 = (x.float() for x in delta_inputs(11, 2, 128, 3, 3, 16, 12, per_channel=False))
    o, S = gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    if naive == "recurrent":  # note: beta before g
        o_ref, S_ref = fla_naive["gdn_recurrent"](q, k, v, beta, g, scale=0.3, initial_state=h0,
                                                  output_final_state=True)
    else:
        o_ref, S_ref = fla_naive["gdn_chunk"](q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    assert_close(o_ref, o, 1e-5, "o")
    assert_close(S_ref, S, 1e-5, "final_state")


@pytest.mark.parametrize("naive", ["recurrent", "chunk"])
@pytest.mark.parametrize("strong", [False, True], ids=["logsigmoid", "strong"])
def test_kda_matches_fla_naive(fla_naive, naive, strong):
    q, k, v, g, beta, h0 = (x.float() for x in delta_inputs(12, 2, 64, 2, 4, 16, 12, True, strong=5 if strong else 0))
    o, S = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, S_ref = fla_naive[f"kda_{naive}"](q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close(o_ref, o, 1e-5, "o")
    assert_close(S_ref, S, 1e-5, "final_state")


# ---- short conv -------------------------------------------------------------------------------

def conv_each_sequence(x, weight, bounds, bias, activation):
    """Independent check: F.conv1d on every sequence alone, left-padded by W-1 zeros."""
    W = weight.shape[1]
    pieces = []
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        if bos == eos:
            continue  # conv1d rejects an empty input
        seq = x[bos:eos].T[None]  # [1, D, L]
        y = F.conv1d(F.pad(seq, (W - 1, 0)), weight[:, None, :], bias, groups=weight.shape[0])[0].T
        pieces.append(F.silu(y) if activation else y)
    return torch.cat(pieces)


@pytest.mark.parametrize("activation", ["silu", "swish", None])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "batched"])
@pytest.mark.parametrize("W", [1, 4])
def test_short_conv_matches_conv1d(activation, packed, W):
    gen = torch.Generator().manual_seed(13 + W)
    D = 5
    if packed:
        bounds = [0, 1, 3, 20, 20, 31]  # lengths 1, 2 (< W-1), 17, 0, 11
        x = torch.randn(1, 31, D, generator=gen, dtype=F64, requires_grad=True)
        cu = torch.tensor(bounds)
    else:
        bounds = [0, 12, 24]
        x = torch.randn(2, 12, D, generator=gen, dtype=F64, requires_grad=True)
        cu = None
    w = torch.randn(D, W, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(D, generator=gen, dtype=F64, requires_grad=True)
    y = short_conv(x, w, cu, b, activation)
    y_ref = conv_each_sequence(x.reshape(-1, D), w, bounds, b, activation).reshape(y.shape)
    assert_close(y, y_ref, 1e-14, "y")
    dy = torch.randn(y.shape, generator=gen, dtype=F64)
    grads = torch.autograd.grad((y * dy).sum(), (x, w, b))
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), (x, w, b))
    for name, a, r in zip(("dx", "dweight", "dbias"), grads, grads_ref):
        assert_close(a, r, 1e-13, name)


def test_short_conv_weight_convention_is_fla():
    # fla's causal_conv1d: weight[:, W-1] multiplies the current token, weight[:, 0] the token W-1 back
    x = torch.randn(1, 9, 3, dtype=F64)
    current = torch.zeros(3, 4, dtype=F64)
    current[:, 3] = 1
    oldest = torch.zeros(3, 4, dtype=F64)
    oldest[:, 0] = 1
    assert torch.equal(short_conv(x, current, activation=None), x)
    shifted = short_conv(x, oldest, activation=None)
    assert torch.equal(shifted[:, 3:], x[:, :-3])
    assert torch.equal(shifted[:, :3], torch.zeros_like(shifted[:, :3]))


def test_short_conv_no_leak_across_sequences():
    gen = torch.Generator().manual_seed(14)
    cu = torch.tensor([0, 5, 6, 14, 20])
    x = torch.randn(1, 20, 4, generator=gen, dtype=F64)
    w, b = torch.randn(4, 4, generator=gen, dtype=F64), torch.randn(4, generator=gen, dtype=F64)
    y = short_conv(x, w, cu, b)
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        x2 = x.clone()
        x2[:, bos:eos] += torch.randn(1, eos - bos, 4, generator=gen, dtype=F64)
        y2 = short_conv(x2, w, cu, b)
        assert not torch.equal(y2[:, bos:eos], y[:, bos:eos]), "the perturbed sequence itself must change"
        assert torch.equal(y2[:, :bos], y[:, :bos]) and torch.equal(y2[:, eos:], y[:, eos:]), \
            f"perturbing tokens {bos}:{eos} changed another sequence"


# ---- input rules ------------------------------------------------------------------------------

def _delta(**change):
    """Call gated_delta_rule (or kda with op=kda) on valid small inputs with some arguments replaced."""
    op = change.pop("op", gated_delta_rule)
    q, k, v, g, beta, h0 = delta_inputs(15, 1, 6, 2, 4, 4, 3, per_channel=op is kda)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=None, cu_seqlens=None)
    args.update(change)
    return op(**args)


BAD_INPUTS = [
    (lambda: _delta(cu_seqlens=torch.tensor([0.0, 6.0])), "cu_seqlens.*integer"),
    (lambda: _delta(cu_seqlens=torch.tensor([[0, 6]])), "cu_seqlens.*1-D"),
    (lambda: _delta(cu_seqlens=torch.tensor([6])), "cu_seqlens.*at least 2"),
    (lambda: _delta(cu_seqlens=torch.tensor([1, 6])), "cu_seqlens.*start at 0"),
    (lambda: _delta(cu_seqlens=torch.tensor([0, 4, 2, 6])), "cu_seqlens.*non-decreasing"),
    (lambda: _delta(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens.*end at"),
    (lambda: _delta(cu_seqlens=[0, 6]), "cu_seqlens.*torch.Tensor"),
    (lambda: _delta(q=torch.randn(2, 6, 2, 4), k=torch.randn(2, 6, 2, 4), v=torch.randn(2, 6, 4, 3),
                    g=torch.randn(2, 6, 4), beta=torch.rand(2, 6, 4), cu_seqlens=torch.tensor([0, 6])),
     "q.*batch size 1"),
    (lambda: _delta(v=torch.randn(1, 6, 3, 3), g=torch.randn(1, 6, 3), beta=torch.rand(1, 6, 3)), "v.*multiple"),
    (lambda: _delta(k=torch.randn(1, 6, 2, 5)), "k.*shape"),
    (lambda: _delta(q=torch.randn(6, 2, 4)), "q.*\\[B, T, H, K\\]"),
    (lambda: _delta(v=torch.randn(1, 5, 4, 3)), "v.*\\[B, T, HV, V\\]"),
    (lambda: _delta(g=torch.randn(1, 6, 4, 4)), "g.*shape"),
    (lambda: _delta(op=kda, g=torch.randn(1, 6, 4)), "g.*shape"),
    (lambda: _delta(beta=torch.rand(1, 6, 2)), "beta.*shape"),
    (lambda: _delta(initial_state=torch.randn(2, 4, 4, 3)), "initial_state.*shape"),
    (lambda: _delta(initial_state=torch.randn(1, 4, 3, 4)), "initial_state.*shape"),
    (lambda: _delta(q=torch.ones(1, 6, 2, 4, dtype=torch.long)), "q.*floating"),
    (lambda: gated_delta_rule(*delta_inputs(16, 1, 6, 2, 2, 4, 3, False)[:5], mode="fast"), "mode"),
    (lambda: kda(*delta_inputs(16, 1, 6, 2, 2, 4, 3, True)[:5], compute_dtype=torch.bfloat16), "compute_dtype"),
    (lambda: short_conv(torch.randn(1, 6, 4), torch.randn(4, 3), activation="relu"), "activation"),
    (lambda: short_conv(torch.randn(1, 6, 4), torch.randn(5, 3)), "weight.*\\[D, W\\]"),
    (lambda: short_conv(torch.randn(1, 6, 4), torch.randn(4, 3), bias=torch.randn(5)), "bias.*shape"),
    (lambda: short_conv(torch.randn(6, 4), torch.randn(4, 3)), "x.*\\[B, T, D\\]"),
    (lambda: short_conv(torch.randn(2, 6, 4), torch.randn(4, 3), torch.tensor([0, 6])), "x.*batch size 1"),
    (lambda: short_conv(torch.randn(1, 6, 4), torch.randn(4, 3), torch.tensor([0, 7])), "cu_seqlens.*end at"),
    (lambda: short_conv(torch.randn(1, 6, 4), torch.randn(4, 3), compute_dtype=torch.float16), "compute_dtype"),
    (lambda: validate_cu_seqlens(torch.tensor([0, 3, 2]), 2, name="cu_seqlens_k"), "cu_seqlens_k.*non-decreasing"),
]


BAD_INPUT_IDS = [f"{match.split('.')[0]}-{i}" for i, (_, match) in enumerate(BAD_INPUTS)]


@pytest.mark.parametrize("call, match", BAD_INPUTS, ids=BAD_INPUT_IDS)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=f"^{match}"):
        call()


def test_validate_cu_seqlens_returns_bounds():
    assert validate_cu_seqlens(torch.tensor([0, 3, 3, 7], dtype=torch.int32), 7) == [0, 3, 3, 7]
