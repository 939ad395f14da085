"""Generate the shipped kernel configs (pytest_linattn/fla_configs/<GPU>/) from a real autotune run.

On a GPU: runs the gpu-1 (and, with two GPUs, gpu-2) suites in this process with Triton's search
(--linattn-autotune search, FLA_CACHE_MODE unset), so every kernel tunes at the suites' shapes;
then reads every Triton Autotuner's results (this process's, and each rank's and xdist
worker's, written when its pool or session closes) and writes one fla config file per kernel
into OUT/<GPU>/, then a table.

    python3 suites/bench/dump_fla_configs.py --out DIR [--suites gpu-1,gpu-2] [--resume DIR]
    python3 suites/bench/dump_fla_configs.py --out DIR --gpu NVIDIA_H200 --records R.json ...

--resume DIR: a cut run's output (OUT/<GPU>/ of an earlier call): its entries are kept, and fla's
cached kernels read them (FLA_CACHE_MODE=strict) instead of searching again. SIGTERM (a call's
time limit) stops the tests and still writes what was tuned. --records converts saved records
without running anything (any machine).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pytest_linattn import autotune  # noqa: E402


def records_from_config_dir(folder: Path) -> list[dict]:
    """The entries of existing fla config files, as records (so a resumed run keeps them)."""
    records = []
    for path in sorted(Path(folder).glob("*.json")):
        content = json.loads(path.read_text())
        for entry in (content.get("autotune_entries") or {}).values():
            records.append({"kernel": content.get("kernel_name") or path.stem,
                            "key": entry["autotune_key"], "config": entry["config"]})
    return records


def write_config_dir(files: dict[str, dict], folder: Path) -> list[tuple[str, int, str]]:
    """One <kernel>.json per kernel in folder; returns (kernel, entries, default config) rows."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in sorted(files):
        (folder / f"{name}.json").write_text(json.dumps(files[name], indent=1, sort_keys=False) + "\n")
        default = files[name]["default_config"] or {}
        summary = " ".join(f"{k}={v}" for k, v in (default.get("kwargs") or {}).items())
        summary += f" w{default.get('num_warps')} s{default.get('num_stages')}"
        rows.append((name, len(files[name]["autotune_entries"]), summary.strip()))
    return rows


def print_table(rows, folder) -> None:
    width = max([len("kernel")] + [len(r[0]) for r in rows])
    print(f"\n{len(rows)} kernel config files in {folder}")
    print(f"{'kernel':<{width}}  entries  default config")
    for name, entries, default in rows:
        print(f"{name:<{width}}  {entries:>7}  {default}")


def run_suites(suites: list[str], records_dir: str) -> int:
    """The suites in this process with Triton's search; returns pytest's exit code."""
    import pytest

    os.environ[autotune.RECORDS_ENV] = records_dir  # the ranks write theirs when their pools close

    def stop(signum, frame):  # a call's time limit: stop the tests, keep what was tuned
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    args = [str(ROOT / "suites" / s) for s in suites]
    if len(suites) == 1:  # the suite's own processes (gpu-1: -n 4, grouped by kernel): searches side by side
        from pytest_linattn.suites import load_suites

        args += list(load_suites(ROOT)[suites[0]].pytest_args)
    args += ["--linattn-autotune", "search", "--linattn-device", "cuda", "--tp", "2", "--cp", "2",
             "-p", "no:cacheprovider", "-v", "-rfEs", f"--rootdir={ROOT}",
             "-W", "ignore::pytest.PytestAssertRewriteWarning"]  # this script imported the plugin first
    if "pytest_linattn" not in os.environ.get("PYTEST_PLUGINS", ""):
        args += ["-p", "pytest_linattn"]
    print("pytest", " ".join(args), flush=True)  # -v: each finished test named, so a cut run says which were not
    return int(pytest.main(args))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="writes OUT/<GPU>/<kernel>.json")
    parser.add_argument("--suites", default="gpu-1,gpu-2", help="suites to run (default gpu-1,gpu-2)")
    parser.add_argument("--resume", type=Path, help="an earlier call's OUT/<GPU>/ to keep and read")
    parser.add_argument("--records", nargs="+", type=Path, help="convert saved records; run nothing")
    parser.add_argument("--gpu", help="the GPU folder name (default: device 0's, as fla names it)")
    args = parser.parse_args(argv)

    records = records_from_config_dir(args.resume) if args.resume else []
    if args.records:
        for path in args.records:
            records += json.loads(path.read_text())
        code = 0
        import triton
    else:
        if os.environ.get("FLA_CACHE_MODE", "disabled") != "disabled":
            parser.error(f"FLA_CACHE_MODE={os.environ['FLA_CACHE_MODE']}: unset it, the dump must "
                         "search (--resume sets what it needs)")
        os.environ.pop("FLA_CONFIG_DIR", None)
        if args.resume:
            # fla's cached kernels take the earlier call's exact entries; the rest search
            os.environ.update(FLA_CACHE_MODE="strict", FLA_CONFIG_DIR=str(args.resume.resolve()))
        with tempfile.TemporaryDirectory(prefix="linattn-records-") as records_dir:
            code = run_suites([s.strip() for s in args.suites.split(",") if s.strip()], records_dir)
            import triton

            records += autotune.autotuner_records(autotune.live_autotuners())
            for path in sorted(Path(records_dir).glob("*.json")):
                records += json.loads(path.read_text())
    files, warnings = autotune.kernel_config_files(records, triton.__version__)
    for line in warnings:
        print("warning:", line)
    folder = args.out / (args.gpu or autotune.gpu_name())
    rows = write_config_dir(files, folder)
    print_table(rows, folder)
    if not rows:
        print("no autotuned kernel ran: nothing written")
        return code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
