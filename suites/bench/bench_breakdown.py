"""Breakdown of one layer step (forward + backward): projections, conv, recurrence, norm,
collectives, and the remainder (glue) = layer time minus the sum of the measured parts.

    python suites/bench/bench_breakdown.py [--quick] [--shapes prod] [--tokens 16k,64k] [--tp 1] [--cp 1]
        [--iters 10] [--device auto] [--json FILE] [--plot DIR]

How the parts are measured: the layer step is timed whole; then one forward (no grad) records
every call the layer makes to a part, with the actual input tensors:
  projections  torch.nn.functional.linear and linattn.kernels.float32_linear (every projection)
  conv         layer._short_conv (the one short-conv call site; under CP with its halo exchange)
  recurrence   layer._delta_rule (the recurrence call site; under CP with its state exchange)
  norm         linattn.kernels.gated_rms_norm
  collectives  layer._enter/_exit_tensor_parallel_region and layer._replicated (TP mappings;
               the identity at TP = 1)
and each call is replayed alone, forward + backward with every floating input a leaf that needs
a gradient (as in the layer), median over --iters. Glue is what is left: gate math, reshapes,
concatenations, casts, gradient accumulation, launch gaps. Target: glue <= 10% at 16k and 64k
tokens, TP = 1 (the `glue <= 10%` column).
"""

from __future__ import annotations

import argparse

import torch

import linattn.kernels
from _common import Ranks, add_common_args, add_placement_args, case_row, finish, fmt, parse_ints, print_table, resolve_args, sweep
from _layer_case import build_case, parallel_groups, time_layer_step
from _timing import measure, oom_as_row

DEFAULTS = dict(shapes="prod", tokens="16k,64k", iters=10, warmup=3, tp="1", cp="1")
QUICK = dict(shapes="kimi-k3,qwen3-next")
PARTS = ["projections", "conv", "recurrence", "norm", "collectives"]
GLUE_LIMIT = 10.0  # percent of the layer step


def record_calls(layer, x, cu) -> list:
    """(part, fn, args, kwargs) of every call the layer's forward makes to a part (outermost only)."""
    calls, depth = [], [0]

    def wrap(part, fn):
        def recorded(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            calls.append((part, fn, args, kwargs))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return recorded

    module_patches = [(torch.nn.functional, "linear", "projections"), (linattn.kernels, "float32_linear", "projections"),
                      (linattn.kernels, "gated_rms_norm", "norm")]
    method_patches = {"_short_conv": "conv", "_delta_rule": "recurrence", "_replicated": "collectives",
                      "_enter_tensor_parallel_region": "collectives", "_exit_tensor_parallel_region": "collectives"}
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in module_patches]
    try:
        for obj, name, part in module_patches:
            setattr(obj, name, wrap(part, getattr(obj, name)))
        for name, part in method_patches.items():
            setattr(layer, name, wrap(part, getattr(layer, name)))  # the bound method, on the instance
        with torch.no_grad():
            layer(x.detach(), cu)
    finally:
        for obj, name, fn in originals:
            setattr(obj, name, fn)
        for name in method_patches:
            layer.__dict__.pop(name, None)
    return calls


def replay(fn, args, kwargs, *, iters: int, warmup: int, device) -> dict:
    """fn alone, forward + backward, every floating tensor input a fresh leaf needing a gradient."""
    leaves = []

    def leaf(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().requires_grad_()
            leaves.append(t)
        return t

    args = [leaf(a) for a in args]
    kwargs = {k: leaf(v) for k, v in kwargs.items()}
    cotangent = {}

    def bwd(out):
        # every output that carries a gradient (the conv's q, k and v, not q alone)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if "t" not in cotangent:  # made in the first (warm-up) iteration
            cotangent["t"] = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, cotangent["t"])

    def reset():
        for t in leaves:
            t.grad = None

    return measure(lambda: fn(*args, **kwargs), bwd, iters=iters, warmup=warmup, device=device, reset=reset)


@oom_as_row
def breakdown_case(case: dict) -> dict:
    """Rank function: the layer step, then every part alone."""
    tp_group, cp_group = parallel_groups(case["tp"], case["cp"])
    layer, x, dy, cu = build_case(case, tp_group, cp_group)
    step = time_layer_step(layer, x, dy, cu, iters=case["iters"], warmup=case["warmup"])
    calls = record_calls(layer, x, cu)
    del dy
    out = {"status": "ok", "ms": step["ms"], "peak_gib": step["peak_gib"], **{p: 0.0 for p in PARTS},
           "calls": {p: 0 for p in PARTS}}
    while calls:
        part, fn, args, kwargs = calls.pop(0)
        t = replay(fn, args, kwargs, iters=case["iters"], warmup=case["warmup"], device=x.device)
        if t["ms"] is None:
            return {"status": "error", "error": f"{part}: {t['bwd_error']}"}
        out[part] += t["ms"]
        out["calls"][part] += 1
        del fn, args, kwargs
    return out


def merge(case: dict, status: str, per_rank) -> dict:
    """Rank 0's numbers (the layer step and its parts from one rank), and the glue."""
    row = case_row(case, status, per_rank)
    if status == "ok":
        row.update(per_rank[0])
    if row.get("ms") is not None:
        row["glue"] = row["ms"] - sum(row[p] for p in PARTS)
        row["glue_pct"] = 100.0 * row["glue"] / row["ms"]
        row["verdict"] = "ok" if row["glue_pct"] <= GLUE_LIMIT else "MISS"
    return row


def describe(row: dict) -> str:
    parts = ", ".join(f"{p} {fmt(row.get(p))}" for p in PARTS)
    return f"{fmt(row.get('ms'))} ms ({parts}), glue {fmt(row.get('glue_pct'), '.1f')}%"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_common_args(parser)
    add_placement_args(parser, tp="1", cp="1")
    args = resolve_args(parser, argv, DEFAULTS, QUICK)
    placements = [(tp, cp) for tp in parse_ints(args.tp) for cp in parse_ints(args.cp)]
    world = max(tp * cp for tp, cp in placements)
    with Ranks(args.device, world) as ranks:
        rows = sweep("breakdown", args, ranks, placements, breakdown_case, merge, describe, sp=False,
                     layout="contiguous")
    if not ranks.is_main:
        return
    print()
    print(f"one layer step on {args.device} ({args.dtype}), median ms over {args.iters} iters; "
          f"glue = layer - sum of parts")
    print_table(rows, [("shape", "shape"), ("T", "tokens"), ("tp", "tp"), ("cp", "cp"), ("ms", "layer"),
                       *[(p, p[:11]) for p in PARTS], ("glue", "glue"), ("glue_pct", "glue %", ".1f"),
                       ("verdict", f"glue <= {GLUE_LIMIT:.0f}%"), ("status", "status"), ("error", "error")])
    finish("breakdown", args, rows, {"parts": PARTS})


if __name__ == "__main__":
    main()
