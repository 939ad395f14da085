"""linattn.emulation.delta_rules: fla 0.6.0's delta-rule ops, gates and l2norm on linattn's references.

Every emulated op against linattn.reference computed directly (float64, <= 1e-12) with every
option, on a packed batch with a length-1 sequence and random initial states; against fla's
float32 naive references per sequence (<= 1e-5); gradients by gradcheck; dtypes as fla returns
them; through the fla_on_cpu switch; refusals. cp_context=: test_emulation_cp.py.
"""

import importlib
import inspect
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from cases.emulation import (CASES, F64, GATE, HV, KDA_OPTIONS, LENGTHS, OPS, OPTIONS, RTOL32, RTOL64, H, K, V,
                             emulated_call, expected_beta, expected_log_decay, packed_inputs)
from linattn import reference
from linattn.emulation import delta_rules as emu
from pytest_linattn import assert_parity


@pytest.mark.parametrize("op_name, case", CASES)
def test_op_matches_reference(op_name, case):
    _, ref_op, mode = OPS[op_name]
    per_channel = ref_op is reference.kda
    opts = {**OPTIONS, **KDA_OPTIONS}[case]
    x, cu = packed_inputs(CASES.index((op_name, case)), per_channel)
    o, S = emulated_call(op_name, x, cu, opts)
    o_ref, S_ref = ref_op(x["q"], x["k"], x["v"], expected_log_decay(x, opts, per_channel), expected_beta(x, opts),
                          scale=opts.get("scale"), initial_state=x["h0"], output_final_state=True, cu_seqlens=cu,
                          use_qk_l2norm=opts.get("use_qk_l2norm_in_kernel", False), mode=mode)
    assert o.dtype == S.dtype == F64
    assert_parity({"o": o, "final_state": S}, {"o": o_ref, "final_state": S_ref}, rtol=RTOL64,
                  name=f"{op_name}/{case}")


def test_chunk_and_recurrent_agree_without_state():
    for kda in (True, False):
        x, cu = packed_inputs(50 + kda, per_channel=kda)
        chunk, recurrent = ("chunk_kda", "fused_recurrent_kda") if kda else ("chunk_gated_delta_rule",
                                                                              "fused_recurrent_gated_delta_rule")
        o_c, S_c = OPS[chunk][0](x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)
        o_r, S_r = OPS[recurrent][0](q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=cu)
        assert S_c is None and S_r is None
        assert_parity(o_c, o_r, rtol=RTOL64, name=f"{chunk} vs {recurrent}", cu_seqlens=cu)


def test_fused_recurrent_gdn_decay_and_beta_variants():
    # g per head, gk per key channel, both, neither; beta None means 1
    fused = emu.fused_recurrent_gated_delta_rule
    x, cu = packed_inputs(60, per_channel=False)
    gk = F.logsigmoid(torch.randn(1, sum(LENGTHS), HV, K, generator=torch.Generator().manual_seed(61), dtype=F64))
    args = dict(initial_state=x["h0"], output_final_state=True, cu_seqlens=cu)
    ones = torch.ones_like(x["beta"])
    zeros = torch.zeros_like(x["g"])
    for name, g, gk_, beta, ref_g, ref_beta in [
        ("g+gk", x["g"], gk, x["beta"], gk + x["g"].unsqueeze(-1), x["beta"]),
        ("gk", None, gk, x["beta"], gk, x["beta"]),
        ("no-decay", None, None, x["beta"], zeros, x["beta"]),
        ("beta-None", x["g"], None, None, x["g"], ones),
        ("beta-None-sigmoid", x["g"], None, None, x["g"], torch.sigmoid(ones)),
    ]:
        sigmoid = name.endswith("sigmoid")
        o, S = fused(x["q"], x["k"], x["v"], g=g, gk=gk_, beta=beta, use_beta_sigmoid_in_kernel=sigmoid, **args)
        ref_op = reference.kda if gk_ is not None else reference.gated_delta_rule
        o_ref, S_ref = ref_op(x["q"], x["k"], x["v"], ref_g, ref_beta, initial_state=x["h0"],
                              output_final_state=True, cu_seqlens=cu, mode="recurrent")
        assert_parity({"o": o, "S": S}, {"o": o_ref, "S": S_ref}, rtol=RTOL64, name=f"fused_recurrent_gdn/{name}")


def test_unpacked_batch_and_deprecated_state_layout_name():
    # B = 2 sequences of 4 tokens without cu_seqlens; transpose_state_layout is state_v_first's old name
    x, _ = packed_inputs(70, per_channel=True, lengths=[4, 4])
    q, k, v, g, beta = (x[n].view(2, 4, *x[n].shape[2:]) for n in ("q", "k", "v", "g", "beta"))
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o, S = emu.chunk_kda(q, k, v, g, beta, initial_state=x["h0"].transpose(-1, -2), output_final_state=True,
                             transpose_state_layout=True)
    o_ref, S_ref = reference.kda(q, k, v, g, beta, initial_state=x["h0"], output_final_state=True)
    assert_parity({"o": o, "S": S.transpose(-1, -2)}, {"o": o_ref, "S": S_ref}, rtol=RTOL64, name="batch/transpose")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_as_fla_returns_them(dtype):
    # o in q's dtype (v's for fused_recurrent: fla allocates it like v), states float32, grads in input dtypes
    for op_name, (op, _, _) in OPS.items():
        x, cu = packed_inputs(80, per_channel="kda" in op_name)
        x = {n: t.to(dtype).requires_grad_() for n, t in x.items()}
        h0 = x["h0"].detach().float().transpose(-1, -2).contiguous().requires_grad_()
        o, S = op(q=x["q"], k=x["k"], v=x["v"], g=x["g_raw"], beta=x["beta_raw"], A_log=x["A_log"],
                  dt_bias=x["dt_bias"], use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  initial_state=h0, output_final_state=True, state_v_first=True, cu_seqlens=cu)
        assert o.dtype == dtype and o.shape == x["v"].shape, op_name
        assert S.dtype == torch.float32 and S.shape == (len(LENGTHS), HV, V, K) and S.is_contiguous(), op_name
        (o.float().sum() + S.sum()).backward()
        for name in ("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias"):
            grad = x[name].grad
            assert grad is not None and grad.dtype == dtype and torch.isfinite(grad).all(), (op_name, name)
        assert h0.grad.dtype == torch.float32


def test_gates_and_l2norm():
    gen = torch.Generator().manual_seed(90)
    g_kda, g_gdn = torch.randn(2, 5, HV, K, generator=gen, dtype=F64), torch.randn(2, 5, HV, generator=gen, dtype=F64)
    A_log, bias_kda, bias_gdn = (torch.randn(n, generator=gen, dtype=F64) for n in (HV, HV * K, HV))
    A = A_log.exp().view(HV, 1)
    cases = {
        "kda": (emu.fused_kda_gate(g_kda, A_log, bias_kda), -A * F.softplus(g_kda + bias_kda.view(HV, K))),
        "kda-lower-bound": (emu.fused_kda_gate(g_kda, A_log, bias_kda, lower_bound=-5.0),
                            -5.0 * torch.sigmoid(A * (g_kda + bias_kda.view(HV, K)))),
        "kda-lower-bound-no-A_log": (emu.fused_kda_gate(g_kda, None, None, lower_bound=-2.0), -2.0 * torch.sigmoid(g_kda)),
        "gdn": (emu.fused_gdn_gate(g_gdn, A_log, bias_gdn), -A_log.exp() * F.softplus(g_gdn + bias_gdn)),
        "gdn-no-dt-bias": (emu.fused_gdn_gate(g_gdn, A_log), -A_log.exp() * F.softplus(g_gdn)),
        "l2norm": (emu.l2norm(g_kda), g_kda / (g_kda.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()),
        "l2norm-eps": (emu.l2norm(g_kda, eps=0.5), g_kda / (g_kda.pow(2).sum(-1, keepdim=True) + 0.5).sqrt()),
    }
    for name, (got, want) in cases.items():
        assert got.dtype == F64, name  # float64 in, float64 out (fla's float32 is its internal precision)
        assert_parity(got, want, rtol=RTOL64, name=name)
    assert emu.fused_kda_gate(g_kda.float(), A_log, bias_kda).dtype == torch.float32
    assert emu.fused_gdn_gate(g_gdn.bfloat16(), A_log, output_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert emu.l2norm(g_kda.bfloat16()).dtype == torch.bfloat16
    assert emu.l2norm(g_kda.bfloat16(), output_dtype=torch.float32).dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# gradients


GRAD_LENGTHS = [1, 2]


def _gradcheck_case(op_name):
    """A function of every differentiable input of the op with every option on, and its inputs."""
    per_channel = "kda" in op_name
    x, cu = packed_inputs(100 + len(op_name), per_channel, lengths=GRAD_LENGTHS)
    x = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    names = ["q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias", "h0"]
    opts = dict(GATE, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True, state_v_first=True)

    def fn(*tensors):
        return emulated_call(op_name, dict(zip(names, tensors)), cu, opts)

    return fn, tuple(x[n] for n in names)


@pytest.mark.parametrize("op_name", list(OPS))
def test_gradcheck_ops(op_name):
    # the chunked form is slow per call: a random projection of its Jacobian (its backward is the
    # reference's own, tested in test_reference); the recurrent form gets the full Jacobian
    fn, inputs = _gradcheck_case(op_name)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=OPS[op_name][2] == "chunk")


def test_gradcheck_gates_and_l2norm():
    gen = torch.Generator().manual_seed(110)
    leaf = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64).requires_grad_()  # noqa: E731
    g_kda, g_gdn, A_log, bias_kda, bias_gdn = leaf(3, HV, K), leaf(3, HV), leaf(HV), leaf(HV * K), leaf(HV)
    assert torch.autograd.gradcheck(emu.fused_kda_gate, (g_kda, A_log, bias_kda))
    assert torch.autograd.gradcheck(lambda *a: emu.fused_kda_gate(*a, lower_bound=-3.0), (g_kda, A_log, bias_kda))
    assert torch.autograd.gradcheck(emu.fused_gdn_gate, (g_gdn, A_log, bias_gdn))
    assert torch.autograd.gradcheck(emu.l2norm, (g_kda,))


# ----------------------------------------------------------------------------------------------
# refusals and fla's own checks


def _refusal_calls():
    x, cu = packed_inputs(120, per_channel=True)
    y, _ = packed_inputs(121, per_channel=False)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    return {
        "return_intermediate_states": (
            "chunk_kda", "return_intermediate_states", "True",
            lambda: emu.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, return_intermediate_states=True)),
        "gv": (
            "fused_recurrent_gated_delta_rule", "gv", "shape (1, 10, 2, 2)",
            lambda: emu.fused_recurrent_gated_delta_rule(q, k, v, g=y["g"], gv=torch.zeros_like(v), beta=y["beta"])),
        "gdn-beta-per-value-channel": (
            "fused_recurrent_gated_delta_rule", "beta", "shape (1, 10, 2, 2)",
            lambda: emu.fused_recurrent_gated_delta_rule(q, k, v, g=y["g"], beta=torch.rand_like(v))),
        "kda-beta-per-value-channel": (
            "fused_recurrent_kda", "beta", "shape (1, 10, 2, 2)",
            lambda: emu.fused_recurrent_kda(q, k, v, g, torch.rand_like(v))),
        "kda-recurrent-gate-without-A_log": (
            "fused_recurrent_kda", "A_log", "None",
            lambda: emu.fused_recurrent_kda(q, k, v, g, beta, dt_bias=x["dt_bias"], use_gate_in_kernel=True)),
        "kda-gate-without-A_log": (
            "fused_kda_gate", "A_log", "None", lambda: emu.fused_kda_gate(g, None, x["dt_bias"])),
    }


@pytest.mark.parametrize("case", list(_refusal_calls()))
def test_unsupported_values_are_refused(case):
    function, argument, value, call = _refusal_calls()[case]
    with pytest.raises(NotImplementedError) as info:
        call()
    message = str(info.value)
    assert f"{function}({argument}=" in message and value in message, message


@pytest.mark.parametrize("op_name", OPS)
def test_cu_seqlens_not_ending_at_the_token_count_is_refused_naming_both(op_name):
    x, cu = packed_inputs(132, per_channel=op_name.endswith("kda"))
    T, longer = int(cu[-1]), torch.cat([cu[:-1], cu[-1:] + 2])
    with pytest.raises(ValueError, match=rf"{op_name}: cu_seqlens\[-1\] = {T + 2} must equal T = {T}, the token "
                                         r"count of q \(1, "):
        emulated_call(op_name, x, longer, {})


def test_fla_checks_are_mirrored():
    x, cu = packed_inputs(130, per_channel=True)
    y, _ = packed_inputs(131, per_channel=False)
    kda = lambda **kw: emu.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, **kw)  # noqa: E731
    gdn = lambda **kw: emu.chunk_gated_delta_rule(x["q"], x["k"], x["v"], y["g"], y["beta"], cu_seqlens=cu, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="allow_neg_eigval=True` requires"):
        kda(allow_neg_eigval=True)
    with pytest.raises(ValueError, match="allow_neg_eigval=True` requires"):
        emu.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], y["g"], beta=y["beta"], allow_neg_eigval=True)
    with pytest.raises(ValueError, match="`A_log` must be provided"):
        kda(use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="`lower_bound` must be specified"):
        kda(use_gate_in_kernel=True, A_log=x["A_log"], safe_gate=True)
    with pytest.raises(ValueError, match="safe range"):
        kda(use_gate_in_kernel=True, A_log=x["A_log"], safe_gate=True, lower_bound=-6.0)
    with pytest.raises(ValueError, match="with safe_gate=True"):  # a precomputed gate below its promised bound
        kda(safe_gate=True, lower_bound=-0.1)
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64 for KDA"):
        kda(chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size"):
        gdn(chunk_size=128)
    with pytest.raises(AssertionError, match="A_log must be provided"):
        gdn(use_gate_in_kernel=True)
    with pytest.raises(AssertionError, match="initial_state must be in float32"):
        emu.chunk_kda(x["q"].float(), x["k"].float(), x["v"].float(), x["g"].float(), x["beta"].float(),
                      initial_state=x["h0"], cu_seqlens=cu)
    with pytest.raises(DeprecationWarning, match="head_first"):
        gdn(head_first=False)
    with pytest.raises(ValueError, match="Cannot pass both"):
        kda(state_v_first=True, transpose_state_layout=True)
    for op in (kda, gdn):  # before any use of the context
        with pytest.raises(AssertionError, match="Initial state is not supported for CP"):
            op(cp_context=object(), initial_state=x["h0"])
        with pytest.raises(AssertionError, match="Output final state is not supported for CP"):
            op(cp_context=object(), output_final_state=True)
    with pytest.raises(ValueError, match="^k must have shape"):  # the reference's own input rules
        emu.chunk_kda(x["q"][..., :2], x["k"], x["v"], x["g"], x["beta"])


# ----------------------------------------------------------------------------------------------
# fla's naive references (float32, one sequence at a time) and the switch: these import fla


@pytest.fixture(scope="module")
def fla():
    pytest.importorskip("fla")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns that Triton has no driver here
        return importlib.import_module("fla")


def _per_sequence(x, cu):
    bounds = cu.tolist()
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        yield n, {name: (t[:, a:b] if name not in ("h0", "A_log", "dt_bias") else t) for name, t in x.items()}


def test_ops_match_fla_naive_references(fla):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    for op_name in OPS:
        kda = "kda" in op_name
        # fla's naive GDN recurrence has no GVA: one value head per key head there
        x, cu = packed_inputs(140, per_channel=kda, heads=(H, HV) if kda else (HV, HV))
        x32 = {n: t.float() for n, t in x.items()}
        o, S = emulated_call(op_name, x32, cu, {})
        assert o.dtype == S.dtype == torch.float32
        naive = ([naive_recurrent_kda, lambda *a, **kw: naive_chunk_kda(*a, chunk_size=a[0].shape[1], **kw)] if kda
                 else [lambda q, k, v, g, beta, **kw: naive_recurrent_gated_delta_rule(q, k, v, beta, g, **kw)])
        for fn in naive:
            for n, s in _per_sequence(x32, cu):
                a, b = cu[n].item(), cu[n + 1].item()
                o_n, S_n = fn(s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=s["h0"][n:n + 1].clone(),
                              output_final_state=True)
                assert_parity({"o": o[:, a:b], "S": S[n:n + 1]}, {"o": o_n, "S": S_n}, rtol=RTOL32,
                              name=f"{op_name} vs fla naive, sequence {n}")


def test_gates_match_fla_naive_gates(fla):
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    gen = torch.Generator().manual_seed(150)
    g_kda, g_gdn = torch.randn(1, 6, HV, K, generator=gen), torch.randn(1, 6, HV, generator=gen)
    A_log, bias_kda, bias_gdn = (torch.randn(n, generator=gen) for n in (HV, HV * K, HV))
    pairs = {
        "kda": (emu.fused_kda_gate(g_kda, A_log, bias_kda), naive_kda_gate(g_kda, A_log, bias_kda)),
        "kda-lower-bound": (emu.fused_kda_gate(g_kda, A_log, bias_kda, -5.0),
                            naive_kda_lowerbound_gate(g_kda, A_log, bias_kda, -5.0)),
        "kda-lower-bound-no-A_log": (emu.fused_kda_gate(g_kda, None, bias_kda, -3.0),
                                     naive_kda_lowerbound_gate(g_kda, None, bias_kda, -3.0)),
        "gdn": (emu.fused_gdn_gate(g_gdn, A_log, bias_gdn), naive_gdn_gate(g_gdn, A_log, bias_gdn)),
    }
    for name, (got, want) in pairs.items():
        assert got.dtype == want.dtype == torch.float32, name
        assert_parity(got, want, rtol=RTOL32, name=f"{name} vs fla naive")


def test_signatures_match_fla(fla):
    # transformers filters kwargs by the signature of the function it holds
    for key, emulated in emu.PATCHES.items():
        module, name = key.split(":")
        original = getattr(importlib.import_module(module), name)
        describe = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
        assert describe(emulated) == describe(original), key


GDN_CHUNK = "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule"
GDN_RECURRENT = "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule"
L2NORM = "fla.modules.norm.l2norm:l2norm"


def test_switch_rebinds_and_restores(fla):
    import fla.modules.norm.l2norm as fla_l2norm
    import fla.ops.gated_delta_rule as fla_gdn
    import fla.ops.kda.chunk as fla_kda_chunk

    from linattn.emulation import fla_on_cpu

    installed = emu.PATCHES
    original = fla_kda_chunk.chunk_kda
    early = types.ModuleType("_linattn_test_early_user")  # imported fla's op before the switch
    exec("from fla.ops.kda import chunk_kda", early.__dict__)
    sys.modules[early.__name__] = early
    x, cu = packed_inputs(160, per_channel=True)
    try:
        with fla_on_cpu():
            from fla.ops.kda import chunk_kda

            assert chunk_kda is early.chunk_kda is installed["fla.ops.kda.chunk:chunk_kda"]
            assert fla_gdn.chunk_gdn is fla_gdn.chunk_gated_delta_rule is installed[GDN_CHUNK]
            assert fla_gdn.fused_recurrent_gdn is installed[GDN_RECURRENT]
            assert fla_l2norm.l2_norm is installed[L2NORM]
            o, S = early.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                   output_final_state=True, cu_seqlens=cu)
            y = fla_l2norm.L2Norm()(x["q"])
        with fla_on_cpu(torch.float32):  # float32 compute, float64 in and out
            o32, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)
        assert fla_kda_chunk.chunk_kda is original and early.chunk_kda is original
        assert fla_gdn.chunk_gdn is fla_gdn.chunk_gated_delta_rule is not installed[GDN_CHUNK]
        assert fla_l2norm.l2_norm is fla_l2norm.l2norm is not installed[L2NORM]
        assert emu.chunk_kda is not original  # the emulation's own names stay the emulation
    finally:
        del sys.modules[early.__name__]
    o_ref, S_ref = reference.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                 output_final_state=True, cu_seqlens=cu)
    assert_parity({"o": o, "S": S, "l2norm": y}, {"o": o_ref, "S": S_ref, "l2norm": reference.delta_rule.l2norm(x["q"])},
                  rtol=RTOL64, name="through fla_on_cpu")
    o_ref0, _ = reference.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)
    assert o32.dtype == F64
    assert_parity(o32, o_ref0, rtol=RTOL32, name="fla_on_cpu(float32)")


