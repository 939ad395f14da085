"""Head pairing (linattn.heads, LinearAttentionConfig.head_pairing): which key head each value
head reads when a layer has more value heads than key heads.

    grouped  value head j reads key head j // r (r = HV / H): transformers' Qwen3-Next and Qwen3.5
             modules (repeat_interleave), fla's kernels, every family's default
    tiled    value head j reads key head j % H: llama.cpp's GGUF layout of Qwen3.5

Pinned here: the float64 references index the key head by the convention (against a per-head
loop); the permutation fla's kernels run a tiled layer through equals the reference's direct
indexing (forward, state, in-kernel gate); a tiled layer on llama.cpp's reordered weights is the
grouped layer, and on the grouped layer's own weights it is another layer (test_adapters.py pins
the grouped layer to transformers' Qwen3-Next and Qwen3.5 modules at 2 value heads per key head,
and from_hf_config gives grouped); TP parity of every
family under each convention at TP 2 (2 of 4 key heads per rank) and beyond the key heads (TP 4 on
2), and CP 2 of tiled layers; the head-pairing check (prefill and a decode step at TP 2, observed
pairing and parity against the float64 reference of that convention) for every family under each
convention. The plants of the other convention (llama.cpp #21732's split, sglang #36722's decode
index) are the bug record's (suites/bug_record/plants_heads.py).
"""

import dataclasses

import pytest
import torch

from cases.layer_parity import FAMILIES, linattn_state_path, make_case, random_state_dict
from linattn import kernels, reference
from linattn.heads import HEAD_PAIRINGS, key_head_of, to_grouped
from linattn.kernels._delta_rules import _grouped_around
from linattn.layers import (LinearAttentionConfig, build_layer, reorder_value_heads, to_fla_state_dict,
                            to_megatron_state_dict)
from pytest_linattn.harness import Placement, assert_head_pairing, assert_parity_cases
from pytest_linattn.parity import assert_parity

F64 = torch.float64
RTOL = 1e-10
PAIRINGS = tuple(HEAD_PAIRINGS)


def pairing_config(family, pairing, num_k_heads=4, ratio=2):
    extra = {"gate_lower_bound": -5.0} if family == "kda" else {}
    return LinearAttentionConfig(family, hidden_size=16, num_k_heads=num_k_heads, num_v_heads=num_k_heads * ratio,
                                 head_k_dim=8, head_v_dim=6, conv_size=4, norm_eps=1e-5, head_pairing=pairing, **extra)


def delta_inputs(per_channel, H=2, HV=6, seed=0, lengths=(4, 7)):
    gen = torch.Generator().manual_seed(seed)
    T, K, V = sum(lengths), 4, 3
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen, dtype=F64)
    g = -torch.rand(1, T, HV, *((K,) if per_channel else ()), generator=gen, dtype=F64)
    beta = torch.rand(1, T, HV, generator=gen, dtype=F64)
    h0 = torch.randn(len(lengths), HV, K, V, generator=gen, dtype=F64)
    return q, k, v, g, beta, h0, torch.tensor([0, *lengths]).cumsum(0)


# ---- the references and the kernels' entry ----------------------------------------------------------


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
@pytest.mark.parametrize("pairing", PAIRINGS)
def test_reference_reads_the_key_head_its_pairing_names(op, pairing):
    # each value head alone (H = HV = 1, token by token) with the key head the convention names equals
    # its head of the whole run, chunked and token by token
    q, k, v, g, beta, h0, cu = delta_inputs(op == "kda")
    H, HV = q.shape[2], v.shape[2]
    fn = getattr(reference, op)
    runs = {mode: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True,
                     mode=mode, head_pairing=pairing) for mode in ("chunk", "recurrent")}
    for j in range(HV):
        i = key_head_of(j, H, HV, pairing)
        o_j, S_j = fn(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, j:j + 1], g[:, :, j:j + 1], beta[:, :, j:j + 1],
                      initial_state=h0[:, j:j + 1], output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True,
                      mode="recurrent")
        for mode, (o, S) in runs.items():
            assert_parity({"output": o[:, :, j:j + 1], "state": S[:, j:j + 1]}, {"output": o_j, "state": S_j},
                          rtol=1e-12, name=f"{op} {pairing} {mode} value head {j} (key head {i})", activations=False)


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_grouped_kernels_run_a_tiled_layer_through_the_permutation(op):
    # fla's kernels pair grouped: on CUDA a tiled call moves v, g, beta, the states, A_log and dt_bias
    # into grouped order around them. That path, here over the grouped reference, equals the tiled
    # reference's own indexing: output, final state, and the in-kernel gate's per-head parameters
    q, k, v, g, beta, h0, cu = delta_inputs(op == "kda", seed=1)
    HV, K = v.shape[2], q.shape[3]
    A_log = torch.linspace(-1.0, 1.0, HV, dtype=F64)
    dt_bias = torch.linspace(-0.5, 0.5, HV * (K if op == "kda" else 1), dtype=F64)
    entry = getattr(kernels, op)
    gate = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    want = entry(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True,
                 head_pairing="tiled", **gate)
    got = _grouped_around(entry, q, k, v, g, beta, None, h0, True, cu, True, head_pairing="tiled", **gate)
    assert_parity({"o": got[0], "state": got[1]}, {"o": want[0], "state": want[1]}, rtol=1e-13,
                  name=f"{op} grouped kernel around a tiled layer", activations=False)


def test_head_pairing_rules():
    with pytest.raises(ValueError, match=r"head_pairing must be one of 'grouped' \(value head j reads key head "
                                         r"j // \(num_v_heads / num_k_heads\)\); 'tiled' .*, got 'interleaved'"):
        pairing_config("qwen3_5", "interleaved")
    assert LinearAttentionConfig("qwen3_5", 16, 4, 8, 8, 6).head_pairing == "grouped"  # every checkpoint's
    q, k, v, g, beta, _, cu = delta_inputs(False)
    with pytest.raises(ValueError, match="head_pairing must be one of"):
        kernels.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, head_pairing=None)
    # fla's layers and Megatron's GDN pair grouped: a tiled layer's weights are refused, with the way out
    config = pairing_config("qwen3_5", "tiled")
    sd = random_state_dict(config, 1)
    for convert in (to_fla_state_dict, to_megatron_state_dict):
        with pytest.raises(ValueError, match=r"config.head_pairing must be 'grouped' for .* reorder_value_heads"):
            convert(sd, config)


# ---- the facts the defaults rest on -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiled_layer_on_reordered_weights_is_the_grouped_layer(family):
    # reorder_value_heads(.., "tiled") is llama.cpp's GGUF conversion of Qwen3.5 (_reorder_v_heads):
    # grouped value head k * r + m becomes tiled value head m * H + k; the layers compute the same
    grouped = pairing_config(family, "grouped", num_k_heads=2, ratio=3)
    tiled = dataclasses.replace(grouped, head_pairing="tiled")
    sd = random_state_dict(grouped, 7)
    sd_tiled = reorder_value_heads(sd, grouped, "tiled")
    H, r = 2, 3
    moved = {"qwen3_next": "in_proj_ba.weight", "qwen3_5": "in_proj_b.weight", "kda": "b_proj.weight"}[family]
    def b_rows(weights):  # the b projection's rows, one per value head (qwen3_next: [b r | a r] per key head)
        w = weights[moved]
        return w if family != "qwen3_next" else w.view(H, 2, r, -1)[:, 0].reshape(H * r, -1)

    rows, rows_tiled = b_rows(sd), b_rows(sd_tiled)
    for k in range(H):
        for m in range(r):
            assert torch.equal(rows_tiled[m * H + k], rows[k * r + m]), (k, m)
    back = reorder_value_heads(sd_tiled, tiled, "grouped")
    assert all(torch.equal(back[n], sd[n]) for n in sd)
    layers = {}
    for key, config, weights in (("grouped", grouped, sd), ("tiled", tiled, sd_tiled), ("tiled, grouped weights",
                                                                                       tiled, sd)):
        layers[key] = build_layer(config, dtype=F64)
        layers[key].load_state_dict(weights)
    x = torch.randn(1, 11, 16, generator=torch.Generator().manual_seed(8), dtype=F64)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    with torch.no_grad():
        y, state = layers["grouped"](x, cu, None, output_final_state=True)
        y_tiled, state_tiled = layers["tiled"](x, cu, None, output_final_state=True)
        y_step, _ = layers["grouped"].step(x[:, :2], state)
        y_step_tiled, _ = layers["tiled"].step(x[:, :2], state_tiled)
        y_other = layers["tiled, grouped weights"](x, cu)
    assert float((y_other - y).norm() / y.norm()) > 0.1  # the pairing matters: the same weights, another layer
    recurrent = to_grouped(state_tiled.recurrent, H, H * r, "tiled", dim=1)
    assert_parity({"output": y_tiled, "decode output": y_step_tiled, "recurrent state": recurrent},
                  {"output": y, "decode output": y_step, "recurrent state": state.recurrent},
                  rtol=1e-12, name=f"{family} tiled on reordered weights", activations=False)


# ---- sharded layers: TP and CP parity, the decode path ----------------------------------------------


def test_tp_and_cp_parity_of_each_family_under_each_pairing(spawn):
    # TP 2 holds 2 of the 4 key heads per rank (and the value heads reading them: a tiled rank's
    # are the r tiles' slots of its key heads); CP 2 runs the CP op's permutation around the grouped
    # exchange; one spawn call for all
    cu = torch.tensor([0, 5, 1, 7, 3]).cumsum(0).to(torch.int32)
    cases = []
    for i, family in enumerate(FAMILIES):
        for j, pairing in enumerate(PAIRINGS):
            cases.append(make_case(pairing_config(family, pairing), cu, seed=300 + 10 * i + j, tp=2, rtol=RTOL,
                                   name=f"{family}/{pairing}"))
        if family != "qwen3_next":  # the CP op's permutation, for each recurrence (GDN's, KDA's)
            cases.append(make_case(pairing_config(family, "tiled"), cu, seed=350 + i, cp=2, rtol=RTOL,
                                   name=f"{family}/tiled"))
    assert_parity_cases(spawn, cases)


def test_tp_parity_beyond_the_key_heads_under_tiled_pairing(spawn):
    # TP 4 on 2 key heads: each key head on 2 ranks, which split its value heads (tiled: its tiles' slots)
    cu = torch.tensor([0, 6, 1, 9]).cumsum(0).to(torch.int32)
    cases = [make_case(pairing_config(family, "tiled", num_k_heads=2, ratio=4), cu, seed=400 + i, tp=4, rtol=RTOL,
                       name=f"{family}/tiled") for i, family in enumerate(("qwen3_next", "qwen3_5"))]
    assert_parity_cases(spawn, cases)


@pytest.mark.parametrize("pairing", PAIRINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_path_pairs_heads_as_its_config_says(spawn, family, pairing):
    # the head-pairing check at TP 2: a prefill call and a decode step on the ranks, the pairing each
    # observes (a value head's state moves with the weights of the key head it reads), and both runs
    # against the float64 reference of that convention
    config = pairing_config(family, pairing)
    layer = build_layer(config, dtype=F64)
    layer.load_state_dict(random_state_dict(config, 11))
    assert_head_pairing(spawn, linattn_state_path(config), layer, [Placement(tp=2)], seed=12, rtol=RTOL,
                        name=f"{family}/{pairing}")


def test_head_pairing_check_rules():
    # bad input fails before any rank runs, naming the argument and the rule
    config = pairing_config("qwen3_5", "grouped")
    layer = build_layer(config, dtype=F64)
    path = linattn_state_path(config)
    square = dataclasses.replace(config, num_v_heads=4)
    with pytest.raises(ValueError, match="config must have more value heads than key heads .* every pairing is the "
                                         "identity"):
        assert_head_pairing(None, linattn_state_path(square), build_layer(square), [Placement(tp=2)], seed=1, rtol=RTOL)
    with pytest.raises(ValueError, match="config must be the layer's LinearAttentionConfig"):
        assert_head_pairing(None, path, torch.nn.Linear(2, 2), [Placement(tp=2)], seed=1, rtol=RTOL)
    with pytest.raises(ValueError, match="placement cp2-contiguous: the head-pairing check runs TP placements"):
        assert_head_pairing(None, path, layer, [Placement(cp=2)], seed=1, rtol=RTOL)
    with pytest.raises(ValueError, match="placement tp2: tp > 1 needs StatePath.shard_state"):
        assert_head_pairing(None, dataclasses.replace(path, shard_state=None, unshard_state=None), layer,
                            [Placement(tp=2)], seed=1, rtol=RTOL)
