"""What the CP op tests share (suites/cpu/library/test_cp_ops.py, suites/gpu-2/test_cp_ops_gpu2.py): a
case's inputs (`make_case`), the rank function (`run_cases_on_rank`: the CP conv and both CP delta
rules on every rank, per backend), the token layout they shard and unshard with, the float64
reference (short conv and both delta rules on the whole packed batch, outputs and every input's
gradient) and the check of every case (`check_cases`).

The layout is the harness's `rank_token_index`, written from the documented definition, never
linattn's `cp_shard` / `cp_unshard`: a layout bug those share with the ops would cancel out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linattn import reference
from linattn.parallel import cp
from pytest_linattn.harness import Placement, rank_token_index
from pytest_linattn.parity import assert_parity

DELTA_RULES = ("gated_delta_rule", "kda")


def _index(cu, cp_rank, cp_size, layout):
    return rank_token_index(cu, Placement(cp=cp_size, cp_layout=layout), cp_rank=cp_rank)


def shard(t, cu, cp_rank, cp_size, layout):
    """The tokens (dim 1) of the whole batch's `t` that CP rank `cp_rank` holds, in its order."""
    return t.index_select(1, _index(cu, cp_rank, cp_size, layout).to(t.device))


def unshard(pieces, cu, layout):
    """The whole batch (float64) from the CP ranks' pieces in rank order; a token no rank put
    back stays NaN (never passes)."""
    first = pieces[0]
    full = torch.full((1, int(cu[-1]), *first.shape[2:]), math.nan, dtype=torch.float64)
    for r, piece in enumerate(pieces):
        full[:, _index(cu, r, len(pieces), layout)] = piece.detach().cpu().double()
    return full


def _float64_leaf(t):
    # float64 CPU leaves holding the case's values (bf16 on the GPU), so reference gradients are float64
    return t.detach().to("cpu").double().clone().requires_grad_(True)


def reference_case(case, *, use_qk_l2norm):
    """{"conv": {y, dx, dweight, dbias}, op: {o, dq, dk, dv, dg, dbeta}} for the case's full tensors."""
    cu = case["cu"]
    c = case["conv"]
    x, weight, bias = (_float64_leaf(c[n]) for n in ("x", "weight", "bias"))
    y = reference.short_conv(x, weight, cu, bias, "silu")
    (y * c["dy"].double()).sum().backward()
    ref = {"conv": dict(y=y.detach(), dx=x.grad, dweight=weight.grad, dbias=bias.grad)}
    for op in DELTA_RULES:
        t = case[op]
        ins = {n: _float64_leaf(t[n]) for n in ("q", "k", "v", "g", "beta")}
        o, _ = getattr(reference, op)(*ins.values(), cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm)
        (o * t["do"].double()).sum().backward()
        ref[op] = dict(o=o.detach(), **{f"d{n}": leaf.grad for n, leaf in ins.items()})
    return ref


def make_case(name, layout, cu, randn, heads, *, conv_dim, conv_width, l2norm, cast=None, g_cast=None):
    """One case's whole-batch inputs: {"conv": {x, weight, bias, dy}, op: {q, k, v, g, beta, do}}.
    randn(*shape) draws float64 values; heads = (H, HV, K, V). cast (default none) is applied to
    every input, g_cast (default cast) to the log decays: the GPU rounds the inputs to bf16 once,
    so the reference sees exactly what the kernels see, and fla keeps log decays in float32."""
    cast = cast or (lambda t: t)
    g_cast = g_cast or cast
    H, HV, K, V = heads
    T = int(cu[-1])
    case = dict(name=name, layout=layout, cu=cu, l2norm=l2norm)
    case["conv"] = {n: cast(randn(*shape)) for n, shape in
                    (("x", (1, T, conv_dim)), ("weight", (conv_dim, conv_width)), ("bias", (conv_dim,)),
                     ("dy", (1, T, conv_dim)))}
    for op, g_shape in (("gated_delta_rule", (1, T, HV)), ("kda", (1, T, HV, K))):
        case[op] = dict(q=cast(randn(1, T, H, K)), k=cast(randn(1, T, H, K)), v=cast(randn(1, T, HV, V)),
                        g=g_cast(F.logsigmoid(randn(*g_shape))), beta=cast(torch.sigmoid(randn(1, T, HV))),
                        do=cast(randn(1, T, HV, V)))
    return case


def _leaf(t, device):
    return t.detach().to(device).clone().requires_grad_(True)


def run_cases_on_rank(cases, backends=(None,)):
    """Rank function: every case's CP conv and CP delta rules on this rank's tokens, with input
    gradients, once per backend (None: the op's default) -> [{(backend, op): {name: tensor}}]."""
    import torch.distributed as dist

    from pytest_linattn.harness.sharded_parity_rank import run_device

    device = run_device()
    rank, size = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        cu, layout = case["cu"], case["layout"]
        ctx = cp.build_context(cu.to(device), dist.group.WORLD, layout, total_tokens=int(cu[-1]))

        def local(t):
            return shard(t, cu, rank, size, layout).to(device)

        out = {}
        for backend in backends:
            chosen = {} if backend is None else {"backend": backend}
            c = case["conv"]
            x = _leaf(local(c["x"]), device)
            weight, bias = _leaf(c["weight"], device), _leaf(c["bias"], device)
            y = ctx.relayout.from_contiguous(
                cp.short_conv(ctx.relayout.to_contiguous(x), weight, bias, "silu", cp_context=ctx, **chosen))
            (y * local(c["dy"])).sum().backward()
            out[(backend, "conv")] = dict(y=y.detach(), dx=x.grad, dweight=weight.grad, dbias=bias.grad)
            for op in DELTA_RULES:
                t = case[op]
                ins = {n: _leaf(local(t[n]), device) for n in ("q", "k", "v", "g", "beta")}
                o = cp.delta_rule(*ctx.relayout.to_contiguous(*ins.values()), op=op, use_qk_l2norm=case["l2norm"],
                                  cp_context=ctx, **chosen)
                o = ctx.relayout.from_contiguous(o)
                (o * local(t["do"])).sum().backward()
                out[(backend, op)] = dict(o=o.detach(), **{f"d{n}": leaf.grad for n, leaf in ins.items()})
        results.append(out)
    return results


def check_cases(cases, per_rank, cp_size, rtol):
    """Every case's outputs and input gradients, put back together from the ranks' pieces (weight
    gradients are per-rank partial sums: added up), against the float64 reference."""
    __tracebackhide__ = True
    for i, case in enumerate(cases):
        cu, layout = case["cu"], case["layout"]
        ref = reference_case(case, use_qk_l2norm=case["l2norm"])
        for (backend, op), first in per_rank[0][i].items():
            got = {}
            for key in first:
                pieces = [per_rank[r][i][(backend, op)][key] for r in range(cp_size)]
                if key in ("dweight", "dbias"):
                    got[key] = torch.stack([p.double() for p in pieces]).sum(0)
                else:
                    got[key] = unshard(pieces, cu, layout)
            where = f"{backend}/{op}" if backend else op
            assert_parity(got, ref[op], rtol=rtol, name=f"cp{cp_size}/{case['name']}/{where}", cu_seqlens=cu)
