"""linattn.reference.gated_delta_product: both forms against a per-token, per-step loop written
here (outputs, final states and every input's gradient), against fla's naive recurrence (float32),
the input dtypes, and the input rules."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn.reference import gated_delta_product, gated_delta_rule
from pytest_linattn import assert_parity

F64 = torch.float64
CU = torch.tensor([0, 1, 9, 23, 30])  # a length-1 sequence; 30 tokens x 3 steps cross a 64-step chunk


def inputs(seed, B, T, H, HV, K, V, n, N=None, gated=True):
    """Fresh float64 q, k, v, g (or None), beta, initial_state; unit keys, beta in (0, 2)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    q, k, v = rand(B, T, H, K), F.normalize(rand(B, T * n, H, K), dim=-1), rand(B, T * n, HV, V)
    g = F.logsigmoid(rand(B, T, HV) + 2.0) if gated else None
    beta = 2 * torch.rand(B, T * n, HV, generator=gen, dtype=F64)  # allow_neg_eigval's range
    return q, k, v, g, beta, rand(B if N is None else N, HV, K, V)


def per_step_loop(q, k, v, g, beta, n, scale, h0, bounds):
    """The recurrence as written: each sequence, value head, token, step; packed tensors [1, T, ...]."""
    HV, G = v.shape[2], v.shape[2] // q.shape[2]
    outputs, finals = [], []
    for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        heads_o, heads_S = [], []
        for h in range(HV):
            S, tokens = h0[s, h], []
            for t in range(bos, eos):
                if g is not None:
                    S = S * g[0, t, h].exp()
                for j in range(n):
                    step = t * n + j
                    k_j, v_j, b_j = k[0, step, h // G], v[0, step, h], beta[0, step, h]
                    S = S + b_j * torch.outer(k_j, v_j - S.T @ k_j)
                tokens.append(scale * S.T @ q[0, t, h // G])
            heads_o.append(torch.stack(tokens) if tokens else v.new_zeros(0, v.shape[-1]))
            heads_S.append(S)
        outputs.append(torch.stack(heads_o, dim=1))
        finals.append(torch.stack(heads_S))
    return torch.cat(outputs)[None], torch.stack(finals)


def with_grads(fn, tensors, seed):
    """fn's (o, final_state) and the gradients of a random projection of both w.r.t. every tensor."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    o, S = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() + (S * torch.randn(S.shape, generator=gen, dtype=F64)).sum()
    present = [t for t in leaves if t is not None]
    names = [n for n, t in zip(("q", "k", "v", "g", "beta", "h0"), leaves) if t is not None]
    return {"o": o, "final_state": S, **{f"d{n}": d for n, d in zip(names, torch.autograd.grad(loss, present))}}


@pytest.mark.parametrize("n, heads, gated, l2norm", [
    (2, (2, 2), True, False),
    (3, (1, 2), True, True),   # GVA: two value heads read one key head
    (1, (2, 2), True, False),  # one step per token: the gated delta rule
    (2, (2, 2), False, False),  # g=None: no decay
], ids=["n2", "n3-gva-l2norm", "n1", "n2-ungated"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_reference_matches_per_step_loop(n, heads, gated, l2norm, mode):
    H, HV = heads
    q, k, v, g, beta, h0 = inputs(3 + n, 1, int(CU[-1]), H, HV, 8, 6, n, N=len(CU) - 1, gated=gated)
    scale = 0.4
    bounds = CU.tolist()

    def reference(q, k, v, g, beta, h0):
        return gated_delta_product(q, k, v, g, beta, n, scale=scale, initial_state=h0, output_final_state=True,
                                   cu_seqlens=CU, use_qk_l2norm=l2norm, mode=mode)

    def loop(q, k, v, g, beta, h0):
        if l2norm:  # fla's in-kernel l2norm, eps 1e-6
            q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        return per_step_loop(q, k, v, g, beta, n, scale, h0, bounds)

    got = with_grads(reference, (q, k, v, g, beta, h0), seed=9)
    want = with_grads(loop, (q, k, v, g, beta, h0), seed=9)
    assert set(got) == set(want) and len(got) == (8 if gated else 7)
    assert_parity(got, want, rtol=1e-12, name=f"gated_delta_product {mode}")


def test_one_step_per_token_is_the_gated_delta_rule():
    q, k, v, g, beta, h0 = inputs(21, 2, 40, 2, 4, 8, 6, 1)
    o, S = gated_delta_product(q, k, v, g, beta, 1, initial_state=h0, output_final_state=True)
    o_ref, S_ref = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_parity({"o": o, "final_state": S}, {"o": o_ref, "final_state": S_ref}, rtol=1e-13, name="n=1")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_reference_matches_fla_naive(gated):
    with warnings.catch_warnings():  # fla warns that Triton cannot run on a CPU: its naive ref does not need it
        warnings.simplefilter("ignore")
        pytest.importorskip("fla", reason="fla-core not installed (pip install -e .[test])")
        from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    n = 3
    q, k, v, g, beta, h0 = (None if x is None else x.float()
                            for x in inputs(31, 1, int(CU[-1]), 2, 2, 16, 12, n, N=len(CU) - 1, gated=gated))
    o, S = gated_delta_product(q, k, v, g, beta, n, scale=0.3, initial_state=h0, output_final_state=True,
                               cu_seqlens=CU)
    assert o.dtype == S.dtype == F64
    o_ref, S_ref = naive_recurrent_gated_delta_product(q, k, v, g, beta, 0.3, cu_seqlens=CU, initial_state=h0,
                                                       output_final_state=True, num_householder=n)
    assert_parity({"o": o_ref, "final_state": S_ref}, {"o": o, "final_state": S}, rtol=1e-5,
                  name="fla naive_recurrent_gated_delta_product (float32)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_is_float64_whatever_the_input(dtype):
    q, k, v, g, beta, h0 = inputs(41, 2, 12, 2, 2, 8, 6, 2)
    low = [x.to(dtype) for x in (q, k, v, g, beta, h0)]
    o, S = gated_delta_product(*low[:5], 2, initial_state=low[5], output_final_state=True)
    assert o.dtype == S.dtype == F64
    o_ref, S_ref = gated_delta_product(*(x.to(dtype).to(F64) for x in (q, k, v, g, beta)), 2,
                                       initial_state=low[5].to(F64), output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)  # the same values, computed in float64


def _call(**change):
    q, k, v, g, beta, _ = inputs(51, 1, 6, 2, 2, 8, 6, 2)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=2)
    args.update(change)
    return gated_delta_product(**args)


@pytest.mark.parametrize("change, match", [
    (dict(num_householder=0), "num_householder must be a positive int"),
    (dict(num_householder=3), r"k must have shape \(1, 18, 2, 8\)"),
    (dict(k=torch.randn(1, 6, 2, 8, dtype=F64)), r"k must have shape \(1, 12, 2, 8\)"),
    (dict(beta=torch.rand(1, 6, 2, dtype=F64)), r"beta must have shape \(1, 12, 2\)"),
    (dict(g=torch.rand(1, 12, 2, dtype=F64)), r"g must have shape \(1, 6, 2\)"),
    (dict(cu_seqlens=torch.tensor([0, 3, 12])), "cu_seqlens"),  # counts tokens, not steps
    (dict(mode="fused"), "mode must be one of"),
])
def test_bad_input_raises_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        _call(**change)
