"""Suite speed, side by side: the README test command's wall time, a
4-rank pool's start with the emulation on, the CPU cost of fla-based layer parity cases under the
emulation, and every emulated fla op's time against the linattn.reference op it wraps.

    python suites/bench/bench_suite.py [--parts suite,pool,case,ops,cp-ops] [--skip-suite]
                                       [--repeats 5] [--json FILE]

- suite: `pytest` (the README test command: the cpu suite) in a subprocess, from the repository
  root; wall seconds, its CPU seconds (ranks included) and the count line. Minutes: --skip-suite.
- pool: a PoolManager's 4-rank pool started by a call under `fla_on_cpu()` (every rank enters the
  emulation, which imports fla), then a second pool of the same manager (the first closed), as a
  session starts one after a broken pool or another world size.
- case: `assert_sharded_parity` of fla-based layers (suites/clients/fla_layers.py) under the emulation:
  a head-sharded GDN at TP 2 and fla's KDA at CP 2; CPU seconds of this process plus its ranks
  (read from /proc), the first case of a fresh pool (it pays the pool's start) and warm ones.
- ops: each emulated op (fwd+bwd, float64) and the linattn.reference op it wraps at the same
  shapes, "test" (the emulation tests' sizes) and "layer" (a longer packing); CPU ms, the
  minimum over --repeats rounds that alternate the two; their ratio.
- cp-ops: the CP variants on 2 ranks: the emulated op with fla's cp_context against
  linattn.parallel.cp's exchange around the reference.

The CPU clock (this process's and the ranks') is what a loaded machine disturbs least; --threads
sets torch's threads here (default 1). Needs fla 0.6.0 (the `fla-cpu` extra) for pool, case and
cp-ops; ops runs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (str(ROOT), str(ROOT / "suites")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from _emulation_ops import cp_op_rows, op_rows  # noqa: E402

PARTS = ("suite", "pool", "case", "ops", "cp-ops")
TARGETS = {"suite": "<= 150 s", "pool": "<= 2 s after the first", "case": "<= 3 s CPU", "ops": "<= 2x"}
CASE_CU = [0, 1, 9, 16, 24]  # test_fla_on_cpu's packing: a length-1 sequence, pieces crossing ranks


# ---------------------------------------------------------------------------------------------
# clocks


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu() -> float:
    """CPU seconds of this process and all its descendants, live (from /proc: Linux) or reaped:
    the ranks, and the server a pool forks them from."""
    tick, stats = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            # ppid; utime + stime + the reaped children's cutime + cstime
            stats[int(entry)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, list(children.get(os.getpid(), ()))
    while stack:
        pid = stack.pop()
        total += stats[pid][1]
        stack += children.get(pid, ())
    own = resource.getrusage(resource.RUSAGE_SELF)
    return total / tick + own.ru_utime + own.ru_stime + children_cpu()


def load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def emulation_arg():
    """What the pool passes its ranks for the active emulation (as pytest_linattn.spawn does)."""
    try:
        from linattn.emulation import active_modes
    except ImportError:  # a checkout from before fla_interpreted: its pool takes the compute dtype
        from linattn.emulation import active_compute_dtype

        return active_compute_dtype()
    return active_modes()


# ---------------------------------------------------------------------------------------------
# (a) the README test command


def suite(args) -> dict:
    pytest = ROOT / ".venv" / "bin" / "pytest"
    command = [str(pytest)] if pytest.exists() else [sys.executable, "-m", "pytest"]
    command += args.suite_args.split()
    print(f"suite: {' '.join(command)} (cwd {ROOT}); load before {load()}", flush=True)
    cpu0, start = children_cpu(), time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, children_cpu() - cpu0
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    return {"part": "suite", "wall_s": wall, "cpu_s": cpu, "rc": proc.returncode,
            "summary": lines[-1].strip("= ") if lines else proc.stdout[-300:], "load_after": load(),
            "output_tail": proc.stdout.splitlines()[-80:]}  # --durations=N's table, when asked for


# ---------------------------------------------------------------------------------------------
# (b) pool start with the emulation on


def _probe():
    from linattn.emulation import active_compute_dtype

    return str(active_compute_dtype())


def pool_start(args) -> list[dict]:
    from linattn.emulation import fla_on_cpu
    from pytest_linattn.ranks.pool import PoolManager

    rows = []
    with fla_on_cpu(), PoolManager("cpu") as pools:
        for which in ("first", "second"):
            cpu0, start = tree_cpu(), time.perf_counter()
            assert pools.run(_probe, args.world, fla_on_cpu=emulation_arg()) == ["torch.float64"] * args.world
            wall, cpu = time.perf_counter() - start, tree_cpu() - cpu0
            pools.pool(args.world).close()
            rows.append({"part": "pool", "which": which, "world": args.world, "wall_s": wall, "cpu_s": cpu})
            print(f"  pool {which}: {wall:.2f} s wall, {cpu:.1f} s CPU (this process and its descendants)",
                  flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# (c) fla-based layer parity cases under the emulation


def _cases():
    from clients.fla_layers import fla_gdn_client, fla_kda_client, fla_layer
    from pytest_linattn import Placement

    gdn, gdn_config, _ = fla_layer("gdn", seed=41)
    kda, kda_config, _ = fla_layer("kda", seed=33)
    return [("gdn tp2", fla_gdn_client(), gdn, Placement(tp=2), gdn_config.hidden_size),
            ("kda cp2", fla_kda_client(), kda, Placement(cp=2), kda_config.hidden_size),
            ("kda cp2 fla-zigzag", fla_kda_client(), kda, Placement(cp=2, cp_layout="fla-zigzag"),
             kda_config.hidden_size)]


def fla_cases(args) -> list[dict]:
    from clients.fla_layers import fla_forward

    from linattn.emulation import fla_on_cpu
    from pytest_linattn import assert_sharded_parity
    from pytest_linattn.ranks.pool import PoolManager

    rows = []
    with fla_on_cpu(), PoolManager("cpu") as pools:
        def spawn(fn, world_size, *a, **kw):
            return pools.run(fn, world_size, a, kw, fla_on_cpu=emulation_arg())

        cases, started = _cases(), set()
        for rep in range(1 + args.case_repeats):
            for name, client, layer, placement, hidden in cases:
                world = placement.tp * placement.cp
                fresh = world not in started
                started.add(world)
                own0, cpu0, start = time.process_time(), tree_cpu(), time.perf_counter()
                assert_sharded_parity(spawn, client, layer, [placement], torch.tensor(CASE_CU), hidden_size=hidden,
                                      seed=7, rtol=1e-10, reference_forward=fla_forward, name=name)
                wall, cpu, own = time.perf_counter() - start, tree_cpu() - cpu0, time.process_time() - own0
                row = {"part": "case", "case": name, "placement": placement.name, "pool": "fresh" if fresh else "warm",
                       "rep": rep, "wall_s": wall, "cpu_s": cpu, "own_cpu_s": own}
                rows.append(row)
                print(f"  {name} ({row['pool']} pool): {wall:.2f} s wall, {cpu:.2f} s CPU "
                      f"({own:.2f} s of it in this process)", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# the report


def _f(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def summary(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(what, measured, target) lines."""
    out = []
    for r in rows:
        if r["part"] == "suite":
            out.append(("README test command (pytest, cpu suite)",
                        f"{r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU; {r['summary']}", TARGETS["suite"]))
        elif r["part"] == "pool":
            out.append((f"{r['world']}-rank pool start, emulation on, {r['which']} of a session",
                        f"{r['wall_s']:.2f} s wall, {r['cpu_s']:.1f} s CPU",
                        TARGETS["pool"] if r["which"] == "second" else "-"))
    cases = [r for r in rows if r["part"] == "case"]
    for name in dict.fromkeys(r["case"] for r in cases):
        mine = [r for r in cases if r["case"] == name]
        first = [r for r in mine if r["pool"] == "fresh"]
        warm = [r["cpu_s"] for r in mine if r["pool"] == "warm" and r["cpu_s"] is not None]
        text = f"warm {min(warm):.2f} s CPU" if warm else "warm -"
        if first:
            text += f"; first on a fresh pool {_f(first[0]['cpu_s'])} s CPU ({first[0]['wall_s']:.1f} s wall)"
        out.append((f"fla case {name}", text, TARGETS["case"]))
    ops = [r for r in rows if r["part"] in ("ops", "cp-ops") and r.get("ratio") is not None and r.get("judged", True)]
    if ops:
        worst = max(ops, key=lambda r: r["ratio"])
        out.append((f"emulated ops vs linattn.reference ({len(ops)} rows)",
                    f"worst {worst['ratio']:.2f}x ({worst['op']}, {worst['shape']})", TARGETS["ops"]))
    return out


def print_ops(rows: list[dict]) -> None:
    print(f"  {'op':44} {'shape':7} {'emulated ms':>12} {'reference ms':>13} {'ratio':>6}")
    for r in rows:
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        ratio += "" if r.get("judged", True) else " (not judged)"
        print(f"  {r['op']:44} {r['shape']:7} {_f(r['emulated_ms'], '.3f'):>12} {_f(r['reference_ms'], '.3f'):>13} "
              f"{ratio:>6}", flush=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--skip-suite", action="store_true", help="leave out the suite run (minutes)")
    parser.add_argument("--suite-args", default="", help="extra arguments for the suite's pytest")
    parser.add_argument("--world", type=int, default=4, help="ranks of the pool part (default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per op row (minimum taken; default 5)")
    parser.add_argument("--shapes", default="test,layer", help="op shapes: test, layer (default both)")
    parser.add_argument("--case-repeats", type=int, default=2, help="warm repeats of each fla case (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the rows, the summary and the load as JSON")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: pick from {', '.join(PARTS)}")
    if args.skip_suite and "suite" in parts:
        parts.remove("suite")
    if args.repeats < 1 or args.world < 1 or args.case_repeats < 0:
        parser.error("--repeats and --world must be >= 1, --case-repeats >= 0")
    torch.set_num_threads(args.threads)

    print(f"bench_suite: {os.cpu_count()} CPU cores, load {load()} (1/5/15 min), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}", flush=True)
    rows, load_before = [], load()
    if "suite" in parts:
        rows.append(suite(args))
    if "pool" in parts:
        rows += pool_start(args)
    if "case" in parts:
        rows += fla_cases(args)
    if "ops" in parts:
        print("emulated ops vs linattn.reference (fwd+bwd, float64, CPU ms, min of rounds):", flush=True)
        found = op_rows(args.shapes.split(","), args.repeats)
        print_ops(found)
        rows += found
    if "cp-ops" in parts:
        print("CP variants on 2 ranks (fwd+bwd, CPU ms of the slower rank):", flush=True)
        found = cp_op_rows(args.repeats)
        print_ops(found)
        rows += found

    lines = summary(rows)
    width = max([len(w) for w, _, _ in lines] + [4])
    print(f"\n{'what':{width}}  {'target':>22}  measured (load {load_before} before, {load()} after)")
    for what, measured, target in lines:
        print(f"{what:{width}}  {target:>22}  {measured}")
    payload = {"bench": "bench_suite", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "cpus": os.cpu_count(), "load_before": load_before, "load_after": load(), "rows": rows,
               "summary": [dict(zip(("what", "measured", "target"), line)) for line in lines]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
