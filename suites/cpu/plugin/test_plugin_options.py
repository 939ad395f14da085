"""Options, ini keys, tp/cp parametrization and deselection, markers, and the ways to load the plugin.

Most runs are in-process (``pytester.runpytest``: cheap); loading checks need a fresh interpreter
(``runpytest_subprocess``) because the entry point and ``-p`` act at start-up; runs that need a
process of their own otherwise are forked from a server that imported torch once (tools.inner_pytest).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
# Imported here, once: pytester's in-process runs drop the modules they imported, and torch's C
# extension cannot be imported a second time (this file alone failed with "bad call flags").
import torch  # noqa: F401

from tools.inner_pytest import runpytest_forked
from pytest_linattn import options

pytest_plugins = ["pytester"]

SIZES_TEST = """
import pytest

def test_tp(tp_size):
    assert isinstance(tp_size, int)

def test_both(tp_size, cp_size):
    pass

@pytest.mark.tp_sizes(2, 4)
def test_declared(tp_size):
    assert tp_size in (2, 4)

@pytest.mark.parametrize("cp_size", [1, 2], indirect=True)
def test_param_cp(cp_size):
    assert cp_size in (1, 2)

def test_plain():
    pass
"""


def _ids(result) -> list[str]:
    return sorted(line.split("::", 1)[1] for line in result.outlines if "::" in line)


# -- plain parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("4", [4]), ("2,4", [2, 4]), (" 2 , 4 ", [2, 4]), ("4,2,4", [4, 2]), (3, [3]), ([1, 2], [1, 2]),
])
def test_parse_sizes(value, expected):
    assert options.parse_sizes(value, "--tp") == expected


@pytest.mark.parametrize("value", ["", "0", "-2", "x", "2,,4", "2.5", True, [], [0], ["2"], None])
def test_parse_sizes_rejects(value):
    with pytest.raises(ValueError, match="^--tp: "):
        options.parse_sizes(value, "--tp")


def test_parse_device_and_timeout():
    assert options.parse_device("cuda") == "cuda"
    assert options.parse_timeout("2.5") == 2.5
    for bad in ("gpu", "", None):
        with pytest.raises(ValueError, match="^device: "):
            options.parse_device(bad)
    for bad in ("0", "-1", "nan", "inf", "soon", None):
        with pytest.raises(ValueError, match="^timeout: "):
            options.parse_timeout(bad)


# -- tp / cp parametrization --------------------------------------------------------------------


def test_default_sizes(pytester):
    pytester.makepyfile(test_sizes=SIZES_TEST)
    result = pytester.runpytest("--co", "-q")
    assert _ids(result) == ["test_both[tp2-cp2]", "test_declared[tp2]", "test_param_cp[2]",
                            "test_plain", "test_tp[tp2]"]
    result.stdout.fnmatch_lines(["*5/7 tests collected (2 deselected)*"])


def test_tp4_runs_every_tp_test_at_4(pytester):
    pytester.makepyfile(test_sizes=SIZES_TEST)
    result = pytester.runpytest("-p", "pytest_linattn", "--tp", "4", "-v")
    result.assert_outcomes(passed=5, deselected=2)
    result.stdout.fnmatch_lines(["*test_tp[[]tp4[]] PASSED*", "*test_both[[]tp4-cp2[]] PASSED*",
                                 "*test_declared[[]tp4[]] PASSED*"])


def test_comma_lists(pytester):
    pytester.makepyfile(test_sizes=SIZES_TEST)
    result = pytester.runpytest("--co", "-q", "--tp", "2,4", "--cp", "1,2,4")
    assert _ids(result) == sorted([
        "test_tp[tp2]", "test_tp[tp4]", "test_declared[tp2]", "test_declared[tp4]",
        "test_param_cp[1]", "test_param_cp[2]", "test_plain",
        *[f"test_both[tp{t}-cp{c}]" for t in (2, 4) for c in (1, 2, 4)]])


def test_sizes_not_asked_for_are_deselected(pytester):
    pytester.makepyfile(test_sizes=SIZES_TEST)
    result = pytester.runpytest("--tp", "3", "--cp", "4")
    # test_declared supports only 2 and 4; test_param_cp only 1 and 2: deselected, not failed.
    result.assert_outcomes(passed=3, deselected=4)
    # Sizes asked for that a test does not support are named in the summary, one line per test.
    result.stdout.fnmatch_lines([
        "*= linattn sizes not run =*",
        "test_sizes.py::test_declared: not run at tp 3 asked for; the test supports tp 2, 4",
        "test_sizes.py::test_param_cp: not run at cp 4 asked for; the test supports cp 1, 2",
    ])
    assert "test_tp:" not in result.stdout.str()  # option-driven: every size asked for runs


def test_ini_keys_and_precedence(pytester):
    pytester.makepyfile(test_sizes=SIZES_TEST)
    pytester.makeini("[pytest]\nlinattn_tp = 4\nlinattn_cp = 1\nlinattn_device = cpu\n"
                     "linattn_timeout = 12\n")
    pytester.makeconftest("""
def pytest_sessionstart(session):
    import pytest_linattn.plugin as p
    print("RESOLVED", p.option_value(session.config, "device"), p.option_value(session.config, "timeout"))
""")
    result = pytester.runpytest("--co", "-q", "-s")
    assert "test_tp[tp4]" in _ids(result) and "test_both[tp4-cp1]" in _ids(result)
    result.stdout.fnmatch_lines(["RESOLVED cpu 12.0"])
    result = pytester.runpytest("--co", "-q", "-s", "--tp", "2", "--linattn-timeout", "7")
    assert "test_tp[tp2]" in _ids(result)
    result.stdout.fnmatch_lines(["RESOLVED cpu 7.0"])


def test_conftest_may_set_defaults_after_configure(pytester):
    # A suites conftest sets config.option.tp in its own pytest_configure; read at collection.
    pytester.makepyfile(test_sizes=SIZES_TEST)
    pytester.makeconftest("""
def pytest_configure(config):
    if config.option.tp is None:
        config.option.tp = "3,4"
""")
    assert "test_tp[tp3]" in _ids(pytester.runpytest("--co", "-q"))
    ids = _ids(pytester.runpytest("--co", "-q", "--tp", "2"))
    assert "test_tp[tp2]" in ids and "test_tp[tp3]" not in ids


@pytest.mark.parametrize("args, message", [
    (["--tp", "0"], "argument --tp: sizes must be >= 1"),
    (["--tp", "two"], "argument --tp: 'two' in 'two' is not an integer"),
    (["--cp", "2,,4"], "argument --cp: expected a size or a comma list"),
    (["--linattn-device", "gpu"], "argument --linattn-device: invalid choice"),
    (["--linattn-timeout", "-1"], "argument --linattn-timeout: expected a positive"),
])
def test_bad_values_are_usage_errors(pytester, args, message):
    pytester.makepyfile(test_sizes=SIZES_TEST)
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_bad_ini_value_is_a_usage_error(pytester):
    pytester.makepyfile(test_sizes=SIZES_TEST)
    pytester.makeini("[pytest]\nlinattn_cp = 2;4\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "linattn_cp: '2;4' in '2;4' is not an integer" in result.stderr.str()


# -- markers ------------------------------------------------------------------------------------


def test_markers_clean_under_strict_markers(pytester):
    pytester.makepyfile("""
import pytest

@pytest.mark.world_size(2)
@pytest.mark.suite("cpu")
@pytest.mark.tp_sizes(2)
@pytest.mark.cp_sizes(2)
def test_marked(tp_size):
    pass

@pytest.mark.gpus(1)
def test_needs_gpu():
    pass

@pytest.mark.world_size(64)
def test_many_ranks_on_cpu():
    pass
""")
    result = pytester.runpytest("--strict-markers", "--linattn-device", "cpu", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*needs 1 GPU(s); this run uses --linattn-device cpu*"])


def test_gpus_marker_counts_the_machine(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # whatever the machine: no GPU visible
    pytester.makepyfile("""
import pytest

@pytest.mark.gpus(2)
def test_two():
    pass

@pytest.mark.world_size(2)
def test_world():
    pass
""")
    result = pytester.runpytest("--linattn-device", "auto", "-rs")
    result.assert_outcomes(skipped=1, passed=1)  # auto with no GPU: world_size runs on CPU
    result.stdout.fnmatch_lines(["*needs 2 GPU(s) (gpus(2)); this machine has 0*"])
    # in a subprocess: on CUDA the plugin imports triton (autotune), whose C extension must not be
    # loaded inside pytester's in-process run (it drops the modules, not the extension, afterwards)
    result = runpytest_forked(pytester, "--linattn-device", "cuda", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*needs 2 GPU(s) (world_size(2)); this machine has 0*"])


def test_helper_fixtures_return_the_functions(pytester):
    pytester.makepyfile("""
def test_fixtures(packed_seqlens, float64_reference):
    from pytest_linattn.seqlens import packed_seqlens as s
    from pytest_linattn.float64 import float64_reference as f
    import pytest_linattn
    from pytest_linattn.parity import assert_parity
    assert packed_seqlens is s and float64_reference is f
    assert pytest_linattn.assert_parity is assert_parity
""")
    # A process of its own (tools.inner_pytest): torch cannot be imported twice into one process by
    # in-process pytester.
    runpytest_forked(pytester).assert_outcomes(passed=1)


# -- loading ------------------------------------------------------------------------------------


PLAIN_TP = "def test_tp(tp_size):\n    assert tp_size == 4\n"


@pytest.mark.parametrize("how", ["entry point", "-p", "conftest", "-p, no autoload",
                                 "conftest, no autoload", "-p and conftest", "-p module"])
def test_loading_ways(pytester, monkeypatch, how):
    pytester.makepyfile(test_load=PLAIN_TP)
    args = ["--tp", "4"]
    if "no autoload" in how:
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    if "-p" in how:
        args = ["-p", "pytest_linattn.plugin" if "module" in how else "pytest_linattn", *args]
    if "conftest" in how:
        pytester.makeconftest('pytest_plugins = ["pytest_linattn"]\n')
    result = pytester.runpytest_subprocess(*args)
    assert "already registered" not in result.stderr.str()
    result.assert_outcomes(passed=1)


def test_disabled_with_p_no(pytester):
    pytester.makepyfile(test_load=PLAIN_TP + "\ndef test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:pytest_linattn")
    # Without the plugin its fixtures simply do not exist; unrelated tests still run.
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*fixture 'tp_size' not found*"])
    result = pytester.runpytest_subprocess("-p", "no:pytest_linattn", "--tp", "4")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_import_is_cheap():
    code = ("import sys, pytest_linattn, pytest_linattn.ranks.pool, pytest_linattn.ranks.gpus; "
            "print(sorted(m for m in ('pytest', 'torch', '_pytest') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.stdout.strip() == "[]"


# -- parity records: summary and --linattn-report -----------------------------------------------

PARITY_TESTS = """
import torch
from pytest_linattn import assert_parity


def test_close():
    x = torch.randn(2, 8, 3, dtype=torch.float64)
    assert_parity(x * (1 + 1e-12), x, rtol=1e-10, name="out")


def test_broken():
    x = torch.randn(1, 8, 3, dtype=torch.float64)
    y = x.clone()
    y[0, 5, 1] += 10.0
    assert_parity(y, x, rtol=1e-10, name="grad_q")
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_parity_summary_and_report(pytester, xdist):
    import json

    if xdist:
        pytest.importorskip("xdist")
    pytester.makepyfile(test_par=PARITY_TESTS)
    report = pytester.path / "report"
    args = ["--linattn-report", str(report)] + (["-n", "2"] if xdist else [])
    result = runpytest_forked(pytester, *args)
    result.assert_outcomes(passed=1, failed=1)
    # Records made in xdist workers reach the controller's summary and report.
    result.stdout.fnmatch_lines(["*linattn parity*", "*2 check(s), 1 failed*"])
    records = json.loads((report / "parity.json").read_text())
    assert sorted((r["test"], r["tensor"], r["passed"]) for r in records) == [
        ("test_par.py::test_broken", "grad_q", False), ("test_par.py::test_close", "out", True)]
    assert list(report.glob("*.png"))


def test_gpu_count_without_a_driver_needs_no_torch(monkeypatch):
    """On Linux with neither the CUDA driver library nor ROCm's device, the GPU count is 0 before
    torch is imported (a CPU run never pays torch's import to learn it); with either, or once torch
    is imported, torch is asked."""
    import ctypes
    import types

    from pytest_linattn.ranks import gpus

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    before_torch = types.SimpleNamespace(platform="linux", modules={})
    monkeypatch.setattr(gpus, "sys", before_torch)
    monkeypatch.setattr(gpus.os.path, "exists", lambda path: False)
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert not gpus._gpu_driver_present()
    assert gpus._torch_device_count() == 0
    monkeypatch.setattr(gpus.os.path, "exists", lambda path: path == "/dev/kfd")
    assert gpus._gpu_driver_present()
    monkeypatch.setattr(gpus.os.path, "exists", lambda path: False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())
    assert gpus._gpu_driver_present()
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    monkeypatch.setattr(gpus, "sys", types.SimpleNamespace(platform="linux", modules={"torch": object()}))
    assert gpus._gpu_driver_present()
    monkeypatch.setattr(gpus, "sys", types.SimpleNamespace(platform="darwin", modules={}))
    assert gpus._gpu_driver_present()


@pytest.mark.parametrize("omp", [None, "1"], ids=["shared", "OMP_NUM_THREADS"])
def test_xdist_workers_share_the_cores(pytester, monkeypatch, omp):
    """Each of n xdist workers computes on cpu_count // n threads (as a pool's ranks do), unless
    OMP_NUM_THREADS is set: then torch's own choice stands."""
    pytest.importorskip("xdist")
    from pytest_linattn.ranks.pool import thread_share

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    expected = thread_share(2) if omp is None else int(omp)
    pytester.makepyfile(test_threads=f"""
        import torch

        def test_a():
            assert torch.get_num_threads() == {expected}

        def test_b():
            assert torch.get_num_threads() == {expected}
    """)
    runpytest_forked(pytester, "-n", "2", "-p", "pytest_linattn").assert_outcomes(passed=2)


def test_thread_share():
    from pytest_linattn.ranks.pool import thread_share

    cores = os.cpu_count() or 1
    assert thread_share(1) == cores
    assert thread_share(cores * 4) == 1
    assert thread_share(0) == cores


def test_pool_ranks_share_the_cores_with_the_other_xdist_workers(monkeypatch):
    from pytest_linattn.ranks import pool

    monkeypatch.setattr(pool.os, "cpu_count", lambda: 16)
    assert pool.xdist_thread_share(2, environ={}) == 8
    assert pool.xdist_thread_share(2, environ={"PYTEST_XDIST_WORKER_COUNT": "4"}) == 2
    assert pool.xdist_thread_share(4, environ={"PYTEST_XDIST_WORKER_COUNT": "8"}) == 1
