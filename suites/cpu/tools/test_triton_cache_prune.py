""".ci/prune-triton-cache.py on a made-up Triton cache: autotune losers go, the best config,
kernels that were never autotuned and kernels the run loaded stay."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / ".ci" / "prune-triton-cache.py"


def _prune(root, *compile_logs):
    spec = importlib.util.spec_from_file_location("prune_triton_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(root, *compile_logs)


def _kernel(root, dirname, name, warps, stages):
    d = root / dirname
    d.mkdir()
    (d / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": warps, "num_stages": stages,
                                                "num_ctas": 1, "maxnreg": None}))
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {}}))
    (d / f"{name}.cubin").write_bytes(b"\0" * 64)


def _config(warps, stages):
    return {"kwargs": {}, "num_warps": warps, "num_stages": stages, "num_ctas": 1, "maxnreg": None}


def test_keeps_the_best_config_and_untuned_kernels(tmp_path):
    tuned = tmp_path / "TUNE"
    tuned.mkdir()
    # timings as Triton stores them: [median, p20, p80]; the best is the smallest median
    (tuned / "k.autotune.json").write_text(json.dumps({"key": [1], "configs_timings": [
        [_config(2, 1), [0.30, 0.2, 0.4]], [_config(4, 2), [0.10, 0.3, 0.3]], [_config(8, 3), [0.20, 0.1, 0.2]]]}))
    _kernel(tmp_path, "A", "k", 2, 1)
    _kernel(tmp_path, "B", "k", 4, 2)
    _kernel(tmp_path, "C", "k", 8, 3)
    _kernel(tmp_path, "D", "plain", 2, 1)  # never autotuned: a cache hit needs it
    _prune(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["B", "D", "TUNE"]
    assert (tmp_path / "TUNE" / "k.autotune.json").exists()


def test_keeps_a_loser_the_run_loaded(tmp_path):
    """The tests take a kernel's first config without a search; where a search of the same kernel
    chose another (this call's or a carried cache's), the loaded one stays all the same."""
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    cache.mkdir()
    logs.mkdir()
    tuned = cache / "TUNE"
    tuned.mkdir()
    (tuned / "k.autotune.json").write_text(json.dumps({"key": [1], "configs_timings": [
        [_config(2, 1), [0.30, 0.2, 0.4]], [_config(4, 2), [0.10, 0.3, 0.3]]]}))
    _kernel(cache, "A", "k", 2, 1)  # the first config: a loser of the search, loaded by a rank
    _kernel(cache, "B", "k", 4, 2)
    _kernel(cache, "C", "k", 8, 3)  # a loser nobody loaded
    (logs / "loaded-7.tsv").write_text("A\nB\n")
    _prune(cache, logs)
    assert sorted(p.name for p in cache.iterdir()) == ["A", "B", "TUNE"]
