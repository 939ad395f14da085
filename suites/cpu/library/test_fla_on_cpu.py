"""fla-based layers on the CPU in float64 under the fla_on_cpu fixture, against the project's
replicated layer with the same weights (through the fla / transformers name maps): every output
and gradient <= 1e-10, on packed sequences with a length-1 sequence.

- fla's own GatedDeltaNet and KimiDeltaAttention (unbounded and bounded gate);
- transformers' Qwen3NextGatedDeltaNet with fla installed (it then calls fla's kernels);
- layers written on fla's CP API (build_cp_context, cp_context=) under the sharded-parity harness,
  against fla's replicated layer: KDA at CP 2 and 4, a head-sharded GDN at TP 2 x CP 2, in fla's
  two layouts (contiguous, fla-zigzag); the same GDN fed the per-sequence zigzag is told so.
"""

import functools

import pytest
import torch

from cases.layer_parity import random_state_dict, run_layer
from linattn import kernels
from linattn.layers import LinearAttentionConfig, build_layer, from_fla_state_dict, from_hf_state_dict, to_hf_state_dict
from pytest_linattn import Placement, assert_parity, assert_sharded_parity
from pytest_linattn.parity import capture_records

RTOL = 1e-10
# transformers' Qwen3-Next module casts to float32 itself (A_log.float(), a.float() in the decay
# gate; the gated norm's .to(torch.float32)), so its float64 run has a float32 floor: measured
# 8e-8 on the output. Every other check here is float64 end to end.
HF_FLOAT32_CASTS_RTOL = 1e-6
CU_SEQLENS = torch.tensor([0, 1, 9, 16, 24], dtype=torch.int32)  # a length-1 sequence; 8 tokens per CP-2 rank
FLA_GATE_BIAS = "g_proj.1.bias"  # fla KDA's output-gate bias: the project's layer has none


def _inputs(hidden, seed, T=int(CU_SEQLENS[-1])):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, T, hidden, generator=gen, dtype=torch.float64) for _ in range(2))


def _reference(config, state_dict, x, dy):
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(state_dict)
    return run_layer(layer, x, dy, CU_SEQLENS)


def _fla_grads(layer, config):
    grads = {n: p.grad for n, p in layer.named_parameters() if n != FLA_GATE_BIAS}
    if FLA_GATE_BIAS in dict(layer.named_parameters()):
        grads[FLA_GATE_BIAS] = torch.zeros_like(layer.g_proj[1].bias)  # no counterpart to compare with
    return from_fla_state_dict(grads, config)


@pytest.mark.parametrize("kind, options", [
    ("gdn", {}),
    ("kda", {}),
    ("kda", {"lower_bound": -5.0, "safe_gate": True}),
], ids=["gated_deltanet", "kda", "kda-safe_gate"])
def test_fla_layer_matches_project_layer(fla_on_cpu, kind, options):
    from clients.fla_layers import fla_layer

    layer, config, state_dict = fla_layer(kind, seed=11, **options)
    x, dy = _inputs(config.hidden_size, seed=12)
    x_fla = x.clone().requires_grad_()
    y, *_ = layer(x_fla, cu_seqlens=CU_SEQLENS.long())
    (y * dy).sum().backward()

    y_ref, dx_ref, grads_ref = _reference(config, state_dict, x, dy)
    assert_parity(y, y_ref, rtol=RTOL, name=f"fla {kind} output", cu_seqlens=CU_SEQLENS)
    assert_parity(x_fla.grad, dx_ref, rtol=RTOL, name=f"fla {kind} dx", cu_seqlens=CU_SEQLENS)
    assert_parity(_fla_grads(layer, config), grads_ref, rtol=RTOL, name=f"fla {kind} grad")


def test_transformers_qwen3_next_with_fla_matches_project_layer(fla_on_cpu):
    """With fla installed transformers binds fla's chunk_gated_delta_rule at import time, in a
    closure; the fixture reaches it there. One sequence: the HF module takes [B, T, hidden]."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    hf_config = Qwen3NextConfig(hidden_size=20, linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                rms_norm_eps=1e-6, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=32)
    module = hf.Qwen3NextGatedDeltaNet(hf_config, layer_idx=0).double()
    config = LinearAttentionConfig.from_hf_config(hf_config)
    state_dict = random_state_dict(config, seed=21)
    module.load_state_dict(to_hf_state_dict(state_dict, hf_config))
    assert _emulation_reached(hf.torch_chunk_gated_delta_rule, "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule")
    x, dy = _inputs(config.hidden_size, seed=22, T=13)
    x_hf = x.clone().requires_grad_()
    y = module(x_hf)
    (y * dy).sum().backward()

    cu = torch.tensor([0, 13], dtype=torch.int32)
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(state_dict)
    y_ref, dx_ref, grads_ref = run_layer(layer, x, dy, cu)
    assert_parity(y, y_ref, rtol=HF_FLOAT32_CASTS_RTOL, name="hf qwen3_next output", cu_seqlens=cu)
    assert_parity(x_hf.grad, dx_ref, rtol=HF_FLOAT32_CASTS_RTOL, name="hf qwen3_next dx", cu_seqlens=cu)
    grads = from_hf_state_dict({n: p.grad for n, p in module.named_parameters()}, hf_config)
    assert_parity(grads, grads_ref, rtol=HF_FLOAT32_CASTS_RTOL, name="hf qwen3_next grad")


def _emulation_reached(fn, key):
    """The emulated op sits in fn's closure, where transformers keeps fla's kernel."""
    from linattn.emulation.patching import _closure_cells, patch_table

    emulated = patch_table()[key]
    return any(cell.cell_contents is emulated for cell in _closure_cells(fn))


@pytest.mark.cp_sizes(2, 4)
@pytest.mark.parametrize("options", [{}, {"lower_bound": -5.0, "safe_gate": True}], ids=["kda", "kda-safe_gate"])
def test_fla_context_parallel_kda_matches_replicated(fla_on_cpu, spawn, cp_size, options):
    # fla's two CP layouts; CU_SEQLENS' sequences cross the ranks' pieces and fla-zigzag's intervals
    from clients.fla_layers import fla_forward, fla_kda_client, fla_layer

    layer, config, _ = fla_layer("kda", seed=31 + cp_size, **options)
    placements = [Placement(cp=cp_size), Placement(cp=cp_size, cp_layout="fla-zigzag")]
    assert_sharded_parity(spawn, fla_kda_client(**options), layer, placements, CU_SEQLENS,
                          hidden_size=config.hidden_size, seed=32 + cp_size, rtol=RTOL, reference_forward=fla_forward,
                          name="fla kda")


def test_fla_head_sharded_gdn_matches_replicated(fla_on_cpu, spawn, packed_seqlens):
    # the fla client of docs/getting-started.md (at smaller sizes): TP 2, CP 2 in fla's two layouts, TP 2 x CP 2, against fla's
    # replicated GatedDeltaNet; the packing has sequences across every interval edge
    from clients.fla_layers import fla_forward, fla_gdn_client, fla_layer

    layer, config, _ = fla_layer("gdn", seed=41)
    cu = packed_seqlens(32, 6, cp_size=2, layout="fla-zigzag", seed=5)
    placements = [Placement(tp=2)] + [Placement(tp=tp, cp=2, cp_layout=layout) for tp in (1, 2)
                                      for layout in ("contiguous", "fla-zigzag")]
    assert_sharded_parity(spawn, fla_gdn_client(), layer, placements, cu, hidden_size=config.hidden_size, seed=42,
                          rtol=RTOL, world_size=4, reference_forward=fla_forward, name="fla gdn")


def test_fla_layer_fed_the_wrong_layout_says_the_layouts_differ(fla_on_cpu, spawn):
    # the trap: fla's build_cp_context(layout="zigzag") under the per-sequence zigzag placement.
    # On one sequence the two layouts hold the same tokens and the layer passes; on two it fails
    # everywhere, and the message says which layout the layer has.
    from clients.fla_layers import fla_forward, fla_gdn_client, fla_layer

    layer, config, _ = fla_layer("gdn", seed=43)
    run = functools.partial(assert_sharded_parity, spawn, fla_gdn_client(fla_layout="zigzag"), layer,
                            [Placement(cp=2, cp_layout="zigzag")], hidden_size=config.hidden_size, seed=44,
                            rtol=RTOL, reference_forward=fla_forward, name="fla gdn")
    run([0, 16])
    with capture_records(), pytest.raises(AssertionError) as info:
        run([0, 8, 16])
    note, report = str(info.value).split("\n\n", 1)
    assert note.startswith("the layouts differ: the layer lays tokens out as cp_layout='fla-zigzag' does (the whole "
                           "packed batch cut in 2*cp intervals, rank r holding intervals r and 2*cp-1-r; fla's "
                           "build_cp_context(layout='zigzag')), this placement as 'zigzag' does (each sequence")
    assert note.endswith("test it with Placement(cp_layout='fla-zigzag'), or give the layer this layout")
    assert report.startswith("parity failed for case fla gdn/cp2-zigzag/seed44: 3 failing check(s)")
    # a conv weight's gradient [D, 1, W] is located by index, not as batch / token / feature
    conv = next(line for line in report.splitlines() if line.strip().startswith("q_conv1d.weight"))
    assert "at index (" not in conv and "index (" in conv and not {"batch", "token", "feature"} & set(conv.split())


def test_transformers_closure_is_restored_on_exit():
    """The switch reaches fla's kernel in transformers' closure while active, and puts the
    original back on exit."""
    import fla.ops.gated_delta_rule as fla_gdn
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from linattn.emulation import fla_on_cpu

    original = fla_gdn.chunk_gated_delta_rule
    key = "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule"

    def holds(fn, obj):
        from linattn.emulation.patching import _closure_cells

        return any(cell.cell_contents is obj for cell in _closure_cells(fn))

    assert holds(hf.torch_chunk_gated_delta_rule, original)
    with fla_on_cpu():
        assert _emulation_reached(hf.torch_chunk_gated_delta_rule, key)
        assert not holds(hf.torch_chunk_gated_delta_rule, original)
    assert holds(hf.torch_chunk_gated_delta_rule, original)
    assert fla_gdn.chunk_gated_delta_rule is original


@pytest.mark.parametrize("op, lower_bound", [("kda", None), ("kda", -5.0), ("gated_delta_rule", None)])
def test_the_projects_fla_calls_compute_what_its_torch_path_does(fla_on_cpu, op, lower_bound):
    # linattn.kernels' CUDA variants, run on CPU tensors under the emulation (itself checked
    # against fla's kernels on a GPU): fla's argument names, the in-kernel gate and beta sigmoid,
    # the [V, K] state layout they pass, the states transposed back. A_log and dt_bias reach fla
    # in float32, hence the bound.
    from linattn.kernels import _delta_rules

    gen = torch.Generator().manual_seed(5)
    T, H, HV, K, V = int(CU_SEQLENS[-1]), 2, 4, 8, 6
    per_channel = op == "kda"
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    raw = torch.randn(1, T, HV, *((K,) if per_channel else ()), generator=gen, dtype=torch.float64)
    logits = torch.randn(1, T, HV, generator=gen, dtype=torch.float64)
    h0 = torch.randn(len(CU_SEQLENS) - 1, HV, K, V, generator=gen, dtype=torch.float64)
    A_log = torch.rand(HV, generator=gen, dtype=torch.float64).add(0.5)
    dt_bias = torch.randn(HV * K if per_channel else HV, generator=gen, dtype=torch.float64)
    gate = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    if lower_bound is not None:
        gate["lower_bound"] = lower_bound
    common = dict(initial_state=h0, output_final_state=True, cu_seqlens=CU_SEQLENS, use_qk_l2norm=True)
    o_torch, s_torch = getattr(kernels, op)(q, k, v, raw, logits, **common, **gate)
    fla_call = _delta_rules._kda_fla if per_channel else _delta_rules._gated_delta_rule_fla
    extra = (lower_bound,) if per_channel else ()
    o_fla, s_fla = fla_call(q, k, v, raw, logits, None, h0, True, CU_SEQLENS, True, True, A_log, dt_bias, *extra, True)
    assert s_fla.shape == s_torch.shape
    assert_parity({"o": o_fla, "final_state": s_fla}, {"o": o_torch, "final_state": s_torch}, rtol=1e-6,
                  name=f"{op} fla call under the emulation")
