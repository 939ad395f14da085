"""linattn.emulation.delta_rules at context parallelism: fla's chunk ops with
cp_context=build_cp_context(...) under the fla_on_cpu switch, at CP 2 and 4 in fla's contiguous
and zigzag layouts, outputs and gradients against the single-process result (<= 1e-10)."""

import torch

from emulation_cases import F64, OPS, RTOL_CP, packed_inputs
from linattn.emulation import delta_rules as emu
from pytest_linattn import assert_parity


# (name, sequence lengths, fla layout) per CP size; sequences cross rank boundaries, one has length 1
CP_CASES = {
    2: [("crossing", [1, 9, 6], "contiguous"), ("zigzag", [3, 10, 3], "zigzag")],
    4: [("crossing", [5, 22, 1, 4], "contiguous"), ("short-pieces", [1, 7], "contiguous"),
        ("zigzag", [2, 9, 5], "zigzag")],
}
CP_OPS = ("chunk_kda", "chunk_gated_delta_rule")
CP_OPTIONS = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
TOKEN_INPUTS = ("q", "k", "v", "g_raw", "beta_raw")
PARAMETERS = ("A_log", "dt_bias")


def _local_index(total, rank, cp_size, layout):
    """Global tokens of a rank: one interval (contiguous) or intervals r and 2cp-1-r of the whole batch (fla's zigzag)."""
    part = total // (2 * cp_size)
    intervals = [rank, 2 * cp_size - 1 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]
    return torch.cat([torch.arange(i * part, (i + 1) * part) for i in intervals])


def _cp_group(cp_size):
    """The world for CP 4; for CP 2 ranks {0, 1} or {2, 3}. Every rank creates every group, in order."""
    import torch.distributed as dist

    if cp_size == dist.get_world_size():
        return dist.group.WORLD
    groups = [dist.new_group(list(range(first, first + cp_size))) for first in range(0, dist.get_world_size(), cp_size)]
    return groups[dist.get_rank() // cp_size]


def _leaves(case, index=None):
    tokens = {n: case[n] if index is None else case[n][:, index] for n in TOKEN_INPUTS}
    return {n: t.detach().clone().requires_grad_() for n, t in {**tokens, **{n: case[n] for n in PARAMETERS}}.items()}


def _call_with_grads(op, case, index=None, **kwargs):
    """o and the gradients of a random projection of it, for every differentiable input."""
    x = _leaves(case, index)
    o, S = op(q=x["q"], k=x["k"], v=x["v"], g=x["g_raw"], beta=x["beta_raw"], A_log=x["A_log"],
              dt_bias=x["dt_bias"], **CP_OPTIONS, **kwargs)
    do = case["do"] if index is None else case["do"][:, index]
    (o * do).sum().backward()
    return S, dict(o=o.detach(), **{f"d{n}": t.grad for n, t in x.items()})


def _run_cp_ops(cases_by_cp):
    """On every rank, under fla_on_cpu: fla's chunk_kda / chunk_gated_delta_rule with cp_context."""
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    assert chunk_kda is emu.PATCHES["fla.ops.kda.chunk:chunk_kda"]
    ops = {"chunk_kda": chunk_kda, "chunk_gated_delta_rule": chunk_gated_delta_rule}
    results = {}
    for cp_size, cases in cases_by_cp.items():
        group = _cp_group(cp_size)
        rank = dist.get_rank(group)
        results[cp_size] = []
        for case in cases:
            index = _local_index(int(case["cu"][-1]), rank, cp_size, case["layout"])
            ctx = build_cp_context(case["cu"], group, layout=case["layout"])
            out = {}
            for op_name, op in ops.items():
                S, out[op_name] = _call_with_grads(op, case[op_name], index, cp_context=ctx)
                assert S is None
            results[cp_size].append(out)
    return results


def test_cp_matches_single_process(fla_on_cpu, spawn):
    # one spawn of 4 ranks (importing fla costs seconds per rank): CP 4 over the world, CP 2 over
    # two subgroups of it
    cases_by_cp = {}
    for cp_size, table in CP_CASES.items():
        cases_by_cp[cp_size] = []
        for i, (name, lengths, layout) in enumerate(table):
            case = dict(name=name, layout=layout, cu=torch.tensor([0] + lengths).cumsum(0))
            for op_name in CP_OPS:
                x, _ = packed_inputs(200 + 10 * cp_size + i, per_channel=op_name == "chunk_kda", lengths=lengths)
                x["do"] = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(i), dtype=F64)
                case[op_name] = x
            cases_by_cp[cp_size].append(case)
    world = max(CP_CASES)
    per_rank = spawn(_run_cp_ops, world, cases_by_cp)

    for cp_size, cases in cases_by_cp.items():
        for i, case in enumerate(cases):
            cu, T = case["cu"], int(case["cu"][-1])
            order = torch.cat([_local_index(T, r, cp_size, case["layout"]) for r in range(cp_size)])
            for op_name in CP_OPS:
                _, expected = _call_with_grads(OPS[op_name][0], case[op_name], cu_seqlens=cu)
                for first in range(0, world, cp_size):  # each CP group's ranks
                    pieces = [per_rank[r][cp_size][i][op_name] for r in range(first, first + cp_size)]
                    got = {}
                    for key in expected:
                        if key in ("dA_log", "ddt_bias"):  # per-rank partial sums over CP
                            got[key] = torch.stack([p[key] for p in pieces]).sum(0)
                        else:
                            got[key] = torch.empty_like(expected[key])
                            got[key][:, order] = torch.cat([p[key] for p in pieces], dim=1)
                    assert_parity(got, expected, rtol=RTOL_CP, cu_seqlens=cu,
                                  name=f"cp{cp_size}(ranks {first}-{first + cp_size - 1})/{case['name']}/{op_name}")
