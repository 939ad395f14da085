"""Weight-layout adapters (linattn.layers.adapters) and LinearAttentionConfig.from_hf_config.

- Round trips: every map, to the other layout and back, from either side, gives the same keys and
  bit-identical tensors (seeded float64 weights).
- Megatron TP: each rank's shard is the slices of every in_proj / conv1d section; shard then
  unshard is the identity for tp 1, 2, 4.
- from_hf_config on small transformers configs of each model type, and its refusals.
- Parity with the real modules in float64 on CPU, on packed sequences of equal length: transformers'
  Qwen3-Next, Qwen3.5, Kimi Linear and GLM-5.3-Flash linear attention (their torch paths), and fla's
  GatedDeltaNet and KimiDeltaAttention layers (under linattn.emulation.fla_on_cpu).
"""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from cases.layer_parity import random_state_dict
from linattn.layers import LinearAttentionConfig, build_layer
from linattn.layers.adapters import (config_from_fla_layer, from_fla_state_dict, from_hf_state_dict,
                                     from_megatron_state_dicts, qwen3_5_to_qwen3_next, qwen3_next_to_qwen3_5,
                                     to_fla_state_dict, to_hf_state_dict, to_megatron_state_dict)
from pytest_linattn import assert_parity

qwen3_next_cfg = pytest.importorskip("transformers.models.qwen3_next.configuration_qwen3_next")
qwen3_5_cfg = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")
kimi_cfg = pytest.importorskip("transformers.models.kimi_linear.configuration_kimi_linear")
glm_cfg = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")

GDN_SIZES = dict(hidden_size=20, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                 linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1)
KDA_SIZES = dict(hidden_size=20, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=3, num_hidden_layers=1)


def hf_configs():
    """One small transformers config per model type (name -> config)."""
    return {
        "qwen3_next": qwen3_next_cfg.Qwen3NextConfig(**GDN_SIZES, rms_norm_eps=1e-5),
        "qwen3_5": qwen3_5_cfg.Qwen3_5Config(text_config=dict(GDN_SIZES)),
        "kimi_linear": kimi_cfg.KimiLinearConfig(**KDA_SIZES),
        "glm5_next": glm_cfg.Glm5NextConfig(text_config=dict(KDA_SIZES, linear_lower_bound=-4.0)),
    }


def gdn_config(family, ratio=2):
    return LinearAttentionConfig(family, hidden_size=20, num_k_heads=4, num_v_heads=4 * ratio,
                                 head_k_dim=8, head_v_dim=6, conv_size=4)


def kda_config(**options):
    return LinearAttentionConfig("kda", hidden_size=20, num_k_heads=4, num_v_heads=8, head_k_dim=8,
                                 head_v_dim=6, conv_size=3, output_gate_rank=6, **options)


def random_tensors(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}


def shapes_of(state_dict):
    return {name: tuple(t.shape) for name, t in state_dict.items()}


def assert_identical(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name, t in expected.items():
        assert actual[name].shape == t.shape and actual[name].dtype == t.dtype, name
        assert torch.equal(actual[name], t), f"{name} differs"


# ---- round trips ----

# (name, project config, to the other layout, from it)
def round_trip_maps():
    maps = [
        ("qwen3_next<->qwen3_5", gdn_config("qwen3_next"), lambda sd, c: qwen3_next_to_qwen3_5(sd, c),
         lambda sd, c: qwen3_5_to_qwen3_next(sd, dataclasses.replace(c, family="qwen3_5"))),
        ("fla_gdn", gdn_config("qwen3_5"), to_fla_state_dict, from_fla_state_dict),
        ("fla_kda", kda_config(), to_fla_state_dict, from_fla_state_dict),
        ("fla_kda_bounded", kda_config(gate_lower_bound=-5.0), to_fla_state_dict, from_fla_state_dict),
    ]
    for family in ("qwen3_5", "qwen3_next"):
        for zero_centered in (False, True):
            maps.append((f"megatron_{family}{'_zero_centered' if zero_centered else ''}", gdn_config(family),
                         lambda sd, c, z=zero_centered: to_megatron_state_dict(sd, c, layernorm_zero_centered_gamma=z),
                         lambda sd, c, z=zero_centered: from_megatron_state_dicts([sd], c, layernorm_zero_centered_gamma=z)))
    for name, hf_config in hf_configs().items():
        config = LinearAttentionConfig.from_hf_config(hf_config)
        maps.append((f"hf_{name}", config, lambda sd, c, h=hf_config: to_hf_state_dict(sd, h),
                     lambda sd, c, h=hf_config: from_hf_state_dict(sd, h)))
    return maps


MAPS = round_trip_maps()
MAP_IDS = [m[0] for m in MAPS]


def assert_round_trip(actual, expected, name):
    if "zero_centered" in name:  # w - 1 + 1 rounds: the norm weight within an ulp, the rest exact
        norm = "norm.weight" if "norm.weight" in expected else "out_norm.weight"
        torch.testing.assert_close(actual.pop(norm), expected[norm], rtol=0, atol=4.5e-16)
        expected = {k: v for k, v in expected.items() if k != norm}
    assert_identical(actual, expected)


@pytest.mark.parametrize("name, config, to_other, from_other", MAPS, ids=MAP_IDS)
def test_round_trip_from_project_layout(name, config, to_other, from_other):
    project = random_state_dict(config, seed=11)
    assert_round_trip(from_other(to_other(project, config), config), project, name)


@pytest.mark.parametrize("name, config, to_other, from_other", MAPS, ids=MAP_IDS)
def test_round_trip_from_other_layout(name, config, to_other, from_other):
    other = random_tensors(shapes_of(to_other(random_state_dict(config, seed=12), config)), seed=13)
    if "fla_kda" in name:
        other["g_proj.1.bias"].zero_()  # the only value the project's bias-free output gate can hold
    assert_round_trip(to_other(from_other(other, config), config), other, name)


def test_maps_refuse_wrong_keys_and_shapes():
    config = gdn_config("qwen3_5")
    fla = to_fla_state_dict(random_state_dict(config, seed=1), config)
    with pytest.raises(ValueError, match=r"^state_dict keys must match .*missing \['g_proj.weight'\]"):
        from_fla_state_dict({k: v for k, v in fla.items() if k != "g_proj.weight"}, config)  # use_gate=False
    with pytest.raises(ValueError, match=r"^state_dict keys .*unexpected \['q_conv1d.bias'\]"):
        from_fla_state_dict({**fla, "q_conv1d.bias": torch.randn(32, dtype=torch.float64)}, config)
    with pytest.raises(ValueError, match=r"^q_proj.weight must have shape \(32, 20\)"):
        from_fla_state_dict({**fla, "q_proj.weight": torch.randn(32, 21, dtype=torch.float64)}, config)
    megatron = to_megatron_state_dict(random_state_dict(config, seed=2), config)
    with pytest.raises(ValueError, match=r"^shards\[0\] keys .*unexpected \['in_proj.bias'\]"):
        from_megatron_state_dicts([{**megatron, "in_proj.bias": torch.randn(5, dtype=torch.float64)}], config)
    with pytest.raises(ValueError, match=r"^shards must be a non-empty list"):
        from_megatron_state_dicts(megatron, config)
    with pytest.raises(ValueError, match=r"^config.family must be one of \('qwen3_5', 'kda'\)"):
        to_fla_state_dict(random_state_dict(gdn_config("qwen3_next"), seed=3), gdn_config("qwen3_next"))
    with pytest.raises(ValueError, match=r"^config.output_gate_rank must equal head_v_dim=6"):
        to_fla_state_dict(random_state_dict(kda_config(), seed=4), dataclasses.replace(kda_config(), output_gate_rank=None))


def test_fla_kda_refuses_a_nonzero_output_gate_bias():
    config = kda_config()
    fla = to_fla_state_dict(random_state_dict(config, seed=5), config)
    fla["g_proj.1.bias"] = torch.randn(config.value_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"^state_dict\['g_proj.1.bias'\] must be zero"):
        from_fla_state_dict(fla, config)


# ---- megatron TP shards ----


@pytest.mark.parametrize("tp", (1, 2, 4))
@pytest.mark.parametrize("family", ("qwen3_5", "qwen3_next"))
def test_megatron_shards_unshard_to_identity(family, tp):
    config = gdn_config(family)
    full = random_state_dict(config, seed=20 + tp)
    shards = [to_megatron_state_dict(full, config, tp_rank=r, tp_size=tp) for r in range(tp)]
    assert_identical(from_megatron_state_dicts(shards, config), full)


@pytest.mark.parametrize("tp", (1, 2, 4))
@pytest.mark.parametrize("ratio", (1, 2))
def test_megatron_rank_shard_is_each_sections_slice(ratio, tp):
    config = gdn_config("qwen3_5", ratio)
    full = random_state_dict(config, seed=30 + tp)
    kd, vd = config.key_dim, config.value_dim
    q, k, v = full["in_proj_qkv.weight"].split([kd, kd, vd])
    sections = [q, k, v, full["in_proj_z.weight"], full["in_proj_b.weight"], full["in_proj_a.weight"]]
    conv = full["conv1d.weight"].split([kd, kd, vd])
    for r in range(tp):
        shard = to_megatron_state_dict(full, config, tp_rank=r, tp_size=tp)
        expected = {
            "in_proj.weight": torch.cat([s.chunk(tp)[r] for s in sections]),
            "conv1d.weight": torch.cat([s.chunk(tp)[r] for s in conv]),
            "dt_bias": full["dt_bias"].chunk(tp)[r],
            "A_log": full["A_log"].chunk(tp)[r],
            "out_norm.weight": full["norm.weight"],
            "out_proj.weight": full["out_proj.weight"].chunk(tp, dim=1)[r],
        }
        assert_identical(shard, expected)
    zero_centered = to_megatron_state_dict(full, config, tp_rank=0, tp_size=tp, layernorm_zero_centered_gamma=True)
    assert torch.equal(zero_centered["out_norm.weight"], full["norm.weight"] - 1)


def test_megatron_state_dict_extra_state_is_skipped():
    # megatron-core's linear layers add `_extra_state` (None without Transformer Engine) to state_dict()
    config = gdn_config("qwen3_5")
    full = random_state_dict(config, seed=35)
    megatron = to_megatron_state_dict(full, config)
    with_extra = {**megatron, "in_proj._extra_state": None, "out_proj._extra_state": None}
    assert_identical(from_megatron_state_dicts([with_extra], config), full)


def test_megatron_qwen3_next_matches_qwen3_5_shards():
    config = gdn_config("qwen3_next", 3)
    full = random_state_dict(config, seed=40)
    as_qwen3_5 = qwen3_next_to_qwen3_5(full, config)
    for r in range(2):
        assert_identical(to_megatron_state_dict(full, config, tp_rank=r, tp_size=2),
                         to_megatron_state_dict(as_qwen3_5, dataclasses.replace(config, family="qwen3_5"),
                                                tp_rank=r, tp_size=2))


def test_megatron_refuses_a_tp_size_that_does_not_divide_the_heads():
    config = gdn_config("qwen3_5")
    with pytest.raises(ValueError, match=r"^tensor parallel size must divide num_k_heads: tp_size=3"):
        to_megatron_state_dict(random_state_dict(config, seed=7), config, tp_rank=0, tp_size=3)
    shard = to_megatron_state_dict(random_state_dict(config, seed=8), config, tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=r"^tensor parallel size must divide num_k_heads: tp_size=3"):
        from_megatron_state_dicts([shard] * 3, config)


def test_qwen3_next_and_qwen3_5_layouts_compute_the_same_layer():
    config = gdn_config("qwen3_next", 2)
    full = random_state_dict(config, seed=50)
    gen = torch.Generator().manual_seed(51)
    x = torch.randn(1, 12, config.hidden_size, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    expected = build_layer(config, dtype=torch.float64)
    expected.load_state_dict(full)
    actual = build_layer(dataclasses.replace(config, family="qwen3_5"), dtype=torch.float64)
    actual.load_state_dict(qwen3_next_to_qwen3_5(full, config))
    assert_parity(actual(x, cu), expected(x, cu), rtol=1e-12, name="qwen3_5 layout output", cu_seqlens=cu)


# ---- from_hf_config ----


def test_from_hf_config_reads_each_model_type():
    configs = hf_configs()
    gdn = dict(hidden_size=20, num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=6, conv_size=4)
    kda = dict(family="kda", hidden_size=20, num_k_heads=4, num_v_heads=4, head_k_dim=8, head_v_dim=8,
               conv_size=3, output_gate_rank=8)
    expected = {
        "qwen3_next": LinearAttentionConfig("qwen3_next", **gdn, norm_eps=1e-5),
        "qwen3_5": LinearAttentionConfig("qwen3_5", **gdn, norm_eps=1e-6),
        "kimi_linear": LinearAttentionConfig(**kda, norm_eps=1e-5),
        "glm5_next": LinearAttentionConfig(**kda, norm_eps=1e-5, gate_lower_bound=-4.0),
    }
    for name, hf_config in configs.items():
        assert LinearAttentionConfig.from_hf_config(hf_config) == expected[name], name
    # the text configs directly, and GLM without a lower bound
    assert LinearAttentionConfig.from_hf_config(configs["qwen3_5"].text_config) == expected["qwen3_5"]
    unbounded = glm_cfg.Glm5NextTextConfig(**KDA_SIZES, linear_lower_bound=None)
    assert LinearAttentionConfig.from_hf_config(unbounded) == expected["kimi_linear"]


def test_from_hf_config_refuses_what_the_layers_do_not_implement():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"^config.model_type must be one of .* got 'llama'"):
        LinearAttentionConfig.from_hf_config(LlamaConfig(hidden_size=32, num_attention_heads=4))
    gelu = qwen3_next_cfg.Qwen3NextConfig(**GDN_SIZES)
    gelu.hidden_act = "gelu"
    with pytest.raises(ValueError, match=r"^config.hidden_act must be 'silu'.* got 'gelu'"):
        LinearAttentionConfig.from_hf_config(gelu)
    positive = glm_cfg.Glm5NextTextConfig(**KDA_SIZES)
    positive.linear_lower_bound = 1.0
    with pytest.raises(ValueError, match=r"^config.linear_lower_bound must be None or negative"):
        LinearAttentionConfig.from_hf_config(positive)
    odd = qwen3_next_cfg.Qwen3NextConfig(**dict(GDN_SIZES, linear_num_value_heads=6))
    with pytest.raises(ValueError, match=r"^config \(qwen3_next\) gives an invalid layer: num_v_heads must be a multiple"):
        LinearAttentionConfig.from_hf_config(odd)


# ---- parity with the real modules ----

# transformers binds fla's kernels (which cannot run on this CPU) into these module-level names at
# import; each is functools.wraps-wrapped around the module's own torch function (__wrapped__)
HF_KERNEL_NAMES = {
    "qwen3_next": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "qwen3_5": ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "kimi_linear": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
    "glm5_next": ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
}


def use_hf_torch_path(monkeypatch, module, names):
    """Make a transformers modeling module call its torch functions, not fla's kernels."""
    for name in (*names, "causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(module, name, getattr(module, name).__wrapped__)


def hf_module(name, hf_config):
    import importlib

    paths = {"qwen3_next": ("qwen3_next", "Qwen3NextGatedDeltaNet"), "qwen3_5": ("qwen3_5", "Qwen3_5GatedDeltaNet"),
             "kimi_linear": ("kimi_linear", "KimiLinearDeltaAttention"),
             "glm5_next": ("glm5_next", "Glm5NextTextLinearAttention")}
    package, cls = paths[name]
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    text_config = getattr(hf_config, "text_config", hf_config)
    return module, getattr(module, cls)(text_config, 0)


def randomize_(module, seed):
    """Seeded float64 weights in the ranges the layers see in training (A = exp(A_log) in [1, 8])."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            t = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("A_log"):
                t = torch.empty(p.shape, dtype=torch.float64).uniform_(1.0, 8.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                t = 0.5 * t - 1.0
            elif "norm" in name:
                t = 1.0 + 0.2 * t
            elif name == "g_proj.1.bias":
                t = torch.zeros_like(t)  # fla KDA: the project's output gate has no bias
            else:
                t = t * p.shape[-1] ** -0.5
            p.copy_(t)
    return module


def packed_inputs(hidden, batch, seqlen, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seqlen, hidden, dtype=torch.float64, generator=gen)
    return x, torch.arange(batch + 1, dtype=torch.int32) * seqlen


# transformers' torch paths cast to float32 inside the float64 module (Qwen: the gated norm's input
# and gate, A_log and a; Kimi/GLM: the forget gate, the gated norm, and chunk_kimi_delta_attention's
# inputs), so parity stops at float32 rounding: measured 9.6e-7 (qwen3_next), 9.9e-7 (qwen3_5),
# 1.0e-6 (kimi_linear), 7.6e-7 (glm5_next) here. A wrong norm eps errs by 5e-2 to 9e-2, a wrong
# weight mapping by O(1).
HF_RTOL = 1e-5


@pytest.mark.parametrize("name", tuple(HF_KERNEL_NAMES))
def test_parity_with_transformers_module(monkeypatch, name):
    hf_config = hf_configs()[name]
    module, hf = hf_module(name, hf_config)
    use_hf_torch_path(monkeypatch, module, HF_KERNEL_NAMES[name])
    hf = randomize_(hf.double(), seed=60)
    config = LinearAttentionConfig.from_hf_config(hf_config)
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(from_hf_state_dict(hf.state_dict(), hf_config))
    batch, seqlen = 2, 70  # over one 64-token chunk of HF's chunked path
    x, cu = packed_inputs(config.hidden_size, batch, seqlen, seed=61)
    with torch.no_grad():
        expected = hf(x)
        actual = layer(x.reshape(1, batch * seqlen, -1), cu)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert_parity(actual, expected.reshape(1, batch * seqlen, -1), rtol=HF_RTOL, name=f"{name} output", cu_seqlens=cu)


def fla_layers():
    layers = pytest.importorskip("fla.layers")
    return {
        "gdn": lambda: layers.GatedDeltaNet(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4, expand_v=0.75),
        "kda_bounded": lambda: layers.KimiDeltaAttention(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4,
                                                         expand_v=0.75, conv_size=3, lower_bound=-5.0),
        "kda": lambda: layers.KimiDeltaAttention(hidden_size=20, head_dim=8, num_heads=3),
    }


@pytest.mark.parametrize("name", ("gdn", "kda_bounded", "kda"))
def test_parity_with_fla_layer(name):
    from linattn.emulation import fla_on_cpu

    fla = randomize_(fla_layers()[name]().double(), seed=70)
    config = config_from_fla_layer(fla)
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(from_fla_state_dict(fla.state_dict(), config))
    batch, seqlen = 2, 40
    x, cu = packed_inputs(config.hidden_size, batch, seqlen, seed=71)
    with torch.no_grad(), fla_on_cpu():
        expected = fla(x)[0]
    with torch.no_grad():
        actual = layer(x.reshape(1, batch * seqlen, -1), cu)
    assert_parity(actual, expected.reshape(1, batch * seqlen, -1), rtol=1e-10, name=f"fla {name} output", cu_seqlens=cu)


@pytest.mark.parametrize("option, value, match", [
    ("allow_neg_eigval", True, r"^layer.allow_neg_eigval must be False"),
    ("use_gate", False, r"^layer.use_gate must be True"),
    ("conv_bias", True, r"^layer.conv_bias must be False"),
    ("output_gate_activation", "sigmoid", r"^layer.o_norm.activation must be 'swish' or 'silu'"),
])
def test_config_from_fla_layer_refuses_options_the_layer_lacks(option, value, match):
    layers = pytest.importorskip("fla.layers")
    fla = layers.GatedDeltaNet(hidden_size=20, head_dim=8, num_heads=2, expand_v=0.75, **{option: value})
    with pytest.raises(ValueError, match=match):
        config_from_fla_layer(fla)
