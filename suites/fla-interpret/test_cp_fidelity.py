"""Context parallelism at CP 2, both of fla's layouts, against fla's own CP kernels, interpreted.

On each of two ranks (gloo), for the contiguous layout and fla's whole-batch zigzag (rank r holds
intervals r and 3-r of four): fla's real ``build_cp_context`` and its CP path of
chunk_gated_delta_rule, chunk_kda and causal_conv1d (interpreted; fla_interpreted lets it run on
CPU tensors over gloo), against the emulated ``build_cp_context`` and ops under fla_on_cpu, on the
same rank-local float32 values. Outputs and input gradients agree to 1e-4 (fidelity.py) rank by
rank; the gradients of the replicated parameters (A_log, dt_bias, the conv's weight and bias)
summed over the ranks, as data parallelism reduces them: each rank holds a partial sum over the
tokens it computed, and in the zigzag layout those differ (fla computes a rank's two intervals,
the emulation the contiguous piece its relayout moves there: per rank 0.9-1.2 apart on the conv
weight, the same sum to 1e-7).
"""

import pytest
import torch

from fidelity import F32, F64, assert_emulated, assert_fidelity, backward, cotangents, draw

LENGTHS = [1, 9, 14]  # a length-1 sequence; the last crosses the contiguous boundary, and zigzag's
CU = [0, 1, 10, 24]
T, H, HV, K, V, D, W = CU[-1], 1, 2, 16, 16, 32, 4
CP = 2
LAYOUTS = ("contiguous", "zigzag")
DELTA_OPTIONS = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)


def _local_index(rank, layout):
    """The global tokens rank holds: one interval (contiguous) or intervals r and 2cp-1-r (zigzag)."""
    part = T // (2 * CP)
    intervals = [rank, 2 * CP - 1 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]
    return torch.cat([torch.arange(i * part, (i + 1) * part) for i in intervals])


def _inputs(op, seed):
    """Global values (float32-representable float64), the same on every rank; per-token names first."""
    gen = torch.Generator().manual_seed(seed)
    if op == "causal_conv1d":
        return {"x": draw(gen, (1, T, D)), "weight": draw(gen, (D, W), "weight"), "bias": draw(gen, (D,))}
    kda = op == "chunk_kda"
    return {"q": draw(gen, (1, T, H, K)), "k": draw(gen, (1, T, H, K)), "v": draw(gen, (1, T, HV, V)),
            "g": draw(gen, (1, T, HV, K) if kda else (1, T, HV)), "beta": draw(gen, (1, T, HV)),
            "A_log": draw(gen, (HV,), "A_log"), "dt_bias": draw(gen, (HV * K,) if kda else (HV,), "dt_bias")}


PER_TOKEN = {"x", "q", "k", "v", "g", "beta"}
PARAMETERS = {"grad A_log", "grad dt_bias", "grad weight", "grad bias"}  # compared summed over the ranks
OPS = {"chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", DELTA_OPTIONS),
       "chunk_kda": ("fla.ops.kda", DELTA_OPTIONS),
       "causal_conv1d": ("fla.modules.causal_conv1d.ops", dict(activation="silu"))}


def _run_local(op, values, index, layout, dtype):
    """The op's CP call on this rank's tokens: (results by name), fla's or (under fla_on_cpu) the emulation's."""
    import importlib

    import torch.distributed as dist
    from fla.ops import cp

    module, options = OPS[op]
    fn = getattr(importlib.import_module(module), op)
    ctx = cp.build_cp_context(torch.tensor(CU), group=dist.group.WORLD, conv1d_kernel_size=W, layout=layout)
    leaves = {n: (v[:, index] if n in PER_TOKEN else v).to(dtype).requires_grad_() for n, v in values.items()}
    out = fn(**leaves, **options, cp_context=ctx)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    global_cots = cotangents([torch.zeros(1, T, *o.shape[2:]) for o in outs], None, seed=11)
    backward(outs, [c[:, index] for c in global_cots])
    return {**{f"output {i}": o.detach() for i, o in enumerate(outs)},
            **{f"grad {n}": t.grad for n, t in leaves.items()}}, fn


def _cp_rank(seed):
    """On each rank: every layout and op, fla's CP path (interpreted) and the emulation's."""
    import torch.distributed as dist

    from linattn.emulation import fla_on_cpu, interpreted

    rank = dist.get_rank()
    state = {"interpreted": interpreted.active(), "compiled kernel": interpreted.compiled_fla_kernel()}
    results = {}
    for i, layout in enumerate(LAYOUTS):
        index = _local_index(rank, layout)
        for j, op in enumerate(OPS):
            values = _inputs(op, seed + 10 * i + j)
            fla_res, fn = _run_local(op, values, index, layout, F32)
            assert not fn.__module__.startswith("linattn.emulation"), f"{op} is emulated outside fla_on_cpu"
            with fla_on_cpu():
                emu_res, fn = _run_local(op, values, index, layout, F64)
                assert_emulated(fn, op)
            results[(layout, op)] = (fla_res, emu_res)
    return state, results


@pytest.mark.world_size(CP)
def test_cp2_matches_fla_interpreted(spawn):
    seed = 5000
    per_rank = spawn(_cp_rank, CP, seed)
    for rank, (state, results) in enumerate(per_rank):
        assert state == {"interpreted": True, "compiled kernel": None}, f"rank {rank}: {state}"
    for (layout, op) in per_rank[0][1]:
        pairs = [results[(layout, op)] for _, results in per_rank]
        for rank, (fla_res, emu_res) in enumerate(pairs):
            tokens = [k for k in fla_res if k not in PARAMETERS]
            assert_fidelity({k: fla_res[k] for k in tokens}, {k: emu_res[k] for k in tokens},
                            f"cp{CP} {layout} rank {rank}: {op} (seeds from {seed})")
        params = [k for k in pairs[0][0] if k in PARAMETERS]
        assert_fidelity({k: sum(f[k] for f, _ in pairs) for k in params}, {k: sum(e[k] for _, e in pairs) for k in params},
                        f"cp{CP} {layout}, summed over ranks: {op} (seeds from {seed})")
