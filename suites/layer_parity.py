"""Layer parity cases shared by the layer tests of every suite (cpu, gpu-1, gpu-2, gpu-4).

One idea each:

- `make_config`, `random_state_dict`: the layer under test and its weights (float64 values;
  rounded to bf16 first for the GPU suites, so the float64 reference sees what the kernels see).
- `make_case`: one placement (tp, cp, layout, sp, dtype) of one layer on one packed batch.
- `run_parallel_cases` (the rank function, for `spawn`): every case's layer, sharded by its TP/CP
  placement on the spawned world, forward and backward on this rank's tokens. Cases of different
  placements share one spawn call (and one world): a world larger than tp * cp holds data-parallel
  replicas, each checked.
- `check_parallel_case`: the ranks' outputs and input gradients put back together (SP slices
  concatenated over TP, then `cp_unshard` over CP), parameter gradients summed over CP (they are
  per-rank partial sums, as Megatron's gradient all-reduce over data x context ranks expects) and
  unsharded over TP, each compared with the replicated layer (`reference_outputs`).

Global rank of (tp_rank, cp_rank, dp_rank) is Megatron's order, as `linattn.parallel.new_groups`:
tp_rank + tp * (cp_rank + cp * dp_rank).
"""

from __future__ import annotations

import math
import re

import torch

from linattn.layers import (
    LinearAttentionConfig,
    build_layer,
    parameter_layouts,
    shard_state_dict,
    unshard_state_dict,
)
from linattn.parallel import cp as cp_ops
from pytest_linattn.parity import assert_parity

FAMILIES = ("qwen3_next", "qwen3_5", "kda")

# KDA variants ride along the head ratios: the bounded gate with a full-rank output gate, and
# Kimi Linear's unbounded gate with a low-rank (replicated g_a_proj) output gate
KDA_OPTIONS = {2: {"gate_lower_bound": -5.0}, 3: {"output_gate_rank": 5}}


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


def make_case(config, cu_seqlens, *, seed, tp=1, cp=1, layout="contiguous", sp=False,
              dtype=torch.float64, name="", fla_init=False, round_to=None, input_seed=None):
    """One placement of one layer on one packed batch: weights (seeded by `seed`), input and
    output cotangent (by `input_seed`, default seed + 50) drawn in float64, rounded to `round_to`
    first when given."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int32)
    T = int(cu[-1])
    gen = torch.Generator().manual_seed(seed + 50 if input_seed is None else input_seed)

    def draw():
        t = torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64)
        return t if round_to is None else t.to(round_to).double()

    placement = "/".join([f"tp{tp}" + ("-sp" if sp else "")] * (tp > 1) + [f"cp{cp}-{layout}"] * (cp > 1)) or "replicated"
    return dict(
        name="/".join(p for p in (placement, config.family, name, str(dtype).removeprefix("torch.")) if p),
        config=config, tp=tp, cp=cp, layout=layout, sp=sp, dtype=dtype, seed=seed, cu_seqlens=cu,
        state_dict=random_state_dict(config, seed, fla_init=fla_init, round_to=round_to),
        x=draw(), dy=draw(),
    )


def run_layer(layer, x, dy, cu_seqlens):
    """Forward and backward of `layer` on x with output cotangent dy: (y, dx, parameter grads)."""
    x = x.clone().requires_grad_()
    y = layer(x, cu_seqlens)
    (y * dy).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def local_tokens(t, case, tp_rank, cp_rank):
    """The tokens of full `[1, T, ...]` `t` a rank holds: its CP shard (in the case's layout),
    then under SP its TP slice of that shard."""
    t = cp_ops.cp_shard(t, case["cu_seqlens"], cp_rank, case["cp"], case["layout"])
    return t.chunk(case["tp"], dim=1)[tp_rank] if case["sp"] else t


def run_parallel_cases(cases):
    """Rank function: this rank's part of every case, as (y, dx, parameter grads) on the CPU.

    Runs on NCCL ranks (layers on this rank's GPU) or gloo ranks (CPU) alike."""
    import torch.distributed as dist

    from linattn.parallel import group_rank, new_groups

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    groups = {}
    for case in cases:  # new_groups is collective: every rank creates the same groups in the same order
        key = (case["tp"], case["cp"])
        if key not in groups:
            groups[key] = new_groups(*key)
    results = []
    for case in cases:
        config, dtype = case["config"], case["dtype"]
        tp_group, cp_group = groups[(case["tp"], case["cp"])]
        tp_rank, cp_rank = group_rank(tp_group), group_rank(cp_group)
        layer = build_layer(config, tp_group=tp_group, cp_group=cp_group, cp_layout=case["layout"],
                            sequence_parallel=case["sp"], dtype=dtype, device=device)
        shard = shard_state_dict(case["state_dict"], config, tp_rank, case["tp"])
        layer.load_state_dict({n: t.to(dtype) for n, t in shard.items()})
        x, dy = (local_tokens(case[n], case, tp_rank, cp_rank).to(device, dtype) for n in ("x", "dy"))
        results.append(run_layer(layer, x, dy, case["cu_seqlens"].to(device)))
    return results


def reference_outputs(case, dtype=None):
    """The replicated layer (one process, CPU) on the case's whole batch, in `dtype` (default:
    the case's dtype)."""
    dtype = dtype or case["dtype"]
    layer = build_layer(case["config"], dtype=dtype)
    layer.load_state_dict({n: t.to(dtype) for n, t in case["state_dict"].items()})
    return run_layer(layer, case["x"].to(dtype), case["dy"].to(dtype), case["cu_seqlens"])


def check_parallel_cases(cases, per_rank, *, rtol, reference_dtype=None, replicated_equal=True):
    """`check_parallel_case` for every case of one spawn call (`per_rank`: spawn's return value).

    rtol: a float, or a dict by the cases' dtype. reference_dtype: the replicated layer's dtype
    (default: each case's own). Cases with the same seed, packing and dtype share one reference."""
    references = {}
    for i, case in enumerate(cases):
        dtype = reference_dtype or case["dtype"]
        key = (case["config"], case["seed"], tuple(case["cu_seqlens"].tolist()), dtype)
        if key not in references:
            references[key] = reference_outputs(case, dtype)
        tol = rtol[case["dtype"]] if isinstance(rtol, dict) else rtol
        check_parallel_case(case, [r[i] for r in per_rank], references[key], rtol=tol,
                            replicated_equal=replicated_equal)


def check_parallel_case(case, results, reference, *, rtol, replicated_equal=True):
    """Compare one case's per-rank `results` (rank order, as spawn returns them) with `reference`
    (y, dx, grads of the replicated layer). replicated_equal: also require every TP rank to hold
    bit-identical gradients of the replicated weights (the TP all-reduce)."""
    tp, cp, layout, cu, config = case["tp"], case["cp"], case["layout"], case["cu_seqlens"], case["config"]
    y_ref, dx_ref, grads_ref = reference
    world = len(results)
    assert world % (tp * cp) == 0, f"{case['name']}: world {world} is not a multiple of tp * cp = {tp * cp}"

    def rank(t, c, d):
        return t + tp * (c + cp * d)

    for d in range(world // (tp * cp)):
        label = case["name"] + (f"/dp{d}" if world > tp * cp else "")
        for what, index, ref in (("output", 0, y_ref), ("dx", 1, dx_ref)):
            if case["sp"]:  # SP slices in TP order make the CP shard
                shards = [torch.cat([results[rank(t, c, d)][index] for t in range(tp)], dim=1) for c in range(cp)]
                views = {"": shards}
            else:  # every TP rank holds the whole CP shard
                views = {(f" tp_rank{t}" if tp > 1 else ""): [results[rank(t, c, d)][index] for c in range(cp)]
                         for t in range(tp)}
            for suffix, shards in views.items():
                full = cp_ops.cp_unshard(shards, cu, cp, layout)
                assert_parity(full, ref, rtol=rtol, name=f"{label} {what}{suffix}", cu_seqlens=cu)
        # parameter gradients: partial sums over CP, TP shards unsharded
        per_tp = []
        for t in range(tp):
            grads = [results[rank(t, c, d)][2] for c in range(cp)]
            per_tp.append({n: torch.stack([g[n].double() for g in grads]).sum(0) for n in grads[0]})
        assert_parity(unshard_state_dict(per_tp, config), grads_ref, rtol=rtol, name=f"{label} grad")
        if replicated_equal and tp > 1:
            for name, param_layout in parameter_layouts(config).items():
                if param_layout.split != "replicated":
                    continue
                for c in range(cp):
                    first = results[rank(0, c, d)][2][name]
                    for t in range(1, tp):
                        assert torch.equal(results[rank(t, c, d)][2][name], first), \
                            f"{label} {name}: TP rank {t} (cp rank {c}) holds a different replicated-weight gradient"


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


def check_bf16_layer(case, device, *, rtol=2e-2):
    """A bf16 layer on `device` against the float64 replicated layer on the CPU, same weights and
    inputs (drawn in float64, rounded to bf16 once, so what is left is the bf16 computation's
    error): output, dx and every parameter gradient <= rtol."""
    family, ratio, extra = BF16_CASES[case]
    config = gpu_config(family, ratio, **extra)
    seed = 2026 + list(BF16_CASES).index(case)
    sd = random_state_dict(config, seed, fla_init=True, round_to=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    cu = torch.tensor(BF16_CU_SEQLENS, dtype=torch.int32)
    T = BF16_CU_SEQLENS[-1]
    x, dy = (torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64)
             .to(torch.bfloat16).double() for _ in range(2))

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
