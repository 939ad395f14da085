"""Long-decode error growth: linattn's layer decoding token by token against the float64 serial run.

    python suites/bench/bench_long_decode.py --out DIR [--families qwen3_next,qwen3_5,kda]
        [--steps 2048] [--prefill 16] [--sequences 2] [--dtype bf16|fp32|fp64] [--device auto]
        [--plant bf16-state] [--seed 0] [--autotune shipped]

Per family: one rank (TP 1, through pytest_linattn's rank pool; one GPU on CUDA) runs a prefill
call, then --steps decode steps in --dtype, each from the state the previous returned; the
errors are `pytest_linattn.harness.long_decode_errors`, the ones `assert_long_decode_parity`
judges: per decode step t, the relative error over every sequence of the outputs and of each
state field (the float64 serial run through the layer's decode step: its forward's result to
~1e-15, in a fraction of the time). The layer is the CPU suites' tiny layer (cases.layer_parity.make_config) on a CPU and the
GPU suites' (cases.layer_parity.gpu_config, fla's init, bf16-rounded weights) on CUDA.

--plant bf16-state adds the same run with the recurrent state stored in bf16 after every token
(dashed in the plot), against the layer that keeps it in float32.

Writes DIR/long_decode.json (every step's errors) and DIR/long_decode.png (error vs decode step,
log-log, with the bound rtol * max(1, t/warmup)^0.5 dashed: rtol 2e-2 for bf16, 1e-5 for
float32), then prints a table: per family, variant and field, the error at decode steps 1, 16,
256, 1024, 2048 (those within --steps) and the growth exponent fitted over the second half
(0.5: a random walk of rounding errors; 1: linear drift).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from _common import DTYPES, machine, print_table
from _decode_plants import PLANTS
from _timing import first_line
from cases.layer_parity import FAMILIES, GPU_PARALLEL_FAMILIES, gpu_config, linattn_state_path, make_config, random_state_dict
from linattn.layers import build_layer
from plot import plot
from pytest_linattn import autotune
from pytest_linattn.harness import Placement, long_decode_errors
from pytest_linattn.options import DEVICES
from pytest_linattn.ranks.pool import PoolManager, RankFailure

TABLE_STEPS = (1, 16, 256, 1024, 2048)
# the bound drawn for reference: assert_long_decode_parity's, at the rtol of the compute dtype
# (bf16: the GPU suites' BF16_RTOL; float32 and float64: the design's float32 parity)
BOUND_RTOL = {"bf16": 2e-2, "fp32": 1e-5, "fp64": 1e-5}
BOUND_GROWTH, BOUND_WARMUP = 0.5, 16


def layer_config(family: str, device: str):
    if device == "cuda":
        return gpu_config(family, **GPU_PARALLEL_FAMILIES[family])
    return make_config(family, 1)


def reference_layer(config, seed: int, device: str) -> torch.nn.Module:
    """The float64 replicated layer; on CUDA with fla's init and bf16-rounded weights (the GPU
    suites': the reference sees the weights the bf16 ranks see)."""
    cuda = device == "cuda"
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(config, seed, fla_init=cuda, round_to=torch.bfloat16 if cuda else None))
    return layer


def reference_step(reference, x, cu_seqlens, state):
    """The serial run's call: the float64 layer's own decode step (one token per sequence, as
    its forward computes it to ~1e-15, several times faster than a forward per token)."""
    return reference.step(x, state)


def growth_exponent(errors: list[float]) -> float | None:
    """Least-squares slope of log error against log step over the second half of the steps
    (errors[t - 1] is step t's)."""
    steps = len(errors)
    points = [(math.log(t), math.log(e)) for t, e in enumerate(errors, 1)
              if t >= max(2, steps // 2) and e > 0 and math.isfinite(e)]
    if len(points) < 2:
        return None
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    var = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else None


def failure_line(exc: Exception) -> str:
    """One line for the table: a rank's traceback ends with what went wrong."""
    if isinstance(exc, RankFailure):
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return (lines[-1] if lines else "rank failure")[:200]
    return first_line(exc)


def series_of(family: str, variant: str, errors: dict) -> list[dict]:
    """One series per field (the output, each state field): decode steps 1..steps."""
    dtypes = {}
    for per_call in errors["state_dtypes"][0][1:]:
        for field, dtype in per_call.items():
            dtypes.setdefault(field, set()).add(str(dtype).removeprefix("torch."))
    out = [{"family": family, "variant": variant, "field": "output", "state_dtype": None,
            "prefill_error": errors["outputs"]["output"][0], "errors": errors["outputs"]["output"][1:]}]
    for field, errs in errors["states"].items():
        out.append({"family": family, "variant": variant, "field": f"state {field}",
                    "state_dtype": ",".join(sorted(dtypes.get(field, ()))), "prefill_error": errs[0],
                    "errors": errs[1:]})
    return out


def table_row(series: dict) -> dict:
    errs = series["errors"]
    row = {k: series[k] for k in ("family", "variant", "field", "state_dtype")}
    row.update({f"t{t}": errs[t - 1] for t in TABLE_STEPS if t <= len(errs)})
    row["growth"] = growth_exponent(errs)
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", required=True, metavar="DIR", help="where long_decode.json and .png go")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    parser.add_argument("--steps", type=int, default=2048, help="decode steps after the prefill")
    parser.add_argument("--prefill", type=int, default=16, help="tokens of the prefill call per sequence")
    parser.add_argument("--sequences", type=int, default=2, help="sequences decoded side by side")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="the rank's dtype (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--plant", choices=tuple(PLANTS), action="append", default=[],
                        help="also run this planted decode (dashed in the plot)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a CPU run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run before the rank is killed")
    parser.add_argument("--autotune", choices=autotune.MODES, default="shipped",
                        help="kernel configs on CUDA (pytest_linattn.autotune; shipped: the parity runs' default)")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        parser.error(f"unknown families {unknown}: pick from {', '.join(FAMILIES)}")
    if min(args.steps, args.prefill, args.sequences) < 1:
        parser.error("--steps, --prefill and --sequences must be >= 1")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)  # spawned CPU ranks get OMP_NUM_THREADS from the pool
    else:
        print(autotune.apply(args.autotune).describe(), flush=True)
    dtype = DTYPES[args.dtype]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = [("layer", {})] + [(f"{p} plant", {"decode": PLANTS[p]}) for p in args.plant]
    print(f"long decode on {args.device} ({args.dtype} rank, TP 1): {args.sequences} sequences, {args.prefill}-token "
          f"prefill, {args.steps} decode steps, against the float64 serial run", flush=True)

    series, failures = [], []
    with PoolManager(args.device) as pools:
        def spawn(fn, world_size, *fn_args):
            return pools.run(fn, world_size, fn_args, timeout=args.timeout)

        for family in families:
            config = layer_config(family, args.device)
            reference = reference_layer(config, args.seed, args.device)
            for variant, fields in variants:
                start = time.perf_counter()
                try:
                    errors = long_decode_errors(spawn, linattn_state_path(config, **fields), reference,
                                                Placement(tp=1), num_sequences=args.sequences, prefill=args.prefill,
                                                steps=args.steps, hidden_size=config.hidden_size, seed=args.seed,
                                                dtype=dtype, reference_forward=reference_step)
                except Exception as exc:  # noqa: BLE001 - a failed run is a row; the other families still run
                    failures.append({"family": family, "variant": variant, "error": failure_line(exc)})
                    print(f"  {family} {variant}: failed: {failures[-1]['error']}", flush=True)
                    continue
                series += series_of(family, variant, errors)
                last = {s["field"]: s["errors"][-1] for s in series[-len(errors["states"]) - 1:]}
                print(f"  {family} {variant}: {time.perf_counter() - start:.1f} s; at step {args.steps}: "
                      + ", ".join(f"{k} {v:.1e}" for k, v in last.items()), flush=True)
            # after each family: a run cut short keeps what it measured
            payload = write_outputs(args, series, failures, out_dir, complete=family == families[-1])

    print()
    print(f"relative error vs the float64 serial run at decode step t ({args.dtype} rank); growth: the slope of "
          f"log error vs log t over steps {max(2, args.steps // 2)}-{args.steps}")
    print_table(payload["rows"], [("family", "family"), ("variant", "variant"), ("field", "field"),
                                  ("state_dtype", "state dtype")]
                + [(f"t{t}", f"t={t}", ".1e") for t in TABLE_STEPS if t <= args.steps]
                + [("growth", "growth")] + ([("error", "error")] if failures else []))
    return payload


def write_outputs(args, series: list[dict], failures: list[dict], out_dir: Path, *, complete: bool) -> dict:
    """DIR/long_decode.json and, with any series, DIR/long_decode.png; returns the JSON's payload."""
    rows = [table_row(s) for s in series] + failures
    payload = {"bench": "long_decode", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "complete": complete, "machine": machine(args.device), "args": vars(args),
               "bound": {"rtol": BOUND_RTOL[args.dtype], "growth": BOUND_GROWTH, "warmup": BOUND_WARMUP},
               "series": series, "failures": failures, "rows": rows}
    json_path = out_dir / "long_decode.json"
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    written = [json_path] + (plot(payload, out_dir) if series else [])
    if complete:
        for path in written:
            print(f"wrote {path}")
    return payload

if __name__ == "__main__":
    main()
