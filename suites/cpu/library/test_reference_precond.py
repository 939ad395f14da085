"""linattn.reference.precond (preconditioned gated delta rule and KDA): both forms against a
per-token loop written here (outputs, final states, final ATK states and every input's gradient),
against fla's naive recurrent references (float32), the default squash centre, the input dtypes,
and the input rules."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn.reference import precond_gated_delta_rule, precond_kda
from pytest_linattn import assert_parity

F64 = torch.float64
CU = torch.tensor([0, 1, 9, 80, 87])  # a length-1 sequence; 71 tokens cross a 64-token chunk
NAMES = ("q", "k", "v", "g_atk", "g", "beta_atk", "beta", "h0", "a0", "center")


def inputs(seed, B, T, H, HV, K, V, N=None, per_channel=False):
    """Fresh float64 q, k, v, g_atk, g, beta_atk, beta, h0, a0 (positive), centre `[H]`; decays ~ 0.5-1."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    unit = lambda *shape: torch.rand(*shape, generator=gen, dtype=F64)  # noqa: E731
    N = B if N is None else N
    g = F.logsigmoid(rand(B, T, HV, *((K,) if per_channel else ())) + 2.0)
    return dict(q=rand(B, T, H, K), k=rand(B, T, H, K), v=rand(B, T, HV, V), g_atk=F.logsigmoid(rand(B, T, H) + 2.0),
                g=g, beta_atk=unit(B, T, H), beta=unit(B, T, HV), h0=rand(N, HV, K, V), a0=unit(N, H, K) * 0.3,
                center=rand(H) * 0.5 - 0.2)


def per_token_loop(x, scale, bounds, x_range=1.5, eps=1e-6):
    """The recurrence as written in fla's naive reference: each sequence, value head and token."""
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    H, HV = q.shape[2], v.shape[2]
    G = HV // H
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's in-kernel l2norm
    outputs, finals, finals_A = [], [], []
    for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        heads_o, heads_S, heads_A = [], [], []
        for h in range(HV):
            S, A, tokens = x["h0"][s, h], x["a0"][s, h // G], []
            for t in range(bos, eos):
                k_t = k[0, t, h // G]
                A = x["g_atk"][0, t, h // G].exp() * A + x["beta_atk"][0, t, h // G] * k_t ** 2
                r = torch.log(A + eps) - x["center"][h // G]
                kp = k_t * torch.exp(-math.log(x_range) * r / (1 + r.abs()))
                S = S * g[0, t, h].exp().reshape(-1, 1)  # g is [] (GDN) or [K] (KDA)
                S = S + torch.outer(kp, x["beta"][0, t, h] * (v[0, t, h] - S.T @ k_t))
                tokens.append(scale * S.T @ q[0, t, h // G])
            heads_o.append(torch.stack(tokens) if tokens else v.new_zeros(0, v.shape[-1]))
            heads_S.append(S)
            heads_A.append(A)
        outputs.append(torch.stack(heads_o, dim=1))
        finals.append(torch.stack(heads_S))
        finals_A.append(torch.stack(heads_A[::G]))  # one ATK state per key head
    return torch.cat(outputs)[None], torch.stack(finals), torch.stack(finals_A)


def with_grads(fn, x, seed):
    """fn's (o, final_state, final_A_state) and the gradients of a random projection of all three."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    outs = fn(leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=F64)).sum() for t in outs)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"o": outs[0], "final_state": outs[1], "final_A_state": outs[2],
            **{f"d{n}": d for n, d in zip(leaves, grads)}}


@pytest.mark.parametrize("rule", ["gdn", "kda"])
@pytest.mark.parametrize("heads", [(2, 2), (1, 2)], ids=["h2", "gva"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_reference_matches_per_token_loop(rule, heads, mode):
    H, HV = heads
    x = inputs(3 + HV, 1, int(CU[-1]), H, HV, 8, 6, N=len(CU) - 1, per_channel=rule == "kda")
    scale, bounds = 0.4, CU.tolist()

    def reference(t):
        op, gates = ((precond_gated_delta_rule, (t["g_atk"], t["g"])) if rule == "gdn"
                     else (precond_kda, (t["g"], t["g_atk"])))
        return op(t["q"], t["k"], t["v"], *gates, t["beta_atk"], t["beta"], scale=scale, initial_state=t["h0"],
                  initial_A_state=t["a0"], output_final_state=True, cu_seqlens=CU, log_atk_scale=t["center"],
                  mode=mode)

    got = with_grads(reference, x, seed=9)
    want = with_grads(lambda t: per_token_loop(t, scale, bounds), x, seed=9)
    assert set(got) == set(want) and len(got) == 13
    assert_parity(got, want, rtol=1e-12, name=f"precond {rule} {mode}")


def test_chunk_and_recurrent_agree_across_chunks_and_batch_rows():
    x = inputs(13, 2, 150, 2, 2, 16, 8, per_channel=True)  # 3 chunks per row, no cu_seqlens
    args = [x[n] for n in ("q", "k", "v", "g", "g_atk", "beta_atk", "beta")]
    runs = {mode: precond_kda(*args, initial_state=x["h0"], initial_A_state=x["a0"], output_final_state=True,
                              mode=mode) for mode in ("chunk", "recurrent")}
    assert_parity(dict(zip(("o", "S", "A"), runs["chunk"])), dict(zip(("o", "S", "A"), runs["recurrent"])),
                  rtol=1e-12, name="chunk vs recurrent")


def test_preconditioner_changes_the_result_and_default_centre_is_minus_0_2():
    x = inputs(17, 1, 30, 2, 2, 8, 6)
    args = [x[n] for n in ("q", "k", "v", "g_atk", "g", "beta_atk", "beta")]
    o_default, _, _ = precond_gated_delta_rule(*args)
    o_explicit, _, _ = precond_gated_delta_rule(*args, log_atk_scale=torch.full((2,), -0.2, dtype=F64))
    assert_parity({"o": o_default}, {"o": o_explicit}, rtol=1e-14, name="default centre")
    o_flat, _, _ = precond_gated_delta_rule(*args, x=1.0)  # x = 1: M = 1, the plain gated delta rule
    assert (o_flat - o_default).norm() > 1e-2 * o_default.norm()


@pytest.mark.parametrize("rule", ["gdn", "kda"])
def test_reference_matches_fla_naive(rule):
    with warnings.catch_warnings():  # fla warns that Triton cannot run on a CPU: its naive refs do not need it
        warnings.simplefilter("ignore")
        pytest.importorskip("fla", reason="fla-core not installed (pip install -e .[test])")
        from fla.ops.precond_gated_delta_rule import naive_recurrent_precond_gated_delta_rule
        from fla.ops.precond_kda import naive_recurrent_precond_kda
    x = {n: t.float() for n, t in inputs(31, 2, 70, 2, 2, 16, 12, per_channel=rule == "kda").items()}
    common = dict(scale=0.3, initial_state=x["h0"], initial_A_state=x["a0"], output_final_state=True,
                  log_atk_scale=x["center"])
    if rule == "gdn":
        args = [x[n] for n in ("q", "k", "v", "g_atk", "g", "beta_atk", "beta")]
        got = precond_gated_delta_rule(*args, **common)
        want = naive_recurrent_precond_gated_delta_rule(*args, **common)
    else:  # fla's naive KDA takes normalised q and k
        q, k = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
        args = [q, k] + [x[n] for n in ("v", "g", "g_atk", "beta_atk", "beta")]
        got = precond_kda(*args, use_qk_l2norm=False, **common)
        want = naive_recurrent_precond_kda(*args, **common)
    assert all(t.dtype == F64 for t in got)
    assert_parity(dict(zip(("o", "S", "A"), want)), dict(zip(("o", "S", "A"), got)), rtol=1e-5,
                  name=f"fla naive precond {rule} (float32)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_is_float64_whatever_the_input(dtype):
    x = inputs(41, 2, 12, 2, 2, 8, 6)
    names = ("q", "k", "v", "g_atk", "g", "beta_atk", "beta")
    low = {n: t.to(dtype) for n, t in x.items()}
    got = precond_gated_delta_rule(*(low[n] for n in names), initial_state=low["h0"], initial_A_state=low["a0"],
                                   output_final_state=True)
    want = precond_gated_delta_rule(*(low[n].double() for n in names), initial_state=low["h0"].double(),
                                    initial_A_state=low["a0"].double(), output_final_state=True)
    assert all(t.dtype == F64 for t in got)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the same values, computed in float64


@pytest.mark.parametrize("change, match", [
    (dict(g=torch.rand(1, 6, 2, 8, dtype=F64)), r"g must be \[B, T, HV\]"),
    (dict(g_atk=torch.rand(1, 6, 2, 8, dtype=F64)), r"g_atk must have shape \(1, 6, 2\)"),
    (dict(beta_atk=torch.rand(1, 6, 4, dtype=F64)), r"beta_atk must have shape \(1, 6, 2\)"),
    (dict(initial_A_state=torch.rand(2, 2, 8, dtype=F64)), r"initial_A_state must have shape \(1, 2, 8\)"),
    (dict(log_atk_scale=torch.rand(3, dtype=F64)), r"log_atk_scale must have shape \(2,\)"),
    (dict(x=0.0), "x must be a positive number"),
    (dict(cu_seqlens=torch.tensor([0, 3, 7])), "cu_seqlens"),
    (dict(mode="fused"), "mode must be one of"),
])
def test_bad_input_raises_value_error(change, match):
    x = inputs(51, 1, 6, 2, 2, 8, 6)
    args = {n: x[n] for n in ("q", "k", "v", "g_atk", "g", "beta_atk", "beta")}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        precond_gated_delta_rule(**args)
