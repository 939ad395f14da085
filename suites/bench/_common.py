"""What the benchmark scripts share (bench_kernels, bench_layers, bench_breakdown): the shapes,
the CLI, where rank functions run, the sweep over cases, tables and JSON.

Beside it: _timing.py (how a call is timed), _layer_case.py (the rank side of one sharded layer
case) and plot.py (the PNG plots, also a script that re-plots saved JSON).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# runnable from a bare checkout: the library from the repository, cases.layer_parity from suites/
for _path in (str(ROOT), str(ROOT / "suites")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from _timing import first_line, free_memory, is_oom  # noqa: E402
from linattn.layers import LinearAttentionConfig  # noqa: E402
from plot import plot, tokens_label  # noqa: E402
from pytest_linattn import autotune  # noqa: E402
from pytest_linattn.options import DEVICES  # noqa: E402
from pytest_linattn.ranks.dispatch import run_on_ranks  # noqa: E402
from pytest_linattn.ranks.launcher import launcher_world_size  # noqa: E402
from pytest_linattn.ranks.pool import PoolManager, RankFailure, to_cpu  # noqa: E402

# ---------------------------------------------------------------------------------------------
# shapes

# Production layers: their heads and widths; the rest as in the released layers of the same
# families: conv width 4; KDA with Kimi Linear's low-rank output gate (rank = head dim) and its
# unbounded gate.
SHAPES = {
    "kimi-k3": dict(family="kda", hidden_size=7168, num_k_heads=96, num_v_heads=96,
                    head_k_dim=128, head_v_dim=128, output_gate_rank=128),
    "glm-5.3-flash": dict(family="kda", hidden_size=4096, num_k_heads=64, num_v_heads=64,
                          head_k_dim=128, head_v_dim=128, output_gate_rank=128),
    "qwen3-next": dict(family="qwen3_next", hidden_size=2048, num_k_heads=16, num_v_heads=32,
                       head_k_dim=128, head_v_dim=128),
    # Qwen3.5's layout (separate q/k/v, z, b, a projections: fla's GatedDeltaNet's) at its config's
    # defaults (transformers' Qwen3_5TextConfig); not in "prod": bench_vs_fla's like-for-like GDN row
    "qwen3.5": dict(family="qwen3_5", hidden_size=4096, num_k_heads=16, num_v_heads=32,
                    head_k_dim=128, head_v_dim=128),
    # CPU smoke shapes: every code path, seconds on two cores
    "tiny-kda": dict(family="kda", hidden_size=64, num_k_heads=4, num_v_heads=4,
                     head_k_dim=16, head_v_dim=16, output_gate_rank=16),
    "tiny-gdn": dict(family="qwen3_next", hidden_size=64, num_k_heads=2, num_v_heads=4,
                     head_k_dim=16, head_v_dim=16),
}
SHAPE_GROUPS = {"prod": ["kimi-k3", "glm-5.3-flash", "qwen3-next"], "tiny": ["tiny-kda", "tiny-gdn"]}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def make_config(shape: str) -> LinearAttentionConfig:
    return LinearAttentionConfig(**SHAPES[shape])


def parse_shapes(text: str) -> list[str]:
    out = []
    for name in text.split(","):
        name = name.strip()
        for s in SHAPE_GROUPS.get(name, [name]):
            if s not in SHAPES:
                raise SystemExit(f"unknown shape {s!r}: pick from {', '.join([*SHAPE_GROUPS, *SHAPES])}")
            if s not in out:
                out.append(s)
    return out


def parse_tokens(text: str) -> list[int]:
    """'4k,16k,65536' -> [4096, 16384, 65536] (k = 1024)."""
    out = []
    for t in text.split(","):
        t = t.strip().lower()
        out.append(int(t[:-1]) * 1024 if t.endswith("k") else int(t))
    return out


def parse_ints(text: str) -> list[int]:
    return [int(t) for t in str(text).split(",")]


def cu_seqlens(T: int, seqs: int) -> torch.Tensor:
    """`seqs` equal packed sequences of T tokens in all (the last takes the remainder)."""
    step = T // seqs
    bounds = [i * step for i in range(seqs)] + [T]
    return torch.tensor(bounds, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# CLI

def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Options every script takes; defaults None so `resolve_args` can tell what was given."""
    parser.add_argument("--shapes", help="comma list of shapes or groups: prod = kimi-k3,glm-5.3-flash,"
                        "qwen3-next; tiny = tiny-kda,tiny-gdn (CPU smoke)")
    parser.add_argument("--tokens", help="comma list of packed-batch token counts, k = 1024 (4k,16k,64k)")
    parser.add_argument("--iters", type=int, help="timed iterations per row (median; default 10)")
    parser.add_argument("--warmup", type=int, help="untimed iterations first (default 3)")
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--seqs", type=int, default=1, help="equal-length packed sequences per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a CPU run (1: steadiest on a shared box)")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the machine as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots (matplotlib, Agg) to DIR")
    parser.add_argument("--quick", action="store_true", help="the small set for one GPU call (~2-3 min)")
    parser.add_argument("--autotune", choices=autotune.MODES, default="search",
                        help="kernel configs on CUDA (pytest_linattn.autotune): search (default: Triton's "
                        "autotune, the fastest config), shipped, or first (no search, minutes less on a "
                        "fresh machine); the ranks a pool starts inherit it")


def add_placement_args(parser: argparse.ArgumentParser, tp: str, cp: str) -> None:
    """--tp / --cp (comma lists; defaults tp, cp) and the per-case --timeout of the rank tables."""
    parser.add_argument("--tp", help=f"comma list of TP sizes (default {tp})")
    parser.add_argument("--cp", help=f"comma list of CP sizes (default {cp})")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case before the ranks are killed")


def resolve_args(parser, argv, defaults: dict, quick: dict):
    """Parse; every option left unset takes the --quick value (with --quick) or the default."""
    args = parser.parse_args(argv)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, quick[key] if args.quick and key in quick else value)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible")
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.device == "cpu":
        torch.set_num_threads(args.threads)  # spawned CPU ranks get OMP_NUM_THREADS from the pool
    else:
        print(autotune.apply(args.autotune).describe(), flush=True)
    if args.iters < 1 or args.warmup < 0 or args.seqs < 1:
        parser.error("--iters must be >= 1, --warmup >= 0, --seqs >= 1")
    args.shape_list = parse_shapes(args.shapes)
    args.token_list = parse_tokens(args.tokens)
    return args


# ---------------------------------------------------------------------------------------------
# where rank functions run

class Ranks:
    """Runs a rank function on `world_size` ranks: in this process (one rank), on torchrun's world
    (WORLD_SIZE set: every process runs the script, rank 0 prints), or on pytest_linattn's spawned
    rank pool (no pytest needed; gloo on CPU, NCCL on GPU). Returns every rank's value."""

    def __init__(self, device: str, world_size: int):
        self.device = device
        self.launched = launcher_world_size()
        self.world_size = self.launched or world_size
        self._pools = None

    @property
    def is_main(self) -> bool:
        return self.launched is None or os.environ.get("RANK", "0") == "0"

    def run(self, fn, *args, timeout: float = 900.0):
        """("ok", [value per rank]) or ("OOM" | "error", message): a failure is a row, not a crash."""
        try:
            if self.launched is None and self.world_size == 1:
                if self.device == "cuda":
                    torch.cuda.set_device(0)
                return "ok", [to_cpu(fn(*args))]
            return "ok", run_on_ranks(fn, self.world_size, args, device=self.device, timeout=timeout,
                                      pools=self._manager)
        except RankFailure as exc:
            text = str(exc)
            oom = "OutOfMemoryError" in text or "out of memory" in text.lower()
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            return ("OOM" if oom else "error"), (lines[-1] if lines else "rank failure")[:200]
        except Exception as exc:  # noqa: BLE001 - one process: the case failed, the run goes on
            free_memory()
            return ("OOM" if is_oom(exc) else "error"), first_line(exc)

    def _manager(self) -> PoolManager:
        if self._pools is None:
            self._pools = PoolManager(self.device)
        return self._pools

    def close(self) -> None:
        if self._pools is not None:
            self._pools.close()
            self._pools = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sweep(bench: str, args, ranks: Ranks, placements, rank_fn, merge, describe, **case_fields) -> list[dict]:
    """One row per (shape, tokens, tp, cp): rank_fn(case) on every rank through `ranks`, merged into
    a row by merge(case, status, per_rank) (status "ok", "OOM", "error", or "skipped: ..." when the
    world cannot hold the placement), printed by rank 0 as `describe(row)` and written to --json as
    it lands. case_fields: what the rank function needs beyond the shared ones."""
    rows = []
    for shape in args.shape_list:
        for T in args.token_list:
            for tp, cp in placements:
                case = dict(shape=shape, tokens=T, tp=tp, cp=cp, seqs=args.seqs, seed=args.seed, device=args.device,
                            dtype=args.dtype, iters=args.iters, warmup=args.warmup, **case_fields)
                if ranks.world_size % (tp * cp):
                    status, result = f"skipped: needs {tp * cp} ranks", None
                else:
                    try:
                        status, result = ranks.run(rank_fn, case, timeout=args.timeout)
                    except Exception as exc:  # noqa: BLE001 - a failed case is a row
                        status, result = "error", first_line(exc)
                row = {"T": tokens_label(T), **merge(case, status, result)}
                rows.append(row)
                if ranks.is_main:
                    print(f"  {shape} {row['T']} tp{tp} cp{cp}: {row['status']} {describe(row)}", flush=True)
                    checkpoint(bench, args, rows)
    return rows


def case_row(case: dict, status: str, per_rank) -> dict:
    """A row's key columns, and its status and error when the case did not run or failed."""
    row = {k: case[k] for k in ("shape", "tokens", "tp", "cp")}
    if status != "ok":
        row.update(status=status, error=per_rank if status == "error" else None)
    return row


# ---------------------------------------------------------------------------------------------
# output

def machine(device: str) -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__}
    for dist_name in ("triton", "fla-core", "flash-linear-attention", "causal-conv1d"):
        try:
            info[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            info[dist_name] = None
    if device == "cuda":
        info["device"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        info["device"] = platform.processor() or platform.machine()
        info["cpus"] = os.cpu_count()
    return info


def selection_choices() -> dict:
    """What linattn.selection picks on this machine, with its reasons."""
    from linattn import selection

    facts = selection.read_facts()
    return {name: {"value": choice.value, "reason": choice.reason} for name, choice in (
        ("short_conv_backend", selection.choose_short_conv_backend(facts)),
        ("gdn_route", selection.choose_gdn_route(facts)),
        ("gate_norm", selection.choose_gate_norm_backend(facts)),
        ("kda_tilelang", selection.choose_kda_tilelang(facts)))}


def fmt(value, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def print_table(rows: list[dict], columns: list[tuple]) -> None:
    """columns: (key, header[, format spec]); missing values print as '-'."""
    cells = [[fmt(r.get(c[0]), c[2] if len(c) > 2 else ".2f") for c in columns] for r in rows]
    widths = [max([len(c[1])] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c[1].rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), flush=True)


def _payload(bench: str, args, rows: list[dict], extra: dict | None, complete: bool) -> dict:
    payload = {"bench": bench, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "complete": complete, "machine": machine(args.device), "selection": selection_choices(),
               "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
               "rows": rows, **(extra or {})}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return payload


def checkpoint(bench: str, args, rows: list[dict]) -> None:
    """Write --json with the rows so far ("complete": false): a run cut short (a time limit, a
    crash) keeps every row it measured."""
    _payload(bench, args, rows, None, complete=False)


def finish(bench: str, args, rows: list[dict], extra: dict | None = None) -> dict:
    """Write --json and --plot outputs; returns the payload."""
    payload = _payload(bench, args, rows, extra, complete=True)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        try:
            for path in plot(payload, args.plot):
                print(f"wrote {path}")
        except ImportError:
            print(f"matplotlib is missing: plot later with python suites/bench/plot.py "
                  f"{args.json or 'FILE.json'} --out {args.plot}")
    return payload
