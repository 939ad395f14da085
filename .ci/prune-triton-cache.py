"""Drop the compiled kernels a cache hit never loads: autotuning compiles every config, but with
its result cached (TRITON_CACHE_AUTOTUNING=1) a later process compiles, i.e. loads, only the best
one. Keeps every kernel that is some key's best config (by name, warps, stages, CTAs; configs
differing only in block-size kwargs are kept alike), every kernel that was never autotuned, and
every kernel a process of the run loaded (the LINATTN_COMPILE_LOG folders given: the tests take
each kernel's first config without a search, which is no search's best where one ran for the same
kernel, in this call or a call whose cache was carried).

    python3 .ci/prune-triton-cache.py CACHE_DIR [COMPILE_LOG_FOLDER ...]
"""
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pytest_linattn.compile_log import loaded_cache_folders  # noqa: E402  (no torch, no pytest)


def config_id(name: str, cfg: dict) -> tuple:
    return (name, cfg.get("num_warps"), cfg.get("num_stages"), cfg.get("num_ctas", 1), cfg.get("maxnreg"))


def main(root: Path, *compile_logs: Path) -> None:
    loaded = loaded_cache_folders(*compile_logs)
    best, tuned = set(), set()
    for path in root.glob("*/*.autotune.json"):
        name = path.name[: -len(".autotune.json")]
        timings = json.loads(path.read_text())["configs_timings"]
        # as Triton picks it: the config with the smallest timing (lists compare by median first)
        cfg = min(timings, key=lambda pair: pair[1])[0]
        tuned.add(name)
        best.add(config_id(name, cfg))
    kept = dropped = freed = 0
    for meta in root.glob("*/*.json"):
        if meta.name.endswith(".autotune.json") or meta.name.startswith("__grp__"):
            continue
        try:
            m = json.loads(meta.read_text())
        except ValueError:
            continue
        name = m.get("name")
        if name not in tuned or config_id(name, m) in best or meta.parent.name in loaded:
            kept += 1
            continue
        freed += sum(f.stat().st_size for f in meta.parent.iterdir())
        shutil.rmtree(meta.parent)
        dropped += 1
    print(f"triton cache: kept {kept} compiled kernels, dropped {dropped} autotune losers ({freed / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *map(Path, sys.argv[2:]))
