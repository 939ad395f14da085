"""linattn.emulation.precond: fla 0.6.0's preconditioned gated delta rule and KDA entries on
linattn's reference, against linattn.reference.precond computed directly (float64, <= 1e-12) on a
packed batch with a length-1 sequence, with the options fla's entries take; fla's checks and the
emulation's refusals; and through the fla_on_cpu switch (fla's public names reach it)."""

import pytest
import torch
import torch.nn.functional as F

from linattn import reference
from linattn.emulation import fla_on_cpu
from linattn.emulation import precond as emu
from pytest_linattn import assert_parity

F64 = torch.float64
K, V = 8, 6
LENGTHS = (1, 9, 70)


def packed(seed, H=2, HV=2, per_channel=False):
    """Fresh q, k, v, g, g_atk, beta_atk, beta, h0, a0, centre, do."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(LENGTHS), len(LENGTHS)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    unit = lambda *shape: torch.rand(*shape, generator=gen, dtype=F64)  # noqa: E731
    g = F.logsigmoid(rand(1, T, HV, *((K,) if per_channel else ())) + 2.0)
    return dict(q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, HV, V), g=g, g_atk=F.logsigmoid(rand(1, T, H) + 2),
                beta_atk=unit(1, T, H), beta=unit(1, T, HV), h0=rand(N, HV, K, V), a0=unit(N, H, K),
                center=rand(H) * 0.5, do=rand(1, T, HV, V))


CU = torch.tensor([0, *LENGTHS]).cumsum(0)


def run_with_grads(fn, x):
    """(o, S, A) and d(o·do)/d(q, k, v, g, g_atk, beta_atk, beta)."""
    names = ("q", "k", "v", "g", "g_atk", "beta_atk", "beta")
    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    o, S, A = fn(leaves)
    grads = torch.autograd.grad((o * x["do"]).sum(), list(leaves.values()))
    return {"o": o, "S": S, "A": A, **{f"d{n}": d for n, d in zip(names, grads)}}


@pytest.mark.parametrize("entry", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("transpose", [False, True])
def test_precond_gated_delta_rule_matches_reference(entry, transpose):
    x = packed(3, H=1, HV=2)  # GVA
    opts = dict(scale=0.4, initial_A_state=x["a0"], output_final_state=True, cu_seqlens=CU, x=1.7, eps=1e-5,
                log_atk_scale=x["center"][:1], transpose_state_layout=transpose)
    h0 = x["h0"].transpose(-1, -2) if transpose else x["h0"]

    def emulated(t):
        if entry == "chunk":
            return emu.chunk_precond_gated_delta_rule(t["q"], t["k"], t["v"], t["g_atk"], t["g"], t["beta_atk"],
                                                      t["beta"], initial_state=h0, **opts)
        return emu.fused_recurrent_precond_gated_delta_rule(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"],
                                                            g_atk=t["g_atk"], beta_atk=t["beta_atk"],
                                                            initial_state=h0, **opts)

    def direct(t):
        o, S, A = reference.precond_gated_delta_rule(
            t["q"], t["k"], t["v"], t["g_atk"], t["g"], t["beta_atk"], t["beta"], scale=0.4, initial_state=x["h0"],
            initial_A_state=x["a0"], output_final_state=True, cu_seqlens=CU, x=1.7, eps=1e-5,
            log_atk_scale=x["center"][:1], mode="recurrent")
        return o, (S.transpose(-1, -2) if transpose else S), A

    assert_parity(run_with_grads(emulated, x), run_with_grads(direct, x), rtol=1e-12, name=f"precond gdn {entry}")


def gate(g, A_log, dt_bias):
    """fla's in-kernel KDA gate written out: -exp(A_log) softplus(g + dt_bias) per key channel."""
    return -A_log.exp()[:, None] * F.softplus(g + dt_bias.view(g.shape[-2:]))


@pytest.mark.parametrize("entry", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("in_kernel_gate", [False, True])
def test_precond_kda_matches_reference(entry, in_kernel_gate):
    x = packed(5, per_channel=True)
    gen = torch.Generator().manual_seed(6)
    A_log, dt_bias = torch.rand(2, generator=gen, dtype=F64).log(), torch.randn(2 * K, generator=gen, dtype=F64)
    opts = dict(scale=0.3, initial_state=x["h0"], initial_A_state=x["a0"], output_final_state=True,
                cu_seqlens=CU, log_atk_scale=x["center"])
    gate_opts = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias) if in_kernel_gate else {}
    op = emu.chunk_precond_kda if entry == "chunk" else emu.fused_recurrent_precond_kda

    def emulated(t):
        return op(t["q"], t["k"], t["v"], t["g"], t["g_atk"], t["beta_atk"], t["beta"], **opts, **gate_opts)

    def direct(t):
        g = gate(t["g"], A_log, dt_bias) if in_kernel_gate else t["g"]
        return reference.precond_kda(t["q"], t["k"], t["v"], g, t["g_atk"], t["beta_atk"], t["beta"],
                                     mode="recurrent", **opts)

    assert_parity(run_with_grads(emulated, x), run_with_grads(direct, x), rtol=1e-12, name=f"precond kda {entry}")


def test_dtypes_as_fla_returns_them():
    x = {n: t.float() for n, t in packed(7, per_channel=True).items()}
    args = [x[n].to(torch.bfloat16) for n in ("q", "k", "v")] + [x[n] for n in ("g", "g_atk", "beta_atk", "beta")]
    o, S, A = emu.chunk_precond_kda(*args, initial_state=x["h0"], output_final_state=True, cu_seqlens=CU)
    assert o.dtype == torch.bfloat16 and S.dtype == A.dtype == torch.float32
    assert torch.isfinite(o.float()).all() and o.float().norm() > 0


def _gdn_args(x):
    return [x[n] for n in ("q", "k", "v", "g_atk", "g", "beta_atk", "beta")]


@pytest.mark.parametrize("call, error, match", [
    (lambda x: emu.chunk_precond_gated_delta_rule(*_gdn_args(x), cp_context=object()), NotImplementedError,
     "Context parallelism is not yet supported for chunk_precond_gated_delta_rule"),
    (lambda x: emu.chunk_precond_gated_delta_rule(*_gdn_args(x), initial_state=x["h0"][:2], cu_seqlens=CU),
     ValueError, "number of initial states"),
    (lambda x: emu.fused_recurrent_precond_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], gv=x["v"],
                                                            g_atk=x["g_atk"], beta_atk=x["beta_atk"]),
     NotImplementedError, r"fla_on_cpu: fused_recurrent_precond_gated_delta_rule\(gv="),
    (lambda x: emu.fused_recurrent_precond_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"]),
     NotImplementedError, r"\(g_atk=None\)"),
    (lambda x: emu.chunk_precond_kda(*_kda_args(x), cp_context=object()), NotImplementedError,
     "Context parallelism is not yet supported for chunk_precond_kda"),
    (lambda x: emu.chunk_precond_kda(*_kda_args(x), return_intermediate_states=True), NotImplementedError,
     r"chunk_precond_kda\(return_intermediate_states=True\)"),
    (lambda x: emu.fused_recurrent_precond_kda(*_kda_args(x), use_gate_in_kernel=True), NotImplementedError,
     r"\(A_log=None\)"),
])
def test_fla_checks_and_refusals(call, error, match):
    with pytest.raises(error, match=match):
        call(packed(9))


def _kda_args(x):
    g = x["g"][..., None].expand(*x["q"].shape)
    return [x["q"], x["k"], x["v"], g, x["g_atk"], x["beta_atk"], x["beta"]]


def test_fla_public_names_reach_the_emulation():
    pytest.importorskip("fla", reason="fla not installed (pip install -e .[fla-cpu])")
    x = packed(11, per_channel=True)
    args = [x[n] for n in ("q", "k", "v", "g", "g_atk", "beta_atk", "beta")]
    with fla_on_cpu():
        from fla.ops.precond_kda import chunk_precond_kda
        o, S, A = chunk_precond_kda(*args, initial_state=x["h0"], output_final_state=True, cu_seqlens=CU)
    want = reference.precond_kda(*args, initial_state=x["h0"], output_final_state=True, cu_seqlens=CU)
    assert_parity({"o": o, "S": S, "A": A}, dict(zip(("o", "S", "A"), want)), rtol=1e-12, name="fla_on_cpu")
