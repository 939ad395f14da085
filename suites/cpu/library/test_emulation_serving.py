"""linattn.emulation.serving: fla 0.6.0's fused_recurrent_kda_fwd with a state pool.

Against an independent per-token loop written here (float64, <= 1e-12): a padded decode with
1-D `ssm_state_indices` (padding rows of zero tokens at slot -1), a verify call with 2-D indices
and `num_accepted_tokens` (a state per token), the new-state form (`inplace_final_state=False`),
the call without a pool, `out=`; every slot the call does not write bitwise unchanged. Then the
refusals (what fla's kernel leaves to memory outside the pool or to the order of its programs),
fla's public entries refusing the pool arguments they drop, and the switch.
"""

import pytest
import torch
import torch.nn.functional as F

# by module attribute: leaving fla_on_cpu gives every name bound to an emulated op fla's original
from linattn.emulation import delta_rules, fla_on_cpu, serving
from pytest_linattn import assert_parity

F64 = torch.float64
RTOL = 1e-12
H, HV, K, V = 2, 4, 5, 3  # two value heads per key head
P = 7  # pool slots
OPTIONS = {
    "plain": {},
    "gate-lower-bound": dict(use_gate_in_kernel=True, lower_bound=-4.0, A_log="A_log", dt_bias="dt_bias"),
    "gate-softplus+beta-sigmoid": dict(use_gate_in_kernel=True, A_log="A_log", dt_bias="dt_bias",
                                       use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "l2norm+scale+v-first": dict(use_qk_l2norm_in_kernel=True, scale=0.4, state_v_first=True),
}


def inputs(seed, T, options):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(q=draw(1, T, H, K), k=draw(1, T, H, K), v=draw(1, T, HV, V), beta=torch.sigmoid(draw(1, T, HV)),
             g=draw(1, T, HV, K) if options.get("use_gate_in_kernel") else F.logsigmoid(draw(1, T, HV, K) + 2))
    if options.get("use_beta_sigmoid_in_kernel"):
        x["beta"] = draw(1, T, HV)
    kw = {n: v for n, v in options.items() if not isinstance(v, str)}
    kw.update({n: draw(HV).abs().log() if v == "A_log" else draw(HV * K) for n, v in options.items()
               if isinstance(v, str)})
    layout = (V, K) if options.get("state_v_first") else (K, V)
    return x, kw, draw(P, HV, *layout)


def loop_token(x, t, h, kw):
    """The KDA recurrence for token t from h `[HV, K, V]`, written out: (o `[HV, V]`, new h)."""
    q, k, v, g, beta = (x[n][0, t] for n in ("q", "k", "v", "g", "beta"))
    if kw.get("use_gate_in_kernel"):
        f = g + kw["dt_bias"].view(HV, K)
        rate = kw["A_log"].exp()[:, None]
        g = (kw["lower_bound"] * torch.sigmoid(rate * f) if kw.get("lower_bound") is not None
             else -rate * F.softplus(f))
    if kw.get("use_beta_sigmoid_in_kernel"):
        beta = torch.sigmoid(beta) * (2 if kw.get("allow_neg_eigval") else 1)
    scale = kw.get("scale", K ** -0.5)
    outs, states = [], []
    for hv in range(HV):
        qh, kh = q[hv // (HV // H)], k[hv // (HV // H)]
        if kw.get("use_qk_l2norm_in_kernel"):
            qh, kh = qh / (qh @ qh + 1e-6).sqrt(), kh / (kh @ kh + 1e-6).sqrt()
        s = h[hv] * g[hv].exp()[:, None]
        s = s + torch.outer(kh, beta[hv] * (v[hv] - kh @ s))
        outs.append((qh * scale) @ s)
        states.append(s)
    return torch.stack(outs), torch.stack(states)


def as_k_first(state, kw):
    return state.transpose(-1, -2) if kw.get("state_v_first") else state


def loop_sequence(x, tokens, h, kw):
    """Outputs and states after each of `tokens`, from h in the call's layout."""
    h = as_k_first(h, kw)
    outs, states = [], []
    for t in tokens:
        o, h = loop_token(x, t, h, kw)
        outs.append(o)
        states.append(as_k_first(h, kw))
    return outs, states


def check_untouched(pool, before, written):
    for slot in range(P):
        if slot not in written:
            assert torch.equal(pool[slot], before[slot]), f"slot {slot} changed, not written by the call"


@pytest.mark.parametrize("name", list(OPTIONS))
def test_padded_decode_reads_and_writes_each_rows_slot(name):
    # 3 sequences of one token in slots 5, 0, 3; rows 3 and 4 padding (zero tokens, slot -1 and 2)
    x, kw, pool = inputs(1, 5, OPTIONS[name])
    before = pool.clone()
    indices = torch.tensor([5, 0, 3, -1, 2])
    cu = torch.tensor([0, 1, 2, 3, 3, 3])
    o, ht = serving.fused_recurrent_kda_fwd(**x, **kw, initial_state=pool, ssm_state_indices=indices, cu_seqlens=cu)
    assert ht is pool
    for n, slot in enumerate([5, 0, 3]):
        outs, states = loop_sequence(x, [n], before[slot], kw)
        assert_parity(o[0, n], outs[0], rtol=RTOL, name=f"{name} o row {n}")
        assert_parity(pool[slot], states[0], rtol=RTOL, name=f"{name} slot {slot}")
    assert torch.equal(o[0, 3:], torch.zeros_like(o[0, 3:])), "tokens outside every sequence must stay zero"
    check_untouched(pool, before, {5, 0, 3})


@pytest.mark.parametrize("name", ["plain", "l2norm+scale+v-first"])
def test_verify_call_keeps_a_state_per_token_from_the_accepted_column(name):
    # sequence 0: 3 tokens from column 1 (2 accepted last time); sequence 1: 2 tokens from column 2
    x, kw, pool = inputs(2, 5, OPTIONS[name])
    before = pool.clone()
    indices = torch.tensor([[0, 1, 2], [4, 5, 6]])
    accepted = torch.tensor([2, 3])
    o, _ = serving.fused_recurrent_kda_fwd(**x, **kw, initial_state=pool, ssm_state_indices=indices,
                                   num_accepted_tokens=accepted, cu_seqlens=torch.tensor([0, 3, 5]))
    for n, (tokens, read, written) in enumerate([([0, 1, 2], 1, [0, 1, 2]), ([3, 4], 6, [4, 5])]):
        outs, states = loop_sequence(x, tokens, before[read], kw)
        for t, slot in enumerate(written):
            assert_parity(o[0, tokens[t]], outs[t], rtol=RTOL, name=f"{name} seq {n} token {t}")
            assert_parity(pool[slot], states[t], rtol=RTOL, name=f"{name} seq {n} state after token {t}")
    check_untouched(pool, before, {0, 1, 2, 4, 5})


def test_new_state_per_token_without_inplace():
    x, kw, pool = inputs(3, 3, {})
    before = pool.clone()
    o, ht = serving.fused_recurrent_kda_fwd(**x, initial_state=pool, inplace_final_state=False, output_final_state=True,
                                    ssm_state_indices=torch.tensor([6, 2, 4]), cu_seqlens=torch.tensor([0, 1, 2, 3]))
    assert ht.shape == (3, HV, K, V) and ht.dtype == F64
    for n, slot in enumerate([6, 2, 4]):
        outs, states = loop_sequence(x, [n], before[slot], kw)
        assert_parity(ht[n], states[0], rtol=RTOL, name=f"state row {n}")
        assert_parity(o[0, n], outs[0], rtol=RTOL, name=f"o row {n}")
    assert torch.equal(pool, before), "the pool is read only without inplace_final_state"


def test_without_a_pool_rows_update_in_place_and_out_is_written():
    x, kw, pool = inputs(4, 6, {})
    h0 = pool[:2].clone()
    out = torch.full_like(x["v"], 7.0)
    o, ht = serving.fused_recurrent_kda_fwd(**x, initial_state=h0, out=out, cu_seqlens=torch.tensor([0, 4, 5]))
    assert o is out and ht is h0
    for n, tokens in enumerate([[0, 1, 2, 3], [4]]):
        outs, states = loop_sequence(x, tokens, pool[n], kw)
        assert_parity(ht[n], states[-1], rtol=RTOL, name=f"final state {n}")
        assert_parity(o[0, tokens], torch.stack(outs), rtol=RTOL, name=f"o of sequence {n}")
    assert torch.equal(out[0, 5], torch.full_like(out[0, 5], 7.0)), "a token outside every sequence is not written"


def refusal_cases():
    x, kw, pool = inputs(5, 4, {})
    cu2 = torch.tensor([0, 2, 4])

    def call(**options):
        return lambda: serving.fused_recurrent_kda_fwd(**x, initial_state=pool.clone(), **options)

    one_each = dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4]))
    strided_q = x["q"].transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, channels strided
    return {
        "negative index of a sequence with tokens": (call(ssm_state_indices=torch.tensor([1, -1, 2, 3]), **one_each),
                                                     "no padding sentinel"),
        "index past the pool": (call(ssm_state_indices=torch.tensor([1, 2, 3, P]), **one_each), "outside the pool"),
        "1-D indices with 2 tokens a sequence": (call(ssm_state_indices=torch.tensor([1, 2]), cu_seqlens=cu2),
                                                 "another sequence's"),
        "num_accepted_tokens 0": (call(ssm_state_indices=torch.tensor([[1, 2], [3, 4]]), cu_seqlens=cu2,
                                       num_accepted_tokens=torch.tensor([1, 0])), "past the row"),
        "more tokens than columns": (call(ssm_state_indices=torch.tensor([[1], [3]]), cu_seqlens=cu2),
                                     "past the row"),
        "num_accepted_tokens without indices": (call(num_accepted_tokens=torch.tensor([1, 1]), cu_seqlens=cu2),
                                                "only with a state pool"),
        "a slot two sequences write": (call(ssm_state_indices=torch.tensor([[1, 2], [2, 4]]), cu_seqlens=cu2),
                                       "order of fla's parallel programs"),
        "a slot one reads, another writes": (call(ssm_state_indices=torch.tensor([[1, 2, 0], [5, 6, 2]]),
                                                  cu_seqlens=cu2, num_accepted_tokens=torch.tensor([1, 3])),
                                             "order of fla's parallel programs"),
        "a non-contiguous q": (lambda: serving.fused_recurrent_kda_fwd(**{**x, "q": strided_q},
                                                                       initial_state=pool.clone()),
                               "reads it as contiguous"),
        "indices with no state out": (call(ssm_state_indices=torch.tensor([1, 2, 3, 4]), inplace_final_state=False,
                                           **one_each), "stores every token's state nowhere"),
        "public fused_recurrent_kda drops the indices": (
            lambda: delta_rules.fused_recurrent_kda(**x, initial_state=pool[:1], ssm_state_indices=torch.tensor([3])),
            "lands in \\*\\*kwargs, unread"),
        "public GDN entry has no pool": (
            lambda: delta_rules.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"][..., 0],
                                                                 beta=x["beta"], num_accepted_tokens=torch.tensor([1])),
            "no GDN state pool"),
    }


@pytest.mark.parametrize("case", list(refusal_cases()))
def test_refusals_name_the_argument(case):
    fn, match = refusal_cases()[case]
    with pytest.raises(NotImplementedError, match=match):
        fn()


def test_the_switch_puts_the_pool_entry_in_place_of_flas():
    import fla.ops.kda.fused_recurrent as fla_module

    original = fla_module.fused_recurrent_kda_fwd
    x, kw, pool = inputs(6, 2, {})
    direct = pool.clone()
    serving.fused_recurrent_kda_fwd(**x, initial_state=direct, ssm_state_indices=torch.tensor([4, 1]),
                            cu_seqlens=torch.tensor([0, 1, 2]))
    with fla_on_cpu():
        assert fla_module.fused_recurrent_kda_fwd is serving.fused_recurrent_kda_fwd
        switched = pool.clone()
        fla_module.fused_recurrent_kda_fwd(q=x["q"].transpose(0, 1), k=x["k"].transpose(0, 1),
                                           v=x["v"].transpose(0, 1), g=x["g"].transpose(0, 1),
                                           beta=x["beta"].transpose(0, 1), initial_state=switched,
                                           ssm_state_indices=torch.tensor([4, 1]))
    assert fla_module.fused_recurrent_kda_fwd is original
    # B = 2 rows of one token each (no cu_seqlens) is the same call as the packed one
    assert torch.equal(switched, direct) and not torch.equal(switched, pool)
