"""linattn.reference.gdn2 (Gated DeltaNet 2): both forms against a per-token loop written here
(outputs, final states and every input's gradient), against fla's naive recurrent and chunk
references (float32), KDA as the case b = w = beta, the input dtypes, and the input rules."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn.reference import gdn2, kda
from pytest_linattn import assert_parity

F64 = torch.float64
CU = torch.tensor([0, 1, 9, 80, 87])  # a length-1 sequence; 71 tokens cross a 64-token chunk


def inputs(seed, B, T, H, HV, K, V, N=None):
    """Fresh float64 q, k, v, g, b, w, initial_state; unit keys, decays exp(g) ~ 0.5-1, b in (0, 2)
    (allow_neg_eigval's range), w in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    unit = lambda *shape: torch.rand(*shape, generator=gen, dtype=F64)  # noqa: E731
    q, k, v = rand(B, T, H, K), F.normalize(rand(B, T, H, K), dim=-1), rand(B, T, HV, V)
    g = F.logsigmoid(rand(B, T, HV, K) + 2.0)
    return q, k, v, g, 2 * unit(B, T, HV, K), unit(B, T, HV, V), rand(B if N is None else N, HV, K, V)


def per_token_loop(q, k, v, g, b, w, scale, h0, bounds):
    """The recurrence as written: each sequence, value head and token; packed tensors [1, T, ...]."""
    HV, G = v.shape[2], v.shape[2] // q.shape[2]
    outputs, finals = [], []
    for s, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        heads_o, heads_S = [], []
        for h in range(HV):
            S, tokens = h0[s, h], []
            for t in range(bos, eos):
                k_t = k[0, t, h // G]
                decayed = torch.diag(g[0, t, h].exp()) @ S
                S = decayed - torch.outer(k_t, decayed.T @ (b[0, t, h] * k_t)) + torch.outer(k_t, w[0, t, h] * v[0, t, h])
                tokens.append(scale * S.T @ q[0, t, h // G])
            heads_o.append(torch.stack(tokens) if tokens else v.new_zeros(0, v.shape[-1]))
            heads_S.append(S)
        outputs.append(torch.stack(heads_o, dim=1))
        finals.append(torch.stack(heads_S))
    return torch.cat(outputs)[None], torch.stack(finals)


def with_grads(fn, tensors, seed):
    """fn's (o, final_state) and the gradients of a random projection of both w.r.t. every tensor."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    o, S = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() + (S * torch.randn(S.shape, generator=gen, dtype=F64)).sum()
    names = ("q", "k", "v", "g", "b", "w", "h0")
    return {"o": o, "final_state": S, **{f"d{n}": d for n, d in zip(names, torch.autograd.grad(loss, leaves))}}


@pytest.mark.parametrize("heads, l2norm", [((2, 2), False), ((1, 2), True)], ids=["h2", "gva-l2norm"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_reference_matches_per_token_loop(heads, l2norm, mode):
    H, HV = heads
    q, k, v, g, b, w, h0 = inputs(3 + HV, 1, int(CU[-1]), H, HV, 8, 6, N=len(CU) - 1)
    scale, bounds = 0.4, CU.tolist()

    def reference(q, k, v, g, b, w, h0):
        return gdn2(q, k, v, g, b, w, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=CU,
                    use_qk_l2norm=l2norm, mode=mode)

    def loop(q, k, v, g, b, w, h0):
        if l2norm:  # fla's in-kernel l2norm, eps 1e-6
            q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        return per_token_loop(q, k, v, g, b, w, scale, h0, bounds)

    got = with_grads(reference, (q, k, v, g, b, w, h0), seed=9)
    want = with_grads(loop, (q, k, v, g, b, w, h0), seed=9)
    assert set(got) == set(want) and len(got) == 9
    assert_parity(got, want, rtol=1e-12, name=f"gdn2 {mode}")


def test_chunk_and_recurrent_agree_across_chunks_and_batch_rows():
    q, k, v, g, b, w, h0 = inputs(13, 2, 150, 2, 2, 16, 8)  # 3 chunks per row, no cu_seqlens
    o_c, S_c = gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, mode="chunk")
    o_r, S_r = gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True, mode="recurrent")
    assert_parity({"o": o_c, "final_state": S_c}, {"o": o_r, "final_state": S_r}, rtol=1e-12, name="chunk vs recurrent")


def test_equal_erase_and_write_gates_are_kda():
    q, k, v, g, _, _, h0 = inputs(21, 2, 40, 2, 4, 8, 6)
    beta = torch.rand(2, 40, 4, generator=torch.Generator().manual_seed(22), dtype=F64)
    b, w = beta[..., None].expand(*g.shape), beta[..., None].expand(*v.shape)
    o, S = gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True)
    o_ref, S_ref = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_parity({"o": o, "final_state": S}, {"o": o_ref, "final_state": S_ref}, rtol=1e-12, name="b = w = beta")
    # and they differ once the gates do: b erases per key channel, w writes per value channel
    o_b, _ = gdn2(q, k, v, g, b * 0.5, w, initial_state=h0)
    assert (o_b - o_ref).norm() > 1e-2 * o_ref.norm()


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_reference_matches_fla_naive(form):
    with warnings.catch_warnings():  # fla warns that Triton cannot run on a CPU: its naive refs do not need it
        warnings.simplefilter("ignore")
        pytest.importorskip("fla", reason="fla-core not installed (pip install -e .[test])")
        from fla.ops.gdn2 import naive_chunk_gdn2, naive_recurrent_gdn2
    # fla's naive refs take no cu_seqlens: a batch of 2 rows, T 70 (a 64-token chunk and a partial one)
    q, k, v, g, b, w, h0 = (x.float() for x in inputs(31, 2, 70, 2, 2, 16, 12))
    o, S = gdn2(q, k, v, g, b, w, scale=0.3, initial_state=h0, output_final_state=True, mode=form)
    assert o.dtype == S.dtype == F64
    naive = naive_recurrent_gdn2 if form == "recurrent" else naive_chunk_gdn2
    o_ref, S_ref = naive(q, k, v, g, b, w, scale=0.3, initial_state=h0, output_final_state=True)
    assert_parity({"o": o_ref, "final_state": S_ref}, {"o": o, "final_state": S}, rtol=1e-5,
                  name=f"fla naive_{form}_gdn2 (float32)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_is_float64_whatever_the_input(dtype):
    q, k, v, g, b, w, h0 = inputs(41, 2, 12, 2, 2, 8, 6)
    low = [x.to(dtype) for x in (q, k, v, g, b, w, h0)]
    o, S = gdn2(*low[:6], initial_state=low[6], output_final_state=True)
    assert o.dtype == S.dtype == F64
    o_ref, S_ref = gdn2(*(x.to(F64) for x in low[:6]), initial_state=low[6].to(F64), output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)  # the same values, computed in float64


def _call(**change):
    q, k, v, g, b, w, _ = inputs(51, 1, 6, 2, 2, 8, 6)
    args = dict(q=q, k=k, v=v, g=g, b=b, w=w)
    args.update(change)
    return gdn2(**args)


@pytest.mark.parametrize("change, match", [
    (dict(g=torch.rand(1, 6, 2, dtype=F64)), r"g must have shape \(1, 6, 2, 8\)"),
    (dict(b=torch.rand(1, 6, 2, dtype=F64)), r"b must have shape \(1, 6, 2, 8\)"),
    (dict(w=torch.rand(1, 6, 2, 8, dtype=F64)), r"w must have shape \(1, 6, 2, 6\)"),
    (dict(cu_seqlens=torch.tensor([0, 3, 7])), "cu_seqlens"),
    (dict(initial_state=torch.rand(2, 2, 8, 6, dtype=F64)), r"initial_state must have shape \(1, 2, 8, 6\)"),
    (dict(mode="fused"), "mode must be one of"),
])
def test_bad_input_raises_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        _call(**change)
