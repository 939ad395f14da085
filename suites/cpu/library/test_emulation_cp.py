"""linattn.emulation.delta_rules at context parallelism: fla's chunk ops with
cp_context=build_cp_context(...) under the fla_on_cpu switch, at CP 2 and 4 in fla's contiguous
and zigzag layouts, outputs and gradients against the single-process result (<= 1e-10)."""

import torch

from cases.emulation import CP_CASES, F64, OPS, RTOL_CP, assemble, cp_groups, packed_inputs, rank_cases
from linattn.emulation import cp as emulation_cp, delta_rules as emu
from linattn.reference import short_conv
from pytest_linattn import assert_parity


CP_OPS = ("chunk_kda", "chunk_gated_delta_rule")
CP_OPTIONS = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
TOKEN_INPUTS = ("q", "k", "v", "g_raw", "beta_raw")
PARAMETERS = ("A_log", "dt_bias")


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
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    assert chunk_kda is emu.PATCHES["fla.ops.kda.chunk:chunk_kda"]
    ops = {"chunk_kda": chunk_kda, "chunk_gated_delta_rule": chunk_gated_delta_rule}
    results = {}
    for cp_size, group, case, index in rank_cases(cases_by_cp):
        ctx = build_cp_context(case["cu"], group, layout=case["layout"])
        out = {}
        for op_name, op in ops.items():
            S, out[op_name] = _call_with_grads(op, case[op_name], index, cp_context=ctx)
            assert S is None
        results.setdefault(cp_size, []).append(out)
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
            for op_name in CP_OPS:
                _, expected = _call_with_grads(OPS[op_name][0], case[op_name], cu_seqlens=cu)
                for ranks in cp_groups(world, cp_size):
                    got = assemble([per_rank[r][cp_size][i][op_name] for r in ranks], T, cp_size, case["layout"],
                                   summed=("dA_log", "ddt_bias"))
                    assert_parity(got, expected, rtol=RTOL_CP, cu_seqlens=cu,
                                  name=f"cp{cp_size}(ranks {ranks[0]}-{ranks[-1]})/{case['name']}/{op_name}")


# ------------------------------------------------------------------------------------------
# fla's causal_conv1d and ShortConvolution with cp_context (W = 4: a halo of 3 tokens)

D, W = 3, 4  # conv channels and width


def _fields(ctx):
    names = ("cu_seqlens", "is_last_rank", "pre_num_ranks", "is_first_rank", "post_num_ranks", "conv1d_kernel_size",
             "pre_num_conv_tokens", "layout", "part_len", "front_num_seqs", "pre_num_ranks_by_part",
             "post_num_ranks_by_part", "is_first_by_part", "is_last_by_part", "pre_num_conv_tokens_by_part")
    return {n: getattr(ctx, n) for n in names}


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run_cp_conv(cases_by_cp):
    """On every rank, under fla_on_cpu: fla's causal_conv1d and ShortConvolution with cp_context."""
    from fla.modules import ShortConvolution
    from fla.modules.causal_conv1d.ops import causal_conv1d
    from fla.ops.cp import build_cp_context
    from fla.ops.cp.context import get_cp_cu_seqlens

    assert build_cp_context is emulation_cp.PATCHES["fla.ops.cp.context:build_cp_context"]
    results = {}
    for cp_size, group, case, index in rank_cases(cases_by_cp):
        cu, layout = case["cu"], case["layout"]
        ctx = build_cp_context(cu, group, conv1d_kernel_size=W, layout=layout)
        # a context built by fla's own function: piece_context reassembles the same partition
        fla_ctx = get_cp_cu_seqlens(cu, group=group, conv1d_kernel_size=W, layout=layout)
        rebuilt, piece = emulation_cp.piece_context(fla_ctx), emulation_cp.piece_context(ctx)
        same = (torch.equal(rebuilt.cu_seqlens, piece.cu_seqlens)
                and rebuilt.first_seq_offset == piece.first_seq_offset)

        x, residual = _leaf(case["x"][:, index]), _leaf(case["residual"][:, index])
        weight, bias = _leaf(case["weight"]), _leaf(case["bias"])
        y, state = causal_conv1d(x, weight, bias, residual, activation="silu", cu_seqlens=ctx.cu_seqlens,
                                 cp_context=ctx)
        (y * case["dy"][:, index]).sum().backward()
        out = {"fn": dict(y=y.detach(), dx=x.grad, dresidual=residual.grad, dweight=weight.grad, dbias=bias.grad)}

        layer = ShortConvolution(D, W, bias=True, activation="silu", dtype=F64)
        with torch.no_grad():
            layer.weight.copy_(case["weight"].unsqueeze(1))
            layer.bias.copy_(case["bias"])
        x = _leaf(case["x"][:, index])
        y, _ = layer(x, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
        (y * case["dy"][:, index]).sum().backward()
        out["module"] = dict(y=y.detach(), dx=x.grad, dweight=layer.weight.grad[:, 0], dbias=layer.bias.grad)
        results.setdefault(cp_size, []).append(dict(out=out, state_is_none=state is None, fields=_fields(ctx),
                                                    rebuilt_matches=same))
    return results


def test_cp_conv_matches_single_process(fla_on_cpu, spawn):
    # one spawn of 4 ranks (importing fla costs seconds per rank): CP 4 over the world, CP 2 over
    # two subgroups of it
    from fla.ops.cp.context import get_cp_cu_seqlens

    gen = torch.Generator().manual_seed(100)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    cases_by_cp = {}
    for cp_size, table in CP_CASES.items():
        cases_by_cp[cp_size] = []
        for name, lengths, layout in table:
            cu = torch.tensor([0] + lengths).cumsum(0)
            T = int(cu[-1])
            cases_by_cp[cp_size].append(dict(
                name=name, cu=cu, layout=layout, x=rand(1, T, D), residual=rand(1, T, D), weight=rand(D, W),
                bias=rand(D), dy=rand(1, T, D)))
    world = max(CP_CASES)
    per_rank = spawn(_run_cp_conv, world, cases_by_cp)

    for cp_size, cases in cases_by_cp.items():
        for i, case in enumerate(cases):
            cu, layout, T = case["cu"], case["layout"], int(case["cu"][-1])
            x, residual, weight, bias = (_leaf(case[k]) for k in ("x", "residual", "weight", "bias"))
            y_conv = short_conv(x, weight, cu, bias, "silu")
            ((y_conv + residual) * case["dy"]).sum().backward()
            expected = {"fn": {"y": (y_conv + residual).detach(), "dx": x.grad, "dresidual": residual.grad,
                               "dweight": weight.grad, "dbias": bias.grad}}
            expected["module"] = dict(expected["fn"], y=y_conv.detach())  # no residual through the module
            for ranks in cp_groups(world, cp_size):
                label = f"cp{cp_size}(ranks {ranks[0]}-{ranks[-1]})/{case['name']}"
                for op in ("fn", "module"):
                    got = assemble([per_rank[r][cp_size][i]["out"][op] for r in ranks], T, cp_size, layout,
                                   summed=("dweight", "dbias"))
                    assert_parity(got, {k: expected[op][k] for k in got}, rtol=RTOL_CP, name=f"{label}/{op}",
                                  cu_seqlens=cu)
                for group_rank, r in enumerate(ranks):
                    result = per_rank[r][cp_size][i]
                    assert result["state_is_none"] and result["rebuilt_matches"], label
                    fla_fields = _fields(get_cp_cu_seqlens(cu, world_size=cp_size, rank=group_rank,
                                                           conv1d_kernel_size=W, layout=layout))
                    for key, value in fla_fields.items():
                        got = result["fields"][key]
                        same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
                        assert same, f"{label} rank {group_rank}: {key} = {got}, fla computes {value}"
