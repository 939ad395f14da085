"""Where a GPU suite's time goes: Triton compiles against tests, per test file.

With LINATTN_COMPILE_LOG set to a folder (.ci/gpu.sh sets one per suite), every process of the
run (the test processes and the ranks) logs each Triton compile that missed the cache
(`triton.knobs.compilation.listener`: end time, seconds, kernel), and the test processes log
each test's start and end. `per_file_seconds(folder)` then gives per test file its tests' time and
the compile seconds spent while they ran (a compile in a test process counts to that process's
test; one in a rank to the test running then). Every kernel a process loads, compiled or from the
cache, is logged too (its cache folder: `loaded_cache_folders(folder)`), so the cache saved after
the run keeps what the run used (.ci/prune-triton-cache.py). Without the variable nothing is
installed.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

ENV = "LINATTN_COMPILE_LOG"

__all__ = ["ENV", "install", "loaded_cache_folders", "per_file_seconds", "test_finished", "test_started"]


def _folder() -> Path | None:
    folder = os.environ.get(ENV)
    return Path(folder) if folder else None


def _append(kind: str, line: str) -> None:
    folder = _folder()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{kind}-{os.getpid()}.tsv", "a", encoding="utf-8") as f:
        f.write(line + "\n")


def install() -> None:
    """Log this process's Triton compiles (cache misses), if LINATTN_COMPILE_LOG is set and
    Triton has compilation listeners (3.4 and later); imports Triton only then."""
    if _folder() is None:
        return
    try:
        from triton import knobs
    except ImportError:
        return
    if not hasattr(getattr(knobs, "compilation", None), "listener"):
        return
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        if not cache_hit:
            name = getattr(src, "name", None) or metadata.get("name", "?")
            _append("compile", f"{time.time():.3f}\t{times.total / 1e6:.3f}\t{name}")
        files = list((metadata_group or {}).values())
        if files:  # the kernel's folder in the cache: every file of its group lies there
            _append("loaded", Path(files[0]).parent.name)

    knobs.compilation.listener = listener


def test_started(nodeid: str) -> None:
    _append("tests", f"{time.time():.3f}\tstart\t{nodeid}")


def test_finished(nodeid: str) -> None:
    _append("tests", f"{time.time():.3f}\tend\t{nodeid}")


def per_file_seconds(folder: str | Path) -> dict[str, dict[str, float]]:
    """{test file: {"tests": seconds its tests ran, "compile": compile seconds while they ran,
    "kernels": compiles}}, from a LINATTN_COMPILE_LOG folder."""
    folder = Path(folder)
    windows = []  # (start, end, pid, file)
    for path in folder.glob("tests-*.tsv"):
        pid = int(path.stem.split("-")[1])
        open_at = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            stamp, what, nodeid = line.split("\t", 2)
            if what == "start":
                open_at[nodeid] = float(stamp)
            elif nodeid in open_at:
                windows.append((open_at.pop(nodeid), float(stamp), pid, nodeid.split("::")[0]))
    out = collections.defaultdict(lambda: {"tests": 0.0, "compile": 0.0, "kernels": 0})
    for start, end, _, file in windows:
        out[file]["tests"] += end - start
    for path in folder.glob("compile-*.tsv"):
        pid = int(path.stem.split("-")[1])
        for line in path.read_text(encoding="utf-8").splitlines():
            stamp, seconds, _ = line.split("\t", 2)
            stamp = float(stamp)
            running = [w for w in windows if w[0] <= stamp <= w[1]]
            own = [w for w in running if w[2] == pid] or running
            for window in own:  # tests side by side in one suite share a rank's compile
                out[window[3]]["compile"] += float(seconds) / len(own)
                out[window[3]]["kernels"] += 1 / len(own)
    return dict(out)


def loaded_cache_folders(*folders: str | Path) -> set[str]:
    """The Triton cache folders (their names) of the kernels the processes logging into `folders`
    loaded, compiled or from the cache."""
    return {line for folder in folders for path in Path(folder).glob("loaded-*.tsv")
            for line in path.read_text(encoding="utf-8").split()}


if __name__ == "__main__":  # python -m pytest_linattn.compile_log FOLDER: the table
    for file, row in sorted(per_file_seconds(sys.argv[1]).items(), key=lambda kv: -kv[1]["tests"]):
        print(f"{row['tests']:8.1f} s tests {row['compile']:8.1f} s compiling ({row['kernels']:.0f} kernels)  {file}")
