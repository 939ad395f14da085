"""Head-sharded layers at TP = tp_size (gloo, CPU) against the replicated layer on the same weights.

Each family runs, in one spawn call per (family, tp_size): value heads 2x and 3x the key heads,
sequence parallel on and off, in float64 (<= 1e-10), plus one float32 case (<= 1e-5). Compared:
the output, the input gradient and every parameter gradient (the ranks' gradients unsharded with
unshard_state_dict). Inputs are packed sequences, one of them a single token.
"""

import math
import re

import pytest
import torch
import torch.distributed as dist

from linattn.layers import (
    LinearAttentionConfig,
    build_layer,
    parameter_layouts,
    shard_state_dict,
    unshard_state_dict,
)
from linattn.parallel import new_groups
from pytest_linattn.parity import assert_parity

FAMILIES = ("qwen3_next", "qwen3_5", "kda")
SEQLENS = (5, 1, 7, 3)  # 16 tokens: divisible by TP = 2 and 4 for sequence parallel
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# KDA variants ride along the head ratios: the bounded gate with a full-rank output gate, and
# Kimi Linear's unbounded gate with a low-rank (replicated g_a_proj) output gate
KDA_OPTIONS = {2: {"gate_lower_bound": -5.0}, 3: {"output_gate_rank": 5}}


def make_config(family, ratio):
    extra = KDA_OPTIONS[ratio] if family == "kda" else {}
    # norm_eps 1e-5 (fla's default): the gated RMSNorm's backward scales by up to 1/sqrt(eps) on a
    # near-zero recurrence output (the one-token sequence), which in float32 turns rounding-level
    # differences into ~1e-5 gradient errors at 1e-6; float64 is unaffected
    return LinearAttentionConfig(family, hidden_size=20, num_k_heads=4, num_v_heads=4 * ratio,
                                 head_k_dim=8, head_v_dim=6, conv_size=4, norm_eps=1e-5, **extra)


def random_state_dict(config, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, layout in parameter_layouts(config).items():
        t = torch.randn(layout.shape, generator=gen, dtype=torch.float64)
        if name == "A_log":
            t = torch.empty(layout.shape, dtype=torch.float64).uniform_(0.2, 2.0, generator=gen).log()
        elif name == "dt_bias":
            t = 0.5 * t
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        else:
            t = t / math.sqrt(layout.shape[-1])
        sd[name] = t.to(dtype)
    return sd


def make_cases(family):
    cases = []
    for ratio in (2, 3):
        for sp in (False, True):
            cases.append(dict(family=family, ratio=ratio, sp=sp, dtype=torch.float64))
    cases.append(dict(family=family, ratio=3, sp=True, dtype=torch.float32))
    for i, case in enumerate(cases):
        config = make_config(family, case["ratio"])
        seed = 100 * FAMILIES.index(family) + i
        gen = torch.Generator().manual_seed(seed + 50)
        cu = torch.tensor([0, *torch.tensor(SEQLENS).cumsum(0).tolist()], dtype=torch.int32)
        T = int(cu[-1])
        case.update(
            name=f"{family}-gva{case['ratio']}-{'sp' if case['sp'] else 'nosp'}-{str(case['dtype'])[6:]}",
            config=config,
            state_dict=random_state_dict(config, seed, case["dtype"]),
            cu_seqlens=cu,
            x=torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64).to(case["dtype"]),
            dy=torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64).to(case["dtype"]),
        )
    return cases


def run_layer(layer, x, dy, cu_seqlens):
    x = x.clone().requires_grad_()
    y = layer(x, cu_seqlens)
    (y * dy).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def run_tp_cases(cases):
    """On every rank: this rank's shard of each case's layer, forward and backward."""
    tp_size, rank = dist.get_world_size(), dist.get_rank()
    tp_group, _ = new_groups(tp_size)
    results = []
    for case in cases:
        config, sp = case["config"], case["sp"]
        layer = build_layer(config, tp_group=tp_group, sequence_parallel=sp, dtype=case["dtype"])
        layer.load_state_dict(shard_state_dict(case["state_dict"], config, rank, tp_size))
        x, dy = case["x"], case["dy"]
        if sp:  # rank i holds the i-th contiguous slice of the packed tokens
            x, dy = x.chunk(tp_size, dim=1)[rank], dy.chunk(tp_size, dim=1)[rank]
        y, dx, grads = run_layer(layer, x, dy, case["cu_seqlens"])
        results.append(dict(y=y, dx=dx, grads=grads))
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_layer_matches_replicated(spawn, tp_size, family):
    cases = make_cases(family)
    per_rank = spawn(run_tp_cases, tp_size, cases)
    for i, case in enumerate(cases):
        config, cu, rtol = case["config"], case["cu_seqlens"], RTOL[case["dtype"]]
        replicated = build_layer(config, dtype=case["dtype"])
        replicated.load_state_dict(case["state_dict"])
        y_ref, dx_ref, grads_ref = run_layer(replicated, case["x"], case["dy"], cu)

        ranks = [r[i] for r in per_rank]
        label = f"tp{tp_size}/{case['name']}"
        if case["sp"]:
            assert_parity(torch.cat([r["y"] for r in ranks], dim=1), y_ref, rtol=rtol, name=f"{label} output", cu_seqlens=cu)
            assert_parity(torch.cat([r["dx"] for r in ranks], dim=1), dx_ref, rtol=rtol, name=f"{label} dx", cu_seqlens=cu)
        else:  # every rank holds the whole all-reduced output and input gradient
            for rank, r in enumerate(ranks):
                assert_parity(r["y"], y_ref, rtol=rtol, name=f"{label} output rank{rank}", cu_seqlens=cu)
                assert_parity(r["dx"], dx_ref, rtol=rtol, name=f"{label} dx rank{rank}", cu_seqlens=cu)
        grads = unshard_state_dict([r["grads"] for r in ranks], config)
        assert_parity(grads, grads_ref, rtol=rtol, name=f"{label} grad")
        # replicated weights: every rank must hold the same TP-summed gradient
        for name, layout in parameter_layouts(config).items():
            if layout.split == "replicated":
                for rank, r in enumerate(ranks[1:], start=1):
                    assert torch.equal(r["grads"][name], ranks[0]["grads"][name]), f"{label} {name} rank{rank}"


# ---- rules that need a process group ---------------------------------------------------------


def _error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def run_group_rules():
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_group, _ = new_groups(world)
    config = make_config("qwen3_5", 2)
    errors = {}
    odd_heads = LinearAttentionConfig("kda", hidden_size=8, num_k_heads=3, num_v_heads=6, head_k_dim=4, head_v_dim=4)
    errors["tp_heads"] = _error_of(lambda: build_layer(odd_heads, tp_group=tp_group))
    layer = build_layer(config, tp_group=tp_group, sequence_parallel=True, dtype=torch.float64)
    x = torch.randn(1, 3, config.hidden_size, dtype=torch.float64)
    errors["sp_divisible"] = _error_of(lambda: layer(x, torch.tensor([0, 2, 3 * world + 1], dtype=torch.int32)))
    errors["sp_tokens"] = _error_of(lambda: layer(x, torch.tensor([0, 4 * world], dtype=torch.int32)))
    errors["tile"] = _error_of(lambda: new_groups(world + 1))
    _, cp_group = new_groups(1, world)
    errors["cp"] = _error_of(lambda: build_layer(config, cp_group=cp_group))
    return errors


def test_rules_with_process_groups(spawn):
    per_rank = spawn(run_group_rules, 2)
    rules = {
        "tp_heads": "tensor parallel size must divide num_k_heads",
        "sp_divisible": "sequence parallel needs the total token count divisible by the TP size",
        "sp_tokens": "hidden_states must hold cu_seqlens\\[-1\\] / tp_size = 4 tokens under sequence parallel, got 3",
        "tile": "tp_size \\* cp_size must tile the world",
        "cp": "context parallelism is not yet supported",
    }
    for errors in per_rank:
        for key, rule in rules.items():
            assert errors[key] is not None, f"{key}: no ValueError"
            assert re.search(rule, errors[key]), f"{key}: {errors[key]}"
