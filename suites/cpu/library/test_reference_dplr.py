"""linattn.reference.dplr_delta_rule (and RWKV-7 through it): against a per-token matrix loop
written here (outputs, final states and every input's gradient), against fla's naive recurrence
and naive chunked form (float32), the input dtypes, and the input rules."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn.reference import dplr_delta_rule, rwkv7, rwkv7_kk_a
from pytest_linattn import assert_parity

F64 = torch.float64
CU = torch.tensor([0, 1, 9, 23, 30])  # a length-1 sequence among longer ones


def inputs(seed, B, T, H, K, V, N=None):
    """Fresh float64 q, k, v, a, b, gk, initial_state as RWKV-7 makes them: a = -kk, b = kk·iclr
    (kk unit), gk = w in (-0.61, 0), so the transition D + b aᵀ stays a contraction."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    q, k, v = rand(B, T, H, K), rand(B, T, H, K) / K ** 0.5, rand(B, T, H, V)
    kk = F.normalize(rand(B, T, H, K), dim=-1)
    iclr = torch.rand(B, T, H, K, generator=gen, dtype=F64)
    gk = -0.6065306597126334 * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    return q, k, v, -kk, kk * iclr, gk, rand(B if N is None else N, H, K, V)


def matrix_loop(q, k, v, a, b, gk, scale, h0, bounds, reverse=False):
    """S_t = (diag(exp gk_t) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ, o_t = scale S_tᵀ q_t, each sequence,
    head and token as written; packed tensors [1, T, ...]."""
    H = q.shape[2]
    o = torch.zeros(v.shape, dtype=F64)
    finals = []
    for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        heads = []
        for h in range(H):
            S = h0[s, h]
            order = range(eos - 1, bos - 1, -1) if reverse else range(bos, eos)
            for t in order:
                M = torch.diag(gk[0, t, h].exp()) + torch.outer(b[0, t, h], a[0, t, h])
                S = M @ S + torch.outer(k[0, t, h], v[0, t, h])
                o = o.index_put((torch.tensor(0), torch.tensor(t), torch.tensor(h)), scale * S.T @ q[0, t, h])
            heads.append(S)
        finals.append(torch.stack(heads))
    return o, torch.stack(finals)


def with_grads(fn, tensors, seed):
    """fn's (o, final_state) and the gradients of a random projection of both w.r.t. every tensor."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    o, S = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() + (S * torch.randn(S.shape, generator=gen, dtype=F64)).sum()
    names = ("q", "k", "v", "a", "b", "gk", "h0")
    return {"o": o, "final_state": S, **{f"d{n}": d for n, d in zip(names, torch.autograd.grad(loss, leaves))}}


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_reference_matches_matrix_loop(reverse):
    q, k, v, a, b, gk, h0 = inputs(3, 1, int(CU[-1]), 2, 8, 6, N=len(CU) - 1)
    bounds = CU.tolist()

    def reference(*x):
        return dplr_delta_rule(*x[:6], scale=0.4, initial_state=x[6], output_final_state=True, cu_seqlens=CU,
                               reverse=reverse)

    got = with_grads(reference, (q, k, v, a, b, gk, h0), seed=9)
    want = with_grads(lambda *x: matrix_loop(*x[:6], 0.4, x[6], bounds, reverse), (q, k, v, a, b, gk, h0), seed=9)
    assert len(got) == len(want) == 9
    assert_parity(got, want, rtol=1e-12, name=f"dplr_delta_rule reverse={reverse}", cu_seqlens=CU)


def test_rwkv7_is_the_dplr_rule_with_kk_and_iclr():
    q, k, v, a, b, gk, h0 = inputs(5, 2, 12, 2, 8, 6)
    gen = torch.Generator().manual_seed(6)
    kk = F.normalize(torch.randn(2, 12, 2, 8, generator=gen, dtype=F64), dim=-1)
    iclr = torch.rand(2, 12, 2, 8, generator=gen, dtype=F64)
    o, S = rwkv7_kk_a(q, gk, k, v, kk, iclr, initial_state=h0, output_final_state=True)
    o_ref, S_ref = dplr_delta_rule(q, k, v, -kk, kk * iclr, gk, scale=1.0, initial_state=h0, output_final_state=True)
    o2, S2 = rwkv7(q, gk, k, v, -kk, kk * iclr, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref) and torch.equal(o2, o_ref)
    # the low-rank term matters here: without it the outputs are O(1) off
    o_diag, _ = dplr_delta_rule(q, k, v, torch.zeros_like(kk), kk * iclr, gk, scale=1.0, initial_state=h0)
    assert (o_diag - o_ref).norm() > 0.1 * o_ref.norm()


def _fla_naive():
    with warnings.catch_warnings():  # fla warns that Triton cannot run on a CPU: its naive ref does not need it
        warnings.simplefilter("ignore")
        pytest.importorskip("fla", reason="fla-core not installed (pip install -e .[test])")
        from fla.ops.generalized_delta_rule.dplr import naive
    return naive


@pytest.mark.parametrize("form", ["dplr_recurrence", "dplr_chunkwise"])
def test_reference_matches_fla_naive(form):
    # fla's naive forms: head-first [B, H, T, D], scale K ** -0.5, no cu_seqlens; chunkwise in 32s
    naive = _fla_naive()
    q, k, v, a, b, gk, h0 = inputs(31, 2, 64, 2, 16, 12)
    o, S = dplr_delta_rule(q.float(), k.float(), v.float(), a.float(), b.float(), gk.float(),
                           initial_state=h0.float(), output_final_state=True)
    assert o.dtype == S.dtype == F64
    head_first = [x.float().transpose(1, 2).contiguous() for x in (q, k, v, a, b, gk)]
    o_ref, S_ref = getattr(naive, form)(*head_first, initial_state=h0.float(), output_final_state=True)
    assert_parity({"o": o_ref.transpose(1, 2), "final_state": S_ref}, {"o": o, "final_state": S}, rtol=1e-5,
                  name=f"fla {form} (float32)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_is_float64_whatever_the_input(dtype):
    x = inputs(41, 2, 10, 2, 8, 6)
    low = [t.to(dtype) for t in x]
    o, S = dplr_delta_rule(*low[:6], initial_state=low[6], output_final_state=True)
    assert o.dtype == S.dtype == F64
    o_ref, S_ref = dplr_delta_rule(*(t.to(F64) for t in low[:6]), initial_state=low[6].to(F64),
                                   output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)  # the same values, computed in float64


def _call(**change):
    q, k, v, a, b, gk, _ = inputs(51, 1, 6, 2, 8, 6)
    args = dict(q=q, k=k, v=v, a=a, b=b, gk=gk)
    args.update(change)
    return dplr_delta_rule(**args)


@pytest.mark.parametrize("change, match", [
    (dict(a=torch.randn(1, 6, 2, 4, dtype=F64)), r"a must have shape \(1, 6, 2, 8\)"),
    (dict(gk=torch.randn(1, 6, 2, dtype=F64)), r"gk must have shape \(1, 6, 2, 8\)"),
    (dict(v=torch.randn(1, 6, 4, 6, dtype=F64)), r"v must be \[B, T, H, V\]"),  # no GVA in fla's DPLR
    (dict(b=torch.randint(0, 2, (1, 6, 2, 8))), "b"),
    (dict(cu_seqlens=torch.tensor([0, 3, 5])), "cu_seqlens"),
    (dict(initial_state=torch.randn(2, 2, 8, 6, dtype=F64)), r"initial_state must have shape \(1, 2, 8, 6\)"),
    (dict(reverse=1), "reverse must be a bool"),
])
def test_bad_input_raises_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        _call(**change)
