"""The float64 reference of the CP op tests (suites/cpu/test_cp_ops.py, suites/gpu-2/test_cp_ops_nccl.py):
short conv and both delta rules on the whole packed batch, outputs and every input's gradient.
"""

from __future__ import annotations

from linattn import reference

DELTA_RULES = ("gated_delta_rule", "kda")


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
