"""The replicated layers' math, weight layouts and input rules (one process, float64).

The oracle compositions below are written from the Hugging Face forwards (Qwen3NextGatedDeltaNet,
Qwen3_5GatedDeltaNet, Kimi Linear's KimiDeltaAttention) directly over `linattn.reference` ops, in
the recurrent mode (token by token), never through the layer's code: the HF key-head grouping,
repeat_interleave for grouped value attention, three separate convs for KDA, the gates as fla
writes them. They check the layer's output, input gradient and every parameter gradient.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from linattn import reference
from linattn.layers import (
    LinearAttentionConfig,
    build_layer,
    parameter_layouts,
    shard_state_dict,
    unshard_state_dict,
)
from linattn.parallel import parallel_rank_lists
from linattn.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from pytest_linattn.parity import assert_parity

SEQLENS = (5, 1, 9, 3)  # packed, one sequence of a single token
MATH_RTOL = 1e-12

CASES = {
    # name: (family, v heads per k head, kda options)
    "qwen3_next-gva3": ("qwen3_next", 3, {}),
    "qwen3_5-gva2": ("qwen3_5", 2, {}),
    "kda-gva2-lower_bound": ("kda", 2, {"gate_lower_bound": -5.0}),
    "kda-gva3-low_rank_gate": ("kda", 3, {"output_gate_rank": 5}),
}


def make_config(family, ratio, **extra):
    return LinearAttentionConfig(family, hidden_size=20, num_k_heads=4, num_v_heads=4 * ratio,
                                 head_k_dim=8, head_v_dim=6, conv_size=4, **extra)


def random_state_dict(config, seed):
    """Every parameter random (norm weights too, so a misplaced slice cannot hide), float64."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, layout in parameter_layouts(config).items():
        if name == "A_log":
            sd[name] = torch.empty(layout.shape, dtype=torch.float64).uniform_(0.2, 2.0, generator=gen).log()
        elif name == "dt_bias":
            sd[name] = 0.5 * torch.randn(layout.shape, generator=gen, dtype=torch.float64)
        elif name.endswith("norm.weight"):
            sd[name] = 1.0 + 0.2 * torch.randn(layout.shape, generator=gen, dtype=torch.float64)
        else:
            fan_in = layout.shape[-1]
            sd[name] = torch.randn(layout.shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
    return sd


def packed_inputs(config, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    cu = torch.tensor([0, *torch.tensor(SEQLENS).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    x = torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64)
    dy = torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64)
    return x, dy, cu


# ---- oracles written from the HF forwards --------------------------------------------------


def hf_gated_rms_norm(x, gate, weight, eps, act):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x * act(gate)


def oracle_gated_deltanet(p, x, cu, c):
    T, H, HV, dk, dv = x.shape[1], c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
    if c.family == "qwen3_next":
        # Qwen3NextGatedDeltaNet.fix_query_key_value_ordering
        mixed_qkvz = (x @ p["in_proj_qkvz.weight"].T).view(1, T, H, 2 * dk + 2 * dv * HV // H)
        mixed_ba = (x @ p["in_proj_ba.weight"].T).view(1, T, H, 2 * HV // H)
        q, k, v, z = torch.split(mixed_qkvz, [dk, dk, HV // H * dv, HV // H * dv], dim=3)
        b, a = torch.split(mixed_ba, [HV // H, HV // H], dim=3)
        v, z = v.reshape(1, T, -1, dv), z.reshape(1, T, -1, dv)
        b, a = b.reshape(1, T, HV), a.reshape(1, T, HV)
        mixed_qkv = torch.cat([t.reshape(1, T, -1) for t in (q, k, v)], dim=-1)
    else:  # Qwen3_5GatedDeltaNet
        mixed_qkv = x @ p["in_proj_qkv.weight"].T
        z = (x @ p["in_proj_z.weight"].T).reshape(1, T, -1, dv)
        b, a = x @ p["in_proj_b.weight"].T, x @ p["in_proj_a.weight"].T
    mixed_qkv = reference.short_conv(mixed_qkv, p["conv1d.weight"].squeeze(1), cu, activation="silu")
    q, k, v = torch.split(mixed_qkv, [c.key_dim, c.key_dim, c.value_dim], dim=-1)
    q, k, v = q.reshape(1, T, -1, dk), k.reshape(1, T, -1, dk), v.reshape(1, T, -1, dv)
    beta = b.sigmoid()
    g = -p["A_log"].exp() * F.softplus(a + p["dt_bias"])
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    o, _ = reference.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, mode="recurrent")
    o = hf_gated_rms_norm(o, z, p["norm.weight"], c.norm_eps, F.silu)
    return o.reshape(1, T, -1) @ p["out_proj.weight"].T


def oracle_kimi_delta_attention(p, x, cu, c):
    T, H, HV, dk, dv = x.shape[1], c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
    q = reference.short_conv(x @ p["q_proj.weight"].T, p["q_conv1d.weight"].squeeze(1), cu, activation="silu")
    k = reference.short_conv(x @ p["k_proj.weight"].T, p["k_conv1d.weight"].squeeze(1), cu, activation="silu")
    v = reference.short_conv(x @ p["v_proj.weight"].T, p["v_conv1d.weight"].squeeze(1), cu, activation="silu")
    # fla.ops.kda.gate: naive_kda_gate / naive_kda_lowerbound_gate
    f = ((x @ p["f_a_proj.weight"].T) @ p["f_b_proj.weight"].T).view(1, T, HV, dk) + p["dt_bias"].view(HV, dk)
    if c.gate_lower_bound is None:
        g = -p["A_log"].view(HV, 1).exp() * F.softplus(f)
    else:
        g = c.gate_lower_bound * torch.sigmoid(p["A_log"].view(HV, 1).exp() * f)
    beta = (x @ p["b_proj.weight"].T).sigmoid()
    q, k, v = q.view(1, T, H, dk), k.view(1, T, H, dk), v.view(1, T, HV, dv)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    o, _ = reference.kda(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, mode="recurrent")
    if c.output_gate_rank is None:
        gate = x @ p["g_proj.weight"].T
    else:
        gate = (x @ p["g_a_proj.weight"].T) @ p["g_b_proj.weight"].T
    o = hf_gated_rms_norm(o, gate.view(1, T, HV, dv), p["o_norm.weight"], c.norm_eps, torch.sigmoid)
    return o.reshape(1, T, -1) @ p["o_proj.weight"].T


def assert_layer_matches_oracle(config, seed, name, layer_cls=None):
    """The replicated float64 layer (`layer_cls`, default build_layer's) against the oracle composed
    here on the same weights and packed inputs: output, dx and every parameter gradient <= MATH_RTOL.
    The bug record's oracle check (bug_record.checks_model) runs it on a planted class."""
    sd = random_state_dict(config, seed)
    x, dy, cu = packed_inputs(config, seed)

    layer = build_layer(config, dtype=torch.float64) if layer_cls is None else layer_cls(config, dtype=torch.float64)
    layer.load_state_dict(sd)
    x_layer = x.clone().requires_grad_()
    y = layer(x_layer, cu)
    (y * dy).sum().backward()

    params = {n: t.clone().requires_grad_() for n, t in sd.items()}
    x_oracle = x.clone().requires_grad_()
    oracle = oracle_kimi_delta_attention if config.family == "kda" else oracle_gated_deltanet
    y_ref = oracle(params, x_oracle, cu, config)
    (y_ref * dy).sum().backward()

    assert_parity(y, y_ref, rtol=MATH_RTOL, name=f"{name} output", cu_seqlens=cu)
    assert_parity(x_layer.grad, x_oracle.grad, rtol=MATH_RTOL, name=f"{name} dx", cu_seqlens=cu)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    assert_parity(grads, {n: t.grad for n, t in params.items()}, rtol=MATH_RTOL, name=f"{name} grad")


@pytest.mark.parametrize("case", list(CASES))
def test_replicated_layer_matches_reference_composition(case):
    family, ratio, extra = CASES[case]
    assert_layer_matches_oracle(make_config(family, ratio, **extra), 1000 + list(CASES).index(case), case)


# ---- Hugging Face state dicts load as they are ----------------------------------------------

HF_KEYS = {
    "qwen3_next": {"in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log",
                   "norm.weight", "out_proj.weight"},
    "qwen3_5": {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"},
    # Kimi Linear's remote code (modeling_kimi.py): low-rank output gate, A_log as [1, 1, H, 1]
    "kda": {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
            "v_conv1d.weight", "A_log", "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "b_proj.weight",
            "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight"},
}


def hf_checkpoint(family, hidden, H, HV, dk, dv, W, gen):
    """A layer's state dict as the HF checkpoint stores it, shapes written from the HF modules."""
    kd, vd = H * dk, HV * dv

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if family == "qwen3_next":
        return {"in_proj_qkvz.weight": rand(2 * kd + 2 * vd, hidden), "in_proj_ba.weight": rand(2 * HV, hidden),
                "conv1d.weight": rand(2 * kd + vd, 1, W), "dt_bias": rand(HV), "A_log": rand(HV),
                "norm.weight": rand(dv), "out_proj.weight": rand(hidden, vd)}
    if family == "qwen3_5":
        return {"in_proj_qkv.weight": rand(2 * kd + vd, hidden), "in_proj_z.weight": rand(vd, hidden),
                "in_proj_b.weight": rand(HV, hidden), "in_proj_a.weight": rand(HV, hidden),
                "conv1d.weight": rand(2 * kd + vd, 1, W), "dt_bias": rand(HV), "A_log": rand(HV),
                "norm.weight": rand(dv), "out_proj.weight": rand(hidden, vd)}
    head_dim = dv
    return {"q_proj.weight": rand(kd, hidden), "k_proj.weight": rand(kd, hidden), "v_proj.weight": rand(vd, hidden),
            "q_conv1d.weight": rand(kd, 1, W), "k_conv1d.weight": rand(kd, 1, W), "v_conv1d.weight": rand(vd, 1, W),
            "A_log": rand(1, 1, HV, 1), "f_a_proj.weight": rand(head_dim, hidden),
            "f_b_proj.weight": rand(HV * dk, head_dim), "dt_bias": rand(HV * dk), "b_proj.weight": rand(HV, hidden),
            "g_a_proj.weight": rand(head_dim, hidden), "g_b_proj.weight": rand(vd, head_dim),
            "o_norm.weight": rand(dv), "o_proj.weight": rand(hidden, vd)}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kda"])
def test_hf_state_dict_loads_into_replicated_layer(family):
    gen = torch.Generator().manual_seed(7)
    extra = {"output_gate_rank": 8} if family == "kda" else {}
    config = LinearAttentionConfig(family, hidden_size=16, num_k_heads=2, num_v_heads=4, head_k_dim=8,
                                   head_v_dim=8, conv_size=4, **extra)
    checkpoint = hf_checkpoint(family, 16, 2, 4, 8, 8, 4, gen)
    assert set(checkpoint) == HF_KEYS[family]
    layer = build_layer(config, dtype=torch.float64)
    assert set(layer.state_dict()) == HF_KEYS[family]
    layer.load_state_dict(checkpoint, strict=True)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, checkpoint[name].reshape(value.shape)), name
    # the TP shards of a checkpoint (A_log in Kimi's shape included) go back to the same weights
    shards = [shard_state_dict(checkpoint, config, r, 2) for r in range(2)]
    back = unshard_state_dict(shards, config)
    for name, value in layer.state_dict().items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip(case, tp):
    family, ratio, extra = CASES[case]
    config = make_config(family, ratio, **extra)
    sd = random_state_dict(config, 3)
    shards = [shard_state_dict(sd, config, r, tp) for r in range(tp)]
    local = parameter_layouts(config.local(tp))
    for shard in shards:
        assert {n: tuple(t.shape) for n, t in shard.items()} == {n: l.shape for n, l in local.items()}
    back = unshard_state_dict(shards, config)
    assert set(back) == set(sd) and all(torch.equal(back[n], sd[n]) for n in sd)


def test_qwen3_next_shard_keeps_whole_key_head_groups():
    # rank 1 of 2 holds key heads 2, 3 and value heads 6..11 (3 per key head), HF grouping intact
    config = make_config("qwen3_next", 3)
    sd = random_state_dict(config, 5)
    shard = shard_state_dict(sd, config, 1, 2)
    per_head = 2 * config.head_k_dim + 2 * 3 * config.head_v_dim
    assert torch.equal(shard["in_proj_qkvz.weight"], sd["in_proj_qkvz.weight"][2 * per_head:])
    assert torch.equal(shard["A_log"], sd["A_log"][6:])
    kd, vd = config.key_dim, config.value_dim
    conv = sd["conv1d.weight"]
    expected = torch.cat([conv[kd // 2:kd], conv[kd + kd // 2:2 * kd], conv[2 * kd + vd // 2:]])
    assert torch.equal(shard["conv1d.weight"], expected)


# ---- bad input raises ValueError naming the rule --------------------------------------------


def test_unknown_family():
    with pytest.raises(ValueError, match="family must be one of"):
        LinearAttentionConfig("mamba2", hidden_size=8, num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4)


@pytest.mark.parametrize("kwargs, rule", [
    ({"num_v_heads": 6}, "num_v_heads must be a multiple of num_k_heads"),
    ({"head_k_dim": 0}, "head_k_dim must be a positive int"),
    ({"family": "qwen3_5", "gate_lower_bound": -5.0}, "apply to family 'kda' only"),
    ({"family": "kda", "gate_lower_bound": 1.0}, "gate_lower_bound must be negative"),
    ({"family": "kda", "output_gate_rank": 0}, "output_gate_rank must be None or a positive int"),
])
def test_config_rules(kwargs, rule):
    args = dict(family="qwen3_next", hidden_size=8, num_k_heads=4, num_v_heads=8, head_k_dim=4, head_v_dim=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rule):
        LinearAttentionConfig(**args)


def test_tp_must_divide_key_heads():
    config = make_config("qwen3_5", 2)
    with pytest.raises(ValueError, match="tensor parallel size must divide num_k_heads"):
        config.local(3)
    with pytest.raises(ValueError, match="tensor parallel size must divide num_k_heads"):
        shard_state_dict(random_state_dict(config, 0), config, 0, 3)


def test_state_dict_rules():
    config = make_config("kda", 2)
    sd = random_state_dict(config, 0)
    with pytest.raises(ValueError, match="tp_rank must be an int in"):
        shard_state_dict(sd, config, 2, 2)
    broken = dict(sd)
    broken.pop("f_a_proj.weight")
    with pytest.raises(ValueError, match="keys must match the layer's parameters: missing \\['f_a_proj.weight'\\]"):
        shard_state_dict(broken, config, 0, 2)
    broken = dict(sd, **{"o_proj.weight": sd["o_proj.weight"].T})
    with pytest.raises(ValueError, match="o_proj.weight must have shape"):
        shard_state_dict(broken, config, 0, 2)
    with pytest.raises(ValueError, match="shards must be a non-empty sequence"):
        unshard_state_dict([], config)


def test_hidden_states_must_match_cu_seqlens():
    config = make_config("qwen3_next", 2)
    layer = build_layer(config, dtype=torch.float64)
    x = torch.randn(1, 10, config.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match="hidden_states must hold cu_seqlens\\[-1\\] = 12 tokens, got 10"):
        layer(x, torch.tensor([0, 4, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="hidden_states must be packed as"):
        layer(x.view(2, 5, -1), torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        layer(x, torch.tensor([2, 4, 10], dtype=torch.int32))


def test_build_layer_rules():
    with pytest.raises(ValueError, match="config must be a LinearAttentionConfig"):
        build_layer({"family": "kda"})


def test_groups_tile_the_world_in_megatron_order():
    tp, cp = parallel_rank_lists(8, 2, 2)
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match="tp_size \\* cp_size must tile the world"):
        parallel_rank_lists(6, 4)


def test_mappings_are_identity_without_a_group():
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    for fn in (copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region,
               gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region):
        assert fn(x, None) is x


def test_the_same_cu_seqlens_is_checked_once_until_it_changes(monkeypatch):
    # a training step passes one cu_seqlens tensor to every layer: checked (a GPU read-back on
    # CUDA) and converted once; an in-place change or another tensor is checked again
    import linattn.layers.base as base

    calls = []
    check = base.validate_cu_seqlens
    monkeypatch.setattr(base, "validate_cu_seqlens", lambda *a, **k: calls.append(1) or check(*a, **k))
    config = LinearAttentionConfig("kda", hidden_size=16, num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    layer = build_layer(config, dtype=torch.float64)
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    first = layer(x, cu)
    assert torch.equal(layer(x, cu), first) and len(calls) == 1
    cu[1] = 7  # in place: the memo must not serve the old boundaries
    moved = layer(x, cu)
    assert len(calls) == 2 and not torch.equal(moved, first)
    assert torch.equal(layer(x, torch.tensor([0, 5, 12], dtype=torch.int32)), first) and len(calls) == 3
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, torch.tensor([0, 5, 11], dtype=torch.int32))
