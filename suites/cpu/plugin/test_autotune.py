"""pytest_linattn.autotune on a CPU: the option, which fla variables a run sets (a user's win), the
config folder lookup, the no-search Triton patch (on Triton's real Autotuner with a kernel that
only records its launches and a benchmarker that fails the test), the config files it ships, and
the plugin applying it for cuda runs only."""
from __future__ import annotations

import importlib.util
import json
import logging
import sys
import types
from pathlib import Path

import pytest

from tools.inner_pytest import runpytest_forked
from pytest_linattn import autotune, options

pytest_plugins = ["pytester"]
triton_autotuner = pytest.importorskip("triton.runtime.autotuner")
import triton  # noqa: E402

Autotuner, Config = triton_autotuner.Autotuner, triton.Config
DUMP = Path(__file__).resolve().parents[2] / "bench" / "dump_fla_configs.py"


@pytest.fixture(autouse=True)
def _clean():
    autotune.restore()
    yield
    autotune.restore()
    autotune.unpatch_autotuner()  # the tests that patch Triton directly
    assert not getattr(Autotuner.run, "_linattn_no_search", False)


@pytest.fixture
def fla_cache(monkeypatch):
    """fla's config-cache module (fla/ops/utils/cache.py). Importing fla itself on a CPU costs
    half a minute; the module imports only torch and triton, so it is loaded from its file."""
    if autotune.FLA_CACHE in sys.modules:
        return sys.modules[autotune.FLA_CACHE]
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla is not installed")
    path = Path(spec.origin).parent / "ops" / "utils" / "cache.py"
    module_spec = importlib.util.spec_from_file_location(autotune.FLA_CACHE, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, autotune.FLA_CACHE, module)
    return module


class Launches:
    """A jitted kernel stand-in: records the meta-parameters of every launch."""

    def __init__(self, fail_for=()):
        self.calls = []
        self.fail_for = fail_for

        def demo_kernel(x, n, BLOCK):
            pass

        self.fn = demo_kernel

    def run(self, *args, **kwargs):
        if kwargs.get("BLOCK") in self.fail_for:
            from triton.runtime.errors import OutOfResources

            raise OutOfResources(300000, 232448, "shared memory")
        self.calls.append(kwargs)


CONFIGS = [Config({"BLOCK": b}, num_warps=w, num_stages=2) for b, w in ((16, 2), (32, 4), (64, 8))]


def tuner(configs=CONFIGS, prune=None, cls=Autotuner, fail_for=()):
    def no_bench(*args, **kwargs):
        pytest.fail("a config was timed")

    kernel = Launches(fail_for)
    t = cls(kernel, ["x", "n"], list(configs), ["n"], None, None,
            prune_configs_by={"early_config_prune": prune} if prune else None, do_bench=no_bench)
    t._bench = no_bench  # an instance attribute: fails whichever Triton path times a config
    return t, kernel


class Tensorish:
    dtype = "torch.bfloat16"


# ---- the option ----------------------------------------------------------------------------

def test_option_values():
    assert [options.parse_autotune(v) for v in ("shipped", " First ", "search")] == ["shipped", "first", "search"]
    assert options.DEFAULTS["autotune"] == "shipped"
    with pytest.raises(ValueError, match=r"--linattn-autotune: expected one of shipped, first, search .*'fast'"):
        options.parse_autotune("fast", "--linattn-autotune")


def test_bad_value_names_the_option_and_the_ini_key(pytester):
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--linattn-autotune", "fast")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--linattn-autotune*expected one of shipped, first, search*"])
    pytester.makeini("[pytest]\nlinattn_autotune = fast\n")
    result = pytester.runpytest("--linattn-device", "cuda")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*linattn_autotune: expected one of shipped, first, search*"])


# ---- what a run sets -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "AMD Instinct MI300X", "--odd  name!!", "", "_"])
def test_gpu_names_are_sanitized_as_fla_does(fla_cache, name):
    assert autotune.sanitize_gpu_name(name) == fla_cache.sanitize_gpu_name(name)


def test_gpu_name_reads_fla_gpu_name():
    assert autotune.gpu_name({"FLA_GPU_NAME": "NVIDIA H200"}) == "NVIDIA_H200"


@pytest.fixture
def shipped(tmp_path):
    (tmp_path / "NVIDIA_H200").mkdir()
    (tmp_path / "NVIDIA_H200" / "demo_kernel.json").write_text("{}")
    return tmp_path


def test_shipped_configs_set_fla_full_mode_and_the_folder(shipped):
    env = {}
    p = autotune.apply("shipped", environ=env, gpu="NVIDIA_H200", root=shipped)
    assert env == {"LINATTN_AUTOTUNE": "shipped", "FLA_CACHE_MODE": "full",
                   "FLA_CONFIG_DIR": str(shipped / "NVIDIA_H200")}
    assert p.fallback and getattr(Autotuner.run, "_linattn_no_search", False)
    assert "FLA_CACHE_MODE=full (shipped)" in p.describe() and "fallback on" in p.describe()
    autotune.restore()
    assert env == {}


def test_users_fla_variables_win_and_the_line_says_so(shipped):
    env = {"FLA_CACHE_MODE": "strict", "FLA_CONFIG_DIR": "/my/configs"}
    p = autotune.apply("shipped", environ=env, gpu="NVIDIA_H200", root=shipped)
    assert env == {"FLA_CACHE_MODE": "strict", "FLA_CONFIG_DIR": "/my/configs", "LINATTN_AUTOTUNE": "shipped"}
    assert "FLA_CACHE_MODE=strict (yours)" in p.describe()
    assert "FLA_CONFIG_DIR=/my/configs (yours)" in p.describe()
    autotune.restore()
    assert env == {"FLA_CACHE_MODE": "strict", "FLA_CONFIG_DIR": "/my/configs"}
    # only the folder given: the shipped full mode reads the user's folder
    p = autotune.plan("shipped", environ={"FLA_CONFIG_DIR": "/my/configs"}, gpu="NVIDIA_H200", root=shipped)
    assert (p.cache_mode, p.config_dir, p.config_dir_is_users) == ("full", "/my/configs", True)


def test_no_folder_for_this_gpu_means_fallback_only(shipped, caplog):
    env = {}
    with caplog.at_level(logging.INFO, logger="pytest_linattn.autotune"):
        p = autotune.apply("shipped", environ=env, gpu="NVIDIA_B200", root=shipped)
        autotune.apply("shipped", environ=env, gpu="NVIDIA_B200", root=shipped)  # idempotent
    assert env == {"LINATTN_AUTOTUNE": "shipped"}
    assert (p.cache_mode, p.config_dir, p.fallback) == (None, None, True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no shipped configs for NVIDIA_B200" in lines[0] and "fallback on" in lines[0]
    assert autotune.shipped_config_dir("NVIDIA_B200", shipped) is None
    (shipped / "EMPTY").mkdir()
    assert autotune.shipped_config_dir("EMPTY", shipped) is None  # a folder with no config files


def test_first_and_search_modes(shipped):
    env = {}
    p = autotune.apply("first", environ=env, gpu="NVIDIA_H200", root=shipped)
    assert env == {"LINATTN_AUTOTUNE": "first"} and p.fallback  # no shipped configs
    p = autotune.apply("search", environ=env, gpu="NVIDIA_H200", root=shipped)
    assert env == {"LINATTN_AUTOTUNE": "search"} and not p.fallback
    assert not getattr(Autotuner.run, "_linattn_no_search", False)
    assert p.describe() == "linattn autotune: search (Triton's autotune)"


def test_an_fla_imported_already_gets_the_mode_set_directly(shipped, fla_cache, monkeypatch):
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.DISABLED)
    autotune.apply("shipped", environ={}, gpu="NVIDIA_H200", root=shipped)
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.FULL
    autotune.restore()
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.DISABLED


def test_ranks_patch_on_cuda_only():
    autotune.apply_in_rank("cpu", {"LINATTN_AUTOTUNE": "shipped"})
    assert not getattr(Autotuner.run, "_linattn_no_search", False)
    autotune.apply_in_rank("cuda", {"LINATTN_AUTOTUNE": "search"})
    assert not getattr(Autotuner.run, "_linattn_no_search", False)
    autotune.apply_in_rank("cuda", {"LINATTN_AUTOTUNE": "first"})
    assert getattr(Autotuner.run, "_linattn_no_search", False)
    autotune.unpatch_autotuner()


# ---- the Triton patch -----------------------------------------------------------------------

def test_the_harness_sees_a_search():
    # unpatched, the same kernel times every config: the failing benchmarker above is reached
    t, _ = tuner()
    timed = []
    t._bench = lambda *args, config, **kw: timed.append(config) or [1.0, 1.0, 1.0]
    t.run(object(), 5)
    assert timed == CONFIGS


def test_first_pruned_config_without_timing_any():
    original = Autotuner.run
    autotune.patch_autotuner()
    autotune.patch_autotuner()  # idempotent: wrapped once
    assert Autotuner.run.__wrapped__ is original
    pruned = []

    def drop_first(configs, named_args, **kwargs):
        pruned.append(named_args["n"])
        return configs[1:]

    t, kernel = tuner(prune=drop_first)
    x = Tensorish()
    t.run(x, 5)
    t.run(x, 5)  # the same key: no second choice
    t.run(x, 7)
    assert pruned == [5, 7]
    assert [c["BLOCK"] for c in kernel.calls] == [32, 32, 32]
    assert kernel.calls[0]["num_warps"] == 4
    assert set(t.cache) == {(5, "torch.bfloat16"), (7, "torch.bfloat16")}
    autotune.unpatch_autotuner()
    assert Autotuner.run is original


def test_single_config_kernels_are_left_alone():
    autotune.patch_autotuner()
    t, kernel = tuner(configs=CONFIGS[2:], prune=lambda *a, **k: pytest.fail("pruned"))
    t.run(object(), 5)
    assert [c["BLOCK"] for c in kernel.calls] == [64] and t.cache == {}


def test_a_config_that_does_not_compile_gives_way_to_the_next():
    autotune.patch_autotuner()
    t, kernel = tuner(fail_for=(16,))
    t.run(object(), 5)
    assert [c["BLOCK"] for c in kernel.calls] == [32]
    t, kernel = tuner(fail_for=(16, 32, 64))
    with pytest.raises(triton.runtime.errors.OutOfResources):
        t.run(object(), 5)


# ---- config files: written from autotune results, read by fla -------------------------------

class FakeTuner:
    def __init__(self, name, cache, configs=CONFIGS):
        self.configs, self.cache = configs, cache
        self.base_fn = types.SimpleNamespace(__name__=name)


def test_records_become_config_files_fla_reads(fla_cache, tmp_path):
    tuners = [FakeTuner("demo_kernel", {(5, "torch.bfloat16"): CONFIGS[1], (7, "torch.bfloat16"): CONFIGS[2],
                                        (9, "torch.bfloat16"): CONFIGS[1]}),
              FakeTuner("one_config_kernel", {(5,): CONFIGS[0]}, configs=CONFIGS[:1])]
    records = autotune.autotuner_records(tuners)
    files, warnings = autotune.kernel_config_files(records, triton.__version__)
    assert list(files) == ["demo_kernel"] and warnings == []
    content = json.loads(json.dumps(files["demo_kernel"]))  # what the file holds
    parsed = fla_cache.KernelConfigFile.from_dict(tmp_path / "demo_kernel.json", content)
    assert parsed is not None and parsed.triton_version == triton.__version__
    key = fla_cache.AutotuneKey.build(["x", "n"], ["n"], (Tensorish(), 7), {})
    entry = parsed.lookup_exact(key)
    assert entry["config"] == {"kwargs": {"BLOCK": 64}, "num_warps": 8, "num_stages": 2, "num_ctas": 1, "maxnreg": None}
    assert entry["autotune_key"] == [7, "torch.bfloat16"]
    assert content["default_config"]["kwargs"] == {"BLOCK": 32}  # won two of the three keys


def test_two_winners_for_one_key_keep_the_first():
    records = autotune.autotuner_records([FakeTuner("k", {(5,): CONFIGS[0]}), FakeTuner("k", {(5,): CONFIGS[1]})])
    files, warnings = autotune.kernel_config_files(records, "3.6.0")
    assert len(files["k"]["autotune_entries"]) == 1 and "two winners" in warnings[0]


def _load_dump_script(monkeypatch):
    spec = importlib.util.spec_from_file_location("dump_fla_configs", DUMP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dump_script_writes_a_folder_fla_reads(fla_cache, tmp_path, monkeypatch, capsys):
    dump = _load_dump_script(monkeypatch)
    records = autotune.autotuner_records([FakeTuner("demo_kernel", {(5, "torch.bfloat16"): CONFIGS[2]})])
    (tmp_path / "r.json").write_text(json.dumps(records))
    assert dump.main(["--out", str(tmp_path / "out"), "--gpu", "NVIDIA_H200", "--records", str(tmp_path / "r.json")]) == 0
    folder = tmp_path / "out" / "NVIDIA_H200"
    parsed = fla_cache.KernelConfigFile.from_file(folder / "demo_kernel.json")
    key = fla_cache.AutotuneKey.build(["x", "n"], ["n"], (Tensorish(), 5), {})
    assert parsed.lookup_exact(key)["config"]["kwargs"] == {"BLOCK": 64}
    out = capsys.readouterr().out
    assert "1 kernel config files" in out and "demo_kernel" in out
    # a resumed dump keeps the earlier entries
    assert dump.records_from_config_dir(folder) == records


def _ship(tmp_path, fla_cache, monkeypatch, config):
    files, _ = autotune.kernel_config_files(autotune.autotuner_records(
        [FakeTuner("demo_kernel", {(5, "torch.bfloat16"): config})]), triton.__version__)
    (tmp_path / "demo_kernel.json").write_text(json.dumps(files["demo_kernel"]))
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.FULL)


def test_a_shipped_config_is_taken_over_the_first(fla_cache, tmp_path, monkeypatch):
    _ship(tmp_path, fla_cache, monkeypatch, CONFIGS[2])
    autotune.patch_autotuner()
    for cls in (Autotuner, fla_cache.CachedAutotuner):  # plain triton.autotune, and fla's own
        t, kernel = tuner(cls=cls)
        t.run(Tensorish(), 5)
        assert [c["BLOCK"] for c in kernel.calls] == [64], cls
    # a key with no entry: full mode takes the file's default_config, here also BLOCK 64
    t, kernel = tuner()
    t.run(Tensorish(), 6)
    assert [c["BLOCK"] for c in kernel.calls] == [64]


def test_a_shipped_config_the_kernel_does_not_offer_is_ignored(fla_cache, tmp_path, monkeypatch):
    _ship(tmp_path, fla_cache, monkeypatch, Config({"BLOCK": 128}, num_warps=8, num_stages=2))
    autotune.patch_autotuner()
    t, kernel = tuner()
    t.run(Tensorish(), 5)
    assert [c["BLOCK"] for c in kernel.calls] == [16]


# ---- the plugin ------------------------------------------------------------------------------

PLUGIN_TEST = """
import os
from triton.runtime.autotuner import Autotuner

def test_state():
    assert os.environ.get("LINATTN_AUTOTUNE") == {want!r}
    assert getattr(Autotuner.run, "_linattn_no_search", False) is {patched}
"""


def test_plugin_leaves_a_cpu_run_alone(pytester, monkeypatch):
    monkeypatch.delenv("LINATTN_AUTOTUNE", raising=False)
    pytester.makepyfile(PLUGIN_TEST.format(want=None, patched=False))
    result = pytester.runpytest("--linattn-device", "cpu")
    result.assert_outcomes(passed=1)
    assert "linattn autotune" not in result.stdout.str()


def test_plugin_applies_it_for_cuda_and_undoes_it_after(pytester, monkeypatch):
    # this CPU has no GPU: the plan finds no shipped configs for "cpu" and falls back to the first config
    monkeypatch.delenv("LINATTN_AUTOTUNE", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    pytester.makepyfile(PLUGIN_TEST.format(want="shipped", patched=True))
    result = pytester.runpytest("--linattn-device", "cuda")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["linattn autotune: shipped, no search;*first-config fallback on"])
    assert "LINATTN_AUTOTUNE" not in __import__("os").environ
    assert not getattr(Autotuner.run, "_linattn_no_search", False)
    pytester.makepyfile(PLUGIN_TEST.format(want="search", patched=False))
    result = pytester.runpytest("--linattn-device", "cuda", "--linattn-autotune", "search")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["linattn autotune: search (Triton's autotune)"])


RECORDING_TESTS = """
import os, signal
import triton

@triton.jit
def _kernel(x, n, BLOCK: "tl.constexpr"):
    pass

tuned = triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])(_kernel)

def test_tunes():
    tuned.cache[(8, "torch.float32")] = tuned.configs[1]

def test_cut():  # a dump's time limit: the worker dies before its session closes
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_xdist_workers_write_their_records_after_every_test(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.RECORDS_ENV, str(tmp_path))
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    pytester.makepyfile(RECORDING_TESTS)
    # no replacement worker after the kill: its start would only cost time
    runpytest_forked(pytester, "-p", "pytest_linattn", "--linattn-device", "cuda", "-n", "1", "--max-worker-restart", "0",
                     "-p", "no:randomly")
    records = [r for path in tmp_path.glob("*.json") for r in json.loads(path.read_text())]
    assert {"kernel": "_kernel", "key": [8, "torch.float32"],
            "config": autotune.config_fields(triton.Config({"BLOCK": 32}))} in records
