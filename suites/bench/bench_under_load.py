"""The CPU suite on a loaded machine: the README test command's `pytest` (the cpu suite) run
beside busy processes, several rounds in a row; passed/failed, wall time and load average per round.

    python suites/bench/bench_under_load.py [--busy-per-core 3] [--rounds 2] [--pytest-args "..."]
                                            [--log-dir DIR] [--json FILE]

A busy process is `sh -c 'while :; do :; done'`: it never sleeps, so every core is shared with
`--busy-per-core` of them (3 per core: each test process gets about a quarter of a core). They
start before the first round and are killed after the last (their process group, also on
Ctrl-C). Each round's whole pytest output goes to DIR/round<N>.log (default: a temporary
directory, printed); the slowest tests are pytest's own `--durations=10` table in it. Exit status
1 when a round did not pass. The suite's verdict must not depend on the load: a test that fails
only here waits on a wall-clock figure (docs/suites.md, "On a loaded machine").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUSY = ["sh", "-c", "while :; do :; done"]


def start_busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(BUSY, start_new_session=True, stdin=subprocess.DEVNULL) for _ in range(count)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


def pytest_command(extra: str) -> list[str]:
    pytest = ROOT / ".venv" / "bin" / "pytest"
    command = [str(pytest)] if pytest.exists() else [sys.executable, "-m", "pytest"]
    return command + ["--durations=10", *extra.split()]


def run_round(number: int, command: list[str], log_dir: Path) -> dict:
    log = log_dir / f"round{number}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    text = log.read_text(errors="replace")
    counts = [ln.strip("= ") for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    return {"round": number, "rc": proc.returncode, "wall_s": round(wall, 1),
            "summary": counts[-1] if counts else "(no summary line)", "load_1min": round(os.getloadavg()[0], 1),
            "log": str(log)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-per-core", type=int, default=3, help="busy processes per core (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="suite runs in a row (default 2)")
    parser.add_argument("--pytest-args", default="", help="extra arguments for pytest (default: none, the cpu suite)")
    parser.add_argument("--log-dir", help="where each round's output goes (default: a new temporary directory)")
    parser.add_argument("--json", metavar="FILE", help="write the rounds as JSON")
    args = parser.parse_args(argv)
    if args.busy_per_core < 0:
        parser.error(f"--busy-per-core must be >= 0, got {args.busy_per_core}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="linattn-under-load-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    command = pytest_command(args.pytest_args)
    print(f"{args.busy_per_core * cores} busy processes ({args.busy_per_core} per core, {cores} cores) beside "
          f"`{' '.join(command)}` (cwd {ROOT}), {args.rounds} round(s); logs in {log_dir}", flush=True)
    busy = start_busy(args.busy_per_core * cores)
    rounds = []
    try:
        for number in range(1, args.rounds + 1):
            rounds.append(run_round(number, command, log_dir))
            print(f"round {number}: {rounds[-1]['summary']} (exit {rounds[-1]['rc']}), "
                  f"{rounds[-1]['wall_s']} s wall", flush=True)
    finally:
        stop_busy(busy)
    print(f"\n| round | result | wall s | load (1 min) |\n|---|---|---|---|")
    for r in rounds:
        print(f"| {r['round']} | {r['summary']} | {r['wall_s']} | {r['load_1min']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"busy_per_core": args.busy_per_core, "cores": cores,
                                               "command": command, "rounds": rounds}, indent=1))
    return 0 if all(r["rc"] == 0 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
