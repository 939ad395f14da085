"""What the CP op tests share (suites/cpu/library/test_cp_ops.py, suites/gpu-2/test_cp_ops_gpu2.py): the
token layout they shard and unshard with, and the float64 reference (short conv and both delta
rules on the whole packed batch, outputs and every input's gradient).

The layout is the harness's `rank_token_index`, written from the documented definition, never
linattn's `cp_shard` / `cp_unshard`: a layout bug those share with the ops would cancel out.
"""

from __future__ import annotations

import math

import torch

from linattn import reference
from pytest_linattn.sharded_parity import Placement, rank_token_index

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
