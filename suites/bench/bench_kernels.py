"""Kernel table: every op at the layers' shapes, per backend, forward and forward + backward.

    python suites/bench/bench_kernels.py [--quick] [--shapes prod] [--tokens 4k,16k,64k] [--tp 1]
        [--iters 10] [--device auto] [--json FILE] [--plot DIR]

Ops (the layer's two kernel call sites, at its TP-local shapes; cu_seqlens of --seqs sequences):
  short_conv        q|k|v channels, width 4, SiLU: backends triton, mix, cuda (fla 0.6.0; torch on
                    a CPU)
  kda               chunk_kda (KDA shapes)
  gated_delta_rule  routes gated_delta_rule (fla's chunk_gated_delta_rule) and kda (GDN as
                    chunk_kda with the gate broadcast over the key channels) (GDN shapes)
plus an `auto` row per op: the entry called without backend/route, i.e. what linattn.selection
picked on this machine (named in the `picked` column). A backend that fails (e.g. fla refusing
GDN's backward on Hopper with Triton 3.6) keeps its forward time and shows the error.
The backends of one op and shape (the `auto` row with them) are timed in interleaved rounds, so
drift reaches all alike. Ends with the check: `auto` within 3% of the fastest backend (fwd + bwd)
on every shape.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _common import (DTYPES, add_common_args, checkpoint, cu_seqlens, finish, fmt, make_config, print_table,
                     resolve_args, tokens_label)
from _timing import first_line, free_memory, is_oom, measure_interleaved

DEFAULTS = dict(shapes="prod", tokens="4k,16k,64k", iters=10, warmup=3, tp="1")
QUICK = dict(tokens="16k")
TOLERANCE = 0.03  # auto within 3% of the fastest backend


def backends(op: str, device: str) -> list[str]:
    if op == "short_conv":
        return ["triton", "mix", "cuda"] if device == "cuda" else ["torch"]
    if op == "kda":
        return ["chunk_kda" if device == "cuda" else "torch"]
    return ["gated_delta_rule", "kda"]


def picked(op: str, device: str) -> str:
    from linattn import selection

    if op == "short_conv":
        return selection.short_conv_backend() if device == "cuda" else "torch"
    if op == "kda":
        return backends("kda", device)[0]
    return selection.gdn_route() if device == "cuda" else "gated_delta_rule"


def make_inputs(op: str, config, T: int, seqs: int, device, dtype, seed: int):
    """Leaf inputs as the layer passes them (q, k, v in the layer dtype; the decay g and KDA's beta
    in float32), the call's fixed keyword arguments, and the output cotangent."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    cu = cu_seqlens(T, seqs).to(device)
    H, HV, K, V = config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim
    if op == "short_conv":
        x = randn(1, T, config.conv_dim)
        w = randn(config.conv_dim, config.conv_size) / config.conv_size ** 0.5
        return [x, w], dict(cu_seqlens=cu, activation="silu"), randn(1, T, config.conv_dim)
    gate_shape = (1, T, HV, K) if op == "kda" else (1, T, HV)
    g = F.logsigmoid(randn(*gate_shape, dt=torch.float32))
    beta = torch.sigmoid(randn(1, T, HV, dt=torch.float32 if op == "kda" else dtype))
    inputs = [randn(1, T, H, K), randn(1, T, H, K), randn(1, T, HV, V), g, beta]
    kwargs = dict(scale=K ** -0.5, cu_seqlens=cu, use_qk_l2norm=True)
    return inputs, kwargs, randn(1, T, HV, V)


def call(op: str, backend: str | None):
    from linattn import kernels

    if op == "short_conv":
        return lambda *a, **kw: kernels.short_conv(*a, backend=backend, **kw)
    if op == "kda":
        return lambda *a, **kw: kernels.kda(*a, **kw)[0]
    return lambda *a, **kw: kernels.gated_delta_rule(*a, route=backend, **kw)[0]


def time_backends(op, names, inputs, kwargs, cotangent, args) -> dict:
    """backend -> row fields: every backend of one op and shape timed in interleaved rounds (the
    `auto` row against the others under the same conditions), each on its own leaf inputs."""
    calls = {}
    for backend in names:
        fn = call(op, None if backend == "auto" or op == "kda" else backend)
        leaves = [t.detach().requires_grad_() for t in inputs]

        def reset(leaves=leaves):
            for t in leaves:
                t.grad = None

        calls[backend] = (lambda fn=fn, leaves=leaves: fn(*leaves, **kwargs), lambda o: o.backward(cotangent), reset)
    rows = {}
    timed = measure_interleaved(calls, iters=args.iters, warmup=args.warmup, device=args.device, isolate=True)
    for backend, t in timed.items():
        if isinstance(t, BaseException):  # a failing backend is a row
            rows[backend] = {"status": "OOM" if is_oom(t) else "error", "error": None if is_oom(t) else first_line(t)}
        else:
            rows[backend] = {"status": "ok" if t["bwd_error"] is None else "fwd only", "fwd_ms": t["fwd_ms"],
                             "ms": t["ms"], "error": t["bwd_error"]}
    return rows


def check_auto(rows: list[dict]) -> list[dict]:
    """Per (shape, tp, tokens, op): the fastest backend and whether auto is within TOLERANCE of it."""
    verdicts = []
    keys = list(dict.fromkeys((r["shape"], r["tp"], r["tokens"], r["op"]) for r in rows))
    for key in keys:
        group = [r for r in rows if (r["shape"], r["tp"], r["tokens"], r["op"]) == key]
        timed = [r for r in group if r["backend"] != "auto" and r.get("ms") is not None]
        auto = next((r for r in group if r["backend"] == "auto"), None)
        if not timed or auto is None or auto.get("ms") is None:
            verdicts.append(dict(zip(("shape", "tp", "tokens", "op"), key), ok=None, fastest=None, ratio=None))
            continue
        best = min(timed, key=lambda r: r["ms"])
        ratio = auto["ms"] / best["ms"]
        verdicts.append(dict(zip(("shape", "tp", "tokens", "op"), key), fastest=best["backend"],
                             picked=auto["picked"], ratio=ratio, ok=ratio <= 1 + TOLERANCE))
    return verdicts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_common_args(parser)
    parser.add_argument("--tp", help="comma list: time each TP rank's shard of the heads (default 1)")
    args = resolve_args(parser, argv, DEFAULTS, QUICK)
    device, dtype = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"), DTYPES[args.dtype]
    if args.device == "cuda":
        torch.cuda.set_device(0)
    rows = []
    print(f"kernels on {args.device} ({args.dtype}), {args.iters} iters after {args.warmup} warm-up, median ms")
    for shape in args.shape_list:
        for tp in [int(t) for t in str(args.tp).split(",")]:
            config = make_config(shape).local(tp)
            for T in args.token_list:
                for op in ("short_conv", config.op):
                    try:
                        inputs, kwargs, cotangent = make_inputs(op, config, T, args.seqs, device, dtype, args.seed)
                    except Exception as exc:  # noqa: BLE001
                        free_memory()
                        rows.append(dict(shape=shape, tp=tp, tokens=T, op=op, backend="-",
                                         status="OOM" if is_oom(exc) else "error", error=first_line(exc)))
                        continue
                    timed = time_backends(op, backends(op, args.device) + ["auto"], inputs, kwargs, cotangent, args)
                    for backend, result in timed.items():
                        row = dict(shape=shape, tp=tp, tokens=T, op=op, backend=backend,
                                   picked=picked(op, args.device) if backend == "auto" else None, **result)
                        rows.append(row)
                        print(f"  {shape} tp{tp} {tokens_label(T)} {op} {backend}: {row['status']} "
                              f"{fmt(row.get('ms'), '.3f')} ms", flush=True)
                        checkpoint("kernels", args, rows)
                    del inputs, kwargs, cotangent
                    free_memory()
    for r in rows:
        r["T"] = tokens_label(r["tokens"])
    print()
    print_table(rows, [("shape", "shape"), ("tp", "tp"), ("T", "tokens"), ("op", "op"), ("backend", "backend"),
                       ("picked", "picked"), ("fwd_ms", "fwd ms", ".3f"), ("ms", "fwd+bwd ms", ".3f"),
                       ("status", "status"), ("error", "error")])
    verdicts = check_auto(rows)
    for v in verdicts:
        v["T"] = tokens_label(v["tokens"])
        v["verdict"] = {True: "ok", False: "MISS", None: "n/a"}[v["ok"]]
    print()
    print_table(verdicts, [("shape", "shape"), ("tp", "tp"), ("T", "tokens"), ("op", "op"), ("picked", "auto picked"),
                           ("fastest", "fastest"), ("ratio", "auto/fastest", ".3f"), ("verdict", "within 3%")])
    judged = [v for v in verdicts if v["ok"] is not None]
    print(f"auto within {TOLERANCE:.0%} of the fastest backend: {sum(v['ok'] for v in judged)}/{len(judged)} shapes")
    finish("kernels", args, rows, {"auto_check": verdicts})


if __name__ == "__main__":
    main()
