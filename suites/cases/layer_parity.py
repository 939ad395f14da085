"""Layer parity cases shared by the layer tests of every suite (cpu, gpu-1, gpu-2, gpu-4).

The project's layer is one client of the public harness, `pytest_linattn.harness` (which
states the placement, token-layout and gradient rules). One idea each:

- `make_config`, `random_state_dict`: the layer under test and its weights (float64 values;
  rounded to bf16 first for the GPU suites, so the float64 reference sees what the kernels see).
- `linattn_layer`: the harness's ShardedLayer for a config (build_layer, shard_state_dict,
  unshard_state_dict; the "replicated" split of parameter_layouts is TP-replicated).
- `make_case`: one placement (tp, cp, layout, sp, dtype) of one layer on one packed batch, as a
  harness ParityCase; run them with `pytest_linattn.harness.assert_parity_cases`.
- `linattn_state_path`: the harness's StatePath for a config (the layer's own prefill and decode
  calls, shard_layer_state / unshard_layer_state), for `assert_continuation_parity`.
"""

from __future__ import annotations

import functools
import math
import re

import torch

from cases.gpu import BF16_RTOL

from linattn.layers import (
    LinearAttentionConfig,
    build_layer,
    parameter_layouts,
    shard_layer_state,
    shard_state_dict,
    unshard_layer_state,
    unshard_state_dict,
)
from pytest_linattn.parity import assert_parity
from pytest_linattn.harness import ParityCase, Placement, ShardedLayer, StatePath, rank_token_index

FAMILIES = ("qwen3_next", "qwen3_5", "kda")

# KDA variants ride along the head ratios (value heads per key head), so every test that runs
# ratios 1, 2 and 3 runs both gates and both output gates: 1: bounded gate, low-rank (replicated
# g_a_proj) output gate; 2: bounded gate, full-rank output gate; 3: Kimi Linear's unbounded gate
# with a low-rank output gate
KDA_OPTIONS = {
    1: {"gate_lower_bound": -5.0, "output_gate_rank": 5},
    2: {"gate_lower_bound": -5.0},
    3: {"output_gate_rank": 5},
}


def make_config(family, ratio):
    """The CPU suites' tiny layer: 4 key heads, `ratio` value heads per key head."""
    extra = KDA_OPTIONS[ratio] if family == "kda" else {}
    # norm_eps 1e-5 (fla's default): the gated RMSNorm's backward scales by up to 1/sqrt(eps) on a
    # near-zero recurrence output (the one-token sequence), which in float32 turns rounding-level
    # differences into ~1e-5 gradient errors at 1e-6; float64 is unaffected
    return LinearAttentionConfig(family, hidden_size=20, num_k_heads=4, num_v_heads=4 * ratio,
                                 head_k_dim=8, head_v_dim=6, conv_size=4, norm_eps=1e-5, **extra)


# The head shape of every GPU suite (key heads, value heads, dk, dv): fla autotunes per head shape,
# so one shape (and its TP=2 shard) lets a fresh machine tune each kernel twice, not per test.
GPU_HEADS = (4, 8, 64, 128)


# The families of the TP/CP GPU suites (gpu-2, gpu-4), with each one's config options: KDA with
# the bounded gate.
GPU_PARALLEL_FAMILIES = {"qwen3_next": {}, "qwen3_5": {}, "kda": {"gate_lower_bound": -5.0}}


def gpu_config(family, ratio=GPU_HEADS[1] // GPU_HEADS[0], **extra):
    """The GPU suites' layer: GPU_HEADS (`ratio` value heads per key head)."""
    H, _, K, V = GPU_HEADS
    return LinearAttentionConfig(family, hidden_size=256, num_k_heads=H, num_v_heads=H * ratio,
                                 head_k_dim=K, head_v_dim=V, conv_size=4, **extra)


@functools.lru_cache(maxsize=16)
def replicated_layer(config, seed):
    """The replicated layer of `config` in float64, its weights `random_state_dict(config, seed)`
    (cached: the checks never change a reference's weights)."""
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(config, seed))
    return layer


def random_state_dict(config, seed, *, fla_init=False, round_to=None):
    """float64 weights of the replicated layer, seeded.

    fla_init: A = exp(A_log) in [1, 16] and dt log-uniform in [1e-3, 0.1] (fla's init, the GPU
    suites); otherwise A in [0.2, 2] and dt_bias ~ N(0, 0.25) (gentler decay: more state crosses
    rank boundaries). round_to: a dtype the values are rounded to first (bf16 for the GPU suites).
    """
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, layout in parameter_layouts(config).items():
        t = torch.randn(layout.shape, generator=gen, dtype=torch.float64)
        if name == "A_log":
            low, high = (1.0, 16.0) if fla_init else (0.2, 2.0)
            t = torch.empty(layout.shape, dtype=torch.float64).uniform_(low, high, generator=gen).log()
        elif name == "dt_bias":
            if fla_init:
                dt = torch.exp(torch.rand(layout.shape, generator=gen, dtype=torch.float64)
                               * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                t = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
            else:
                t = 0.5 * t
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        else:
            t = t / math.sqrt(layout.shape[-1])
        sd[name] = t if round_to is None else t.to(round_to).double()
    return sd


def _build(config, placement, groups, dtype, device):
    tp_group, cp_group = groups
    # the padded layout is linattn's zigzag, given cu_seqlens_padded with each forward
    layout = "zigzag" if placement.padded else placement.cp_layout
    return build_layer(config, tp_group=tp_group, cp_group=cp_group, cp_layout=layout,
                       sequence_parallel=placement.sequence_parallel, dtype=dtype, device=device)


def _shard(config, state_dict, placement, tp_rank):
    return shard_state_dict(state_dict, config, tp_rank, placement.tp)


def _unshard(config, grads, placement):
    return unshard_state_dict(grads, config)


def linattn_layer(config) -> ShardedLayer:
    """The harness's description of linattn's layer for `config` (module-level partials: they
    cross to spawn's ranks by reference)."""
    return ShardedLayer(
        build=functools.partial(_build, config),
        shard=functools.partial(_shard, config),
        unshard=functools.partial(_unshard, config),
        replicated={n for n, layout in parameter_layouts(config).items() if layout.split == "replicated"},
        describe_grad_element=functools.partial(describe_grad_element, config),
    )


def _shard_layer_state(config, state, placement, tp_rank):
    return shard_layer_state(state, config, tp_rank, placement.tp)


def _unshard_layer_state(config, states, placement):
    return unshard_layer_state(states, config)


def linattn_state_path(config, **fields) -> StatePath:
    """The harness's StatePath of linattn's layer for `config`: forward(x, cu_seqlens, state,
    output_final_state=True) and step(x, state) (the harness's defaults), its state sharded over
    TP as its weights are. fields: StatePath fields to replace (a planted bug's)."""
    return StatePath(layer=linattn_layer(config), **{
        "shard_state": functools.partial(_shard_layer_state, config),
        "unshard_state": functools.partial(_unshard_layer_state, config), **fields})


def _head_blocks(config, name):
    """(groups, blocks) of the head-split dim of parameter `name` (parameter_layouts' table):
    the dim is `groups` repeats of the blocks, a block (part, "key"/"value", heads, per head)."""
    c = config
    H, HV, dk, dv, r = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.v_heads_per_k_head
    base = name.removesuffix(".weight")
    qkv = [("q", "key", H, dk), ("k", "key", H, dk), ("v", "value", HV, dv)]
    if c.family == "qwen3_next" and base == "in_proj_qkvz":  # grouped per key head
        return H, [("q", "key", 1, dk), ("k", "key", 1, dk), ("v", "value", r, dv), ("z", "value", r, dv)]
    if c.family == "qwen3_next" and base == "in_proj_ba":
        return H, [("b", "value", r, 1), ("a", "value", r, 1)]
    if base in ("in_proj_qkv", "conv1d"):
        return 1, qkv
    table = {
        "in_proj_z": ("value", HV, dv), "in_proj_b": ("value", HV, 1), "in_proj_a": ("value", HV, 1),
        "A_log": ("value", HV, 1), "dt_bias": ("value", HV, dk if c.family == "kda" else 1),
        "out_proj": ("value", HV, dv), "o_proj": ("value", HV, dv),
        "q_proj": ("key", H, dk), "k_proj": ("key", H, dk), "v_proj": ("value", HV, dv),
        "q_conv1d": ("key", H, dk), "k_conv1d": ("key", H, dk), "v_conv1d": ("value", HV, dv),
        "f_b_proj": ("value", HV, dk), "b_proj": ("value", HV, 1), "g_proj": ("value", HV, dv),
        "g_b_proj": ("value", HV, dv),
    }
    return (1, [(None, *table[base])]) if base in table else (1, [])


def describe_grad_element(config, name, index, placement) -> str | None:
    """Where element `index` of parameter `name` (the replicated layer's) lies: its head and
    channel, the other dims as row / col / tap, and the TP rank holding it, from
    parameter_layouts' split. None for TP-replicated parameters (no heads to name)."""
    layout = parameter_layouts(config).get(name)
    if layout is None or layout.split == "replicated" or len(index) != len(layout.shape):
        return None
    groups, blocks = _head_blocks(config, name)
    if not blocks:
        return None
    dim = 1 if layout.split == "cols" else 0
    rest = index[dim]
    per_group = sum(heads * per_head for _, _, heads, per_head in blocks)
    group, rest = divmod(rest, per_group)
    for part, kind, heads, per_head in blocks:
        if rest < heads * per_head:
            break
        rest -= heads * per_head
    head, channel = divmod(rest, per_head)
    head += group * heads
    total_heads = config.num_k_heads if kind == "key" else config.num_v_heads
    words = [f"{part}: " if part else ""]
    words[0] += f"{kind} head {head}" + (f", channel {channel}" if per_head > 1 else "")
    other = {0: "row", 1: "col", 2: "tap"}  # conv weights [channels, 1, W]: dim 2 is the tap
    words += [f"{other[d]} {i}" for d, i in enumerate(index) if d != dim and layout.shape[d] > 1]
    text = ", ".join(words)
    replicas = config.key_head_replicas(placement.tp) if kind == "key" else 1
    if placement.tp > 1 and replicas > 1:  # TP beyond the key heads: consecutive ranks hold each key head
        text += f" (TP ranks {head * replicas}..{head * replicas + replicas - 1}, its replicas)"
    elif placement.tp > 1 and kind == "value":  # the rank holding it: its key head's, by the head pairing
        text += f" (TP rank {next(t for t in range(placement.tp) if head in config.value_heads_of_rank(placement.tp, t))})"
    elif placement.tp > 1:
        text += f" (TP rank {head // (total_heads // placement.tp)})"
    return text


@functools.lru_cache(maxsize=32)
def _batch(config, seed, bounds, reference_dtype, fla_init, round_to, input_seed):
    """The replicated layer (in reference_dtype, seeded weights) and the input / output cotangent
    drawn in float64 (rounded to `round_to` first when given). Cached: cases of one packing and
    seed share one reference run (the harness keys its runs by these objects)."""
    reference = build_layer(config, dtype=reference_dtype)
    sd = random_state_dict(config, seed, fla_init=fla_init, round_to=round_to)
    reference.load_state_dict({n: t.to(reference_dtype) for n, t in sd.items()})
    gen = torch.Generator().manual_seed(input_seed)

    def draw():
        t = torch.randn(1, bounds[-1], config.hidden_size, generator=gen, dtype=torch.float64)
        return t if round_to is None else t.to(round_to).double()

    return reference, draw(), draw()


def make_case(config, cu_seqlens, *, seed, rtol, tp=1, cp=1, layout="contiguous", sp=False,
              dtype=torch.float64, name="", fla_init=False, round_to=None, input_seed=None,
              reference_dtype=None) -> ParityCase:
    """One placement of one layer on one packed batch: weights (seeded by `seed`), input and
    output cotangent (by `input_seed`, default seed + 50) drawn in float64, rounded to `round_to`
    first when given. rtol: a float, or a dict by dtype. reference_dtype: the replicated layer's
    dtype (default: the case's own)."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int32)
    reference, x, dy = _batch(config, seed, tuple(cu.tolist()), reference_dtype or dtype, fla_init, round_to,
                              seed + 50 if input_seed is None else input_seed)
    placement = Placement(tp, cp, layout, sp)
    return ParityCase(
        linattn_layer(config), placement, reference, cu, x, dy,
        rtol=rtol[dtype] if isinstance(rtol, dict) else rtol, dtype=dtype,
        name="/".join(p for p in (placement.name, config.family, name, str(dtype).removeprefix("torch.")) if p),
    )


def run_layer(layer, x, dy, cu_seqlens, forward=None):
    """Forward and backward of `layer` on x with output cotangent dy: (y, dx, parameter grads).
    forward: how the layer is called, `forward(layer, x, cu_seqlens)` (default `layer(x, cu_seqlens)`)."""
    x = x.clone().requires_grad_()
    y = layer(x, cu_seqlens) if forward is None else forward(layer, x, cu_seqlens)
    (y * dy).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def run_layer_tensors(layer, x, dy, cu_seqlens, forward=None) -> dict:
    """`run_layer`'s results as one dict for assert_parity: y, dx and d<parameter>."""
    y, dx, grads = run_layer(layer, x, dy, cu_seqlens, forward)
    return {"y": y, "dx": dx, **{f"d{n}": g for n, g in grads.items()}}


def report_row(report: str, start: str) -> str:
    """The first line of a parity report that starts with `start` (after its indentation)."""
    return next(line for line in report.splitlines() if line.strip().startswith(start))


def local_tokens(t, case, tp_rank, cp_rank):
    """The tokens of full `[1, T, ...]` `t` a rank holds (the harness's layout) for a placement
    dict (cu_seqlens, tp, cp, layout, sp), as the benchmarks describe one."""
    placement = Placement(case["tp"], case["cp"], case["layout"], bool(case["sp"]) and case["tp"] > 1)
    return t.index_select(1, rank_token_index(case["cu_seqlens"], placement, tp_rank, cp_rank).to(t.device))


def error_of(fn):
    """The message of the ValueError fn() raises (rank functions return it for the parent to
    check), or None when it raises nothing."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def assert_rules(per_rank, rules: dict) -> None:
    """Every rank's error_of message for each key names its rule (a regex)."""
    for rank, errors in enumerate(per_rank):
        for key, rule in rules.items():
            assert errors[key] is not None, f"rank {rank} {key}: no ValueError"
            assert re.search(rule, errors[key]), f"rank {rank} {key}: {errors[key]}"


# The single-device bf16 cases (gpu-1 on fla's kernels; cpu as its proxy on the torch kernels).
BF16_CU_SEQLENS = [0, 1, 130, 300, 515]  # one single-token sequence, one crossing fla's 64-token chunks
# All on GPU_HEADS (GVA 1 and 3 are covered on the CPU).
BF16_CASES = {
    # name: (family, v heads per k head, config options)
    "qwen3_next-gva2": ("qwen3_next", 2, {}),
    "qwen3_5-gva2": ("qwen3_5", 2, {}),
    "kda-gva2-lower_bound": ("kda", 2, {"gate_lower_bound": -5.0}),
    "kda-gva2-low_rank_gate": ("kda", 2, {"output_gate_rank": 128}),
}


def bf16_case(case):
    """(config, weights, cu_seqlens, x, dy) of a BF16_CASES case: weights, input and output
    cotangent seeded, drawn in float64 and rounded to bf16 once (float64 tensors holding bf16
    values)."""
    family, ratio, extra = BF16_CASES[case]
    config = gpu_config(family, ratio, **extra)
    seed = 2026 + list(BF16_CASES).index(case)
    sd = random_state_dict(config, seed, fla_init=True, round_to=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    cu = torch.tensor(BF16_CU_SEQLENS, dtype=torch.int32)
    x, dy = (torch.randn(1, BF16_CU_SEQLENS[-1], config.hidden_size, generator=gen, dtype=torch.float64)
             .to(torch.bfloat16).double() for _ in range(2))
    return config, sd, cu, x, dy


def check_bf16_layer(case, device, *, rtol=BF16_RTOL):
    """A bf16 layer on `device` against the float64 replicated layer on the CPU, same weights and
    inputs (bf16_case: what is left is the bf16 computation's error): output, dx and every
    parameter gradient <= rtol."""
    config, sd, cu, x, dy = bf16_case(case)
    reference = build_layer(config, dtype=torch.float64)
    reference.load_state_dict(sd)
    y_ref, dx_ref, grads_ref = run_layer(reference, x, dy, cu)

    layer = build_layer(config, dtype=torch.bfloat16, device=device)
    layer.load_state_dict({n: t.to(torch.bfloat16) for n, t in sd.items()})
    y, dx, grads = run_layer(layer, x.to(device, torch.bfloat16), dy.to(device, torch.bfloat16), cu.to(device))
    assert all(g.dtype == torch.bfloat16 for g in grads.values())  # bf16 parameters, bf16 gradients

    assert_parity(y, y_ref, rtol=rtol, name=f"{case} output", cu_seqlens=cu)
    assert_parity(dx, dx_ref, rtol=rtol, name=f"{case} dx", cu_seqlens=cu)
    assert_parity(grads, grads_ref, rtol=rtol, name=f"{case} grad")
