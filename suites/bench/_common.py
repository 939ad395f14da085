"""What the benchmark scripts share (bench_kernels, bench_layers, bench_breakdown): the shapes,
the CLI, timing, where rank functions run, the sharded layer of one case, tables, JSON and plots.

Timing: CUDA events on a GPU, time.perf_counter on a CPU; the median over `iters` iterations
after `warmup` untimed ones (the first of which compiles and autotunes Triton kernels).

Re-plot saved results (on a machine with matplotlib):

    python suites/bench/_common.py plot results/kernels.json results/layers.json --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# runnable from a bare checkout: the library from the repository, layer_parity from suites/
for _path in (str(ROOT), str(ROOT / "suites")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from linattn.layers import LinearAttentionConfig  # noqa: E402

# ---------------------------------------------------------------------------------------------
# shapes

# Production layers (the list). Not given there, so taken from the released layers of the
# same families: conv width 4; KDA with Kimi Linear's low-rank output gate (rank = head dim) and
# its unbounded gate.
SHAPES = {
    "kimi-k3": dict(family="kda", hidden_size=7168, num_k_heads=96, num_v_heads=96,
                    head_k_dim=128, head_v_dim=128, output_gate_rank=128),
    "glm-5.3-flash": dict(family="kda", hidden_size=4096, num_k_heads=64, num_v_heads=64,
                          head_k_dim=128, head_v_dim=128, output_gate_rank=128),
    "qwen3-next": dict(family="qwen3_next", hidden_size=2048, num_k_heads=16, num_v_heads=32,
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


def tokens_label(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


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
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--seqs", type=int, default=1, help="equal-length packed sequences per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of a CPU run (1: steadiest on a shared box)")
    parser.add_argument("--json", metavar="FILE", help="write the rows and the machine as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots (matplotlib, Agg) to DIR")
    parser.add_argument("--quick", action="store_true", help="the small set for one GPU call (~2-3 min)")


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
    if args.iters < 1 or args.warmup < 0 or args.seqs < 1:
        parser.error("--iters must be >= 1, --warmup >= 0, --seqs >= 1")
    args.shape_list = parse_shapes(args.shapes)
    args.token_list = parse_tokens(args.tokens)
    return args


# ---------------------------------------------------------------------------------------------
# timing

def measure(fwd, bwd=None, *, iters: int, warmup: int, device, reset=None) -> dict:
    """Median ms of `fwd()` and of `fwd()` + `bwd(out)` over `iters` iterations after `warmup`.

    reset() runs untimed before every iteration (drop gradients). If bwd raises on the first
    iteration (not out of memory), the forward alone is timed and `bwd_error` says why.
    """
    result = measure_interleaved({"": (fwd, bwd, reset)}, iters=iters, warmup=warmup, device=device)[""]
    if isinstance(result, BaseException):
        raise result
    return result


def measure_interleaved(calls: dict, *, iters: int, warmup: int, device, isolate: bool = False) -> dict:
    """measure() for several callables (name -> (fwd, bwd or None, reset or None)) in rounds: each
    of `warmup` + `iters` rounds runs one iteration of every callable, in an order rotated every
    round, so drift (clocks, other processes) reaches all of them alike and their ratios compare
    fairly. A callable whose first iteration raises is dropped and gets the exception as its
    result; the others go on.

    isolate (CUDA): every iteration starts on an idle GPU with its L2 cache flushed (256 MiB
    written, as triton's do_bench does, then a synchronize), so no callable's time holds the
    work another left queued (which hides a short op's launch gaps) or the data it left in L2.
    For ops of a few ms; a layer step needs neither.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    flush = torch.empty(2 ** 26, dtype=torch.int32, device=device) if cuda and isolate else None
    names = list(calls)
    results, marks, bwd_error = {}, {n: [] for n in names}, dict.fromkeys(names)
    for i in range(warmup + iters):
        shift = i % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            fwd, bwd, reset = calls[name]
            try:
                stamps, refused = _iteration(fwd, None if bwd_error[name] else bwd, reset, cuda, flush)
            except Exception as exc:  # noqa: BLE001 - one callable fails, the others go on
                if i > 0:
                    raise
                results[name] = exc
                free_memory()
                continue
            if refused is not None:  # a refused backward is a result (forward only), not a crash
                if i > 0:
                    raise refused
                bwd_error[name] = first_line(refused)
            if i >= warmup:
                marks[name].append(stamps)
        names = [n for n in names if n not in results]
    if cuda:
        torch.cuda.synchronize(device)

    def ms(a, b):
        return a.elapsed_time(b) if cuda else (b - a) * 1e3

    for name in names:
        both = calls[name][1] is not None and bwd_error[name] is None
        results[name] = {"fwd_ms": statistics.median(ms(m[0], m[1]) for m in marks[name]),
                         "ms": statistics.median(ms(m[0], m[2]) for m in marks[name]) if both else None,
                         "bwd_error": bwd_error[name]}
    return results


def _iteration(fwd, bwd, reset, cuda: bool, flush=None):
    """One iteration: its three stamps (start, forward done, backward done; CUDA events on a GPU,
    read after one synchronize at the end; perf_counter on a CPU) and the exception bwd raised,
    if any (out of memory propagates). flush: a CUDA buffer to overwrite (evicting L2) and wait
    for before the start stamp."""

    def stamp():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    if reset is not None:
        reset()
    if flush is not None:
        flush.zero_()
        torch.cuda.synchronize(flush.device)
    stamps = [stamp()]
    out = fwd()
    stamps.append(stamp())
    refused = None
    if bwd is not None:
        try:
            bwd(out)
        except Exception as exc:  # noqa: BLE001 - the caller decides
            if is_oom(exc):
                raise
            refused = exc
    stamps.append(stamp())
    return stamps, refused


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    """Peak CUDA memory allocated since reset_peak, GiB (None on a CPU)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2 ** 30


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def first_line(exc) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# where rank functions run

class Ranks:
    """Runs a rank function on `world_size` ranks: in this process (one rank), on torchrun's world
    (WORLD_SIZE set: every process runs the script, rank 0 prints), or on pytest_linattn's spawned
    rank pool (no pytest needed; gloo on CPU, NCCL on GPU). Returns every rank's value."""

    def __init__(self, device: str, world_size: int):
        from pytest_linattn.pool import launcher_world_size

        self.device = device
        self.launched = launcher_world_size()
        self.world_size = self.launched or world_size
        self._pools = None

    @property
    def is_main(self) -> bool:
        return self.launched is None or os.environ.get("RANK", "0") == "0"

    def run(self, fn, *args, timeout: float = 900.0):
        """("ok", [value per rank]) or ("OOM" | "error", message): a failure is a row, not a crash."""
        from pytest_linattn.pool import PoolManager, RankFailure, run_in_launcher, to_cpu

        try:
            if self.launched:
                return "ok", run_in_launcher(fn, self.world_size, args, device=self.device, timeout=timeout)
            if self.world_size == 1:
                if self.device == "cuda":
                    torch.cuda.set_device(0)
                return "ok", [to_cpu(fn(*args))]
            if self._pools is None:
                self._pools = PoolManager(self.device)
            return "ok", self._pools.run(fn, self.world_size, args, timeout=timeout)
        except RankFailure as exc:
            text = str(exc)
            oom = "OutOfMemoryError" in text or "out of memory" in text.lower()
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            return ("OOM" if oom else "error"), (lines[-1] if lines else "rank failure")[:200]
        except Exception as exc:  # noqa: BLE001 - one process: the case failed, the run goes on
            free_memory()
            return ("OOM" if is_oom(exc) else "error"), first_line(exc)

    def close(self) -> None:
        if self._pools is not None:
            self._pools.close()
            self._pools = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# rank side: one sharded layer case (shared by bench_layers and bench_breakdown)

_WEIGHTS: dict = {}  # (shape, seed) -> replicated-layer weights on the CPU, kept across calls
_GROUPS: dict = {}  # (tp, cp) -> (tp_group, cp_group), created once per rank process


def rank_device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def full_weights(shape: str, seed: int) -> dict:
    """The replicated layer's weights (suites/layer_parity.random_state_dict, fla's init), float32."""
    key = (shape, seed)
    if key not in _WEIGHTS:
        from layer_parity import random_state_dict

        _WEIGHTS.clear()
        _WEIGHTS[key] = {n: t.float() for n, t in random_state_dict(make_config(shape), seed, fla_init=True).items()}
    return _WEIGHTS[key]


def parallel_groups(tp: int, cp: int):
    if not dist.is_initialized():
        if tp * cp > 1:
            raise ValueError(f"tp={tp} cp={cp} needs torch.distributed (run through Ranks)")
        return None, None
    if (tp, cp) not in _GROUPS:
        from linattn.parallel import new_groups

        _GROUPS[(tp, cp)] = new_groups(tp, cp)  # collective: every rank runs the same cases in order
    return _GROUPS[(tp, cp)]


def full_inputs(config, T: int, seed: int, device, dtype):
    """The whole packed batch's input and output cotangent `[1, T, hidden]`, the same on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return tuple(torch.randn(1, T, config.hidden_size, generator=gen, device=device, dtype=dtype)
                 for _ in range(2))


def build_case(case: dict, tp_group=None, cp_group=None, *, sharded=True):
    """This rank's layer and tokens for `case`: (layer, x, dy, cu_seqlens on the device).

    sharded=False: the replicated layer on the whole batch (the reference of the error columns)."""
    from layer_parity import local_tokens
    from linattn.layers import build_layer, shard_state_dict
    from linattn.parallel import group_rank

    config = make_config(case["shape"])
    device, dtype = rank_device(case["device"]), DTYPES[case["dtype"]]
    tp, cp = (case["tp"], case["cp"]) if sharded else (1, 1)
    tp_group, cp_group = (tp_group, cp_group) if sharded else (None, None)
    layer = build_layer(config, tp_group=tp_group, cp_group=cp_group, cp_layout=case["layout"],
                        sequence_parallel=case["sp"] and sharded, dtype=dtype, device=device)
    tp_rank, cp_rank = group_rank(tp_group), group_rank(cp_group)
    layer.load_state_dict(shard_state_dict(full_weights(case["shape"], case["seed"]), config, tp_rank, tp))
    cu = cu_seqlens(case["tokens"], case["seqs"])
    x, dy = full_inputs(config, case["tokens"], case["seed"], device, dtype)
    if sharded:
        placement = dict(cu_seqlens=cu, tp=tp, cp=cp, layout=case["layout"], sp=case["sp"])
        x, dy = (local_tokens(t, placement, tp_rank, cp_rank).contiguous() for t in (x, dy))
    return layer, x.requires_grad_(), dy, cu.to(device)


def time_layer_step(layer, x, dy, cu, *, iters: int, warmup: int) -> dict:
    """Forward + backward of the layer on this rank's tokens: median ms (fwd, fwd+bwd), peak GiB."""
    params = list(layer.parameters())

    def reset():
        x.grad = None
        for p in params:
            p.grad = None

    if dist.is_initialized():
        dist.barrier()
    reset_peak(x.device)
    t = measure(lambda: layer(x, cu), lambda y: y.backward(dy), iters=iters, warmup=warmup,
                device=x.device, reset=reset)
    t["peak_gib"] = peak_gib(x.device)
    reset()
    return t


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
            print(f"matplotlib is missing: plot later with python suites/bench/_common.py plot "
                  f"{args.json or 'FILE.json'} --out {args.plot}")
    return payload


# ---------------------------------------------------------------------------------------------
# plots (matplotlib, Agg): ms vs tokens per backend; layer ms vs tokens per TP/CP; breakdown bars

def plot(payload: dict, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, bench = payload["rows"], payload["bench"]
    where = f"{payload['machine'].get('device')}, {payload['machine'].get('date', '')[:10]}"
    written = []

    def save(fig, name):
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def lines(ax, series, title):
        for label, points in series.items():
            points = sorted(p for p in points if p[1] is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        linestyle="--" if label.startswith("auto") else "-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms (fwd + bwd)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    if bench == "kernels":
        for shape, tp in sorted({(r["shape"], r["tp"]) for r in rows}):
            ops = sorted({r["op"] for r in rows if r["shape"] == shape and r["tp"] == tp})
            fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 3.8), squeeze=False)
            for ax, op in zip(axes[0], ops):
                series = {}
                for r in rows:
                    if (r["shape"], r["tp"], r["op"]) == (shape, tp, op):
                        series.setdefault(r["backend"], []).append((r["tokens"], r.get("ms")))
                lines(ax, series, f"{op} @ {shape}" + (f" tp{tp}" if tp > 1 else "") + f" ({where})")
            save(fig, f"kernels_{shape}" + (f"_tp{tp}" if tp > 1 else "") + ".png")
    elif bench == "layers":
        for shape in sorted({r["shape"] for r in rows}):
            fig, ax = plt.subplots(figsize=(6, 4))
            series = {}
            for r in rows:
                if r["shape"] == shape:
                    series.setdefault(f"tp{r['tp']} cp{r['cp']}", []).append((r["tokens"], r.get("ms")))
            lines(ax, series, f"layer {shape} ({where}), ms per rank")
            save(fig, f"layers_{shape}.png")
    elif bench == "breakdown":
        parts = payload.get("parts", [])
        ok = [r for r in rows if r.get("ms") is not None]
        if ok:
            fig, ax = plt.subplots(figsize=(8, 0.5 * len(ok) + 1.5))
            labels = [f"{r['shape']} {tokens_label(r['tokens'])} tp{r['tp']} cp{r['cp']}" for r in ok]
            left = [0.0] * len(ok)
            for part in parts + ["glue"]:
                widths = [max(r.get(part) or 0.0, 0.0) for r in ok]
                ax.barh(labels, widths, left=left, label=part)
                left = [a + b for a, b in zip(left, widths)]
            ax.set_xlabel("ms (fwd + bwd)")
            ax.set_title(f"one layer step ({where})", fontsize=9)
            ax.legend(fontsize=7, ncol=3)
            save(fig, "breakdown.png")
    return written


def _plot_main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="PNG plots from the benchmark scripts' JSON")
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for f in args.files:
        for path in plot(json.loads(Path(f).read_text()), args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["plot"]:
        raise SystemExit("usage: python suites/bench/_common.py plot FILE.json... --out DIR")
    _plot_main(sys.argv[2:])
