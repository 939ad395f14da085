"""The fla_on_cpu fixture and the --linattn-fla-on-cpu option / ini key, in pytest runs of their
own: the emulation is on in the test process and in every rank spawn runs while (and only while)
a test asks for it, and fla's originals are back afterwards.

A cold inner run imports fla (~8 s of CPU) in its test process and, where it spawns, in its rank
server. So the runs are forked from a server that imported fla once (tools.inner_pytest; in-process
pytester runs, which drop the modules they import but not triton's C extension, crash), and the
tests share them: `_run` runs one inner session per name once per test process (xdist worker) and
keeps its result; the first test that needs it runs it in its own pytester directory.
"""
from __future__ import annotations

import pytest

from tools.inner_pytest import junit_outcomes, runpytest_forked

pytest_plugins = ["pytester"]

_RUNS: dict[str, tuple] = {}


def _run(pytester, name: str):
    """The inner run `name` of RUNS: (its RunResult, the outcome of each of its tests)."""
    if name not in _RUNS:
        files, ini, args = RUNS[name]
        pytester.makepyfile(**files)
        if ini:
            pytester.makeini(ini)
        junit = pytester.path / "junit.xml"
        result = runpytest_forked(pytester, "-p", "pytest_linattn", "-p", "no:cacheprovider",
                                  f"--junitxml={junit}", *args, fla=True, rank_servers=True)
        _RUNS[name] = (result, junit_outcomes(junit))
    return _RUNS[name]

INNER = r'''
import torch


def emulation_state():
    from linattn.emulation import active_compute_dtype
    import fla.ops.kda as kda

    return str(active_compute_dtype()), kda.chunk_kda.__module__


def test_fixture(spawn, fla_on_cpu):
    assert fla_on_cpu == torch.float64
    local = emulation_state()
    assert local == ("torch.float64", "linattn.emulation.kda")
    assert spawn(emulation_state, 2) == [local, local]


def test_plain(spawn):
    off = ("None", "fla.ops.kda.chunk")
    assert emulation_state() == off
    assert spawn(emulation_state, 2) == [off, off]
'''


def test_fixture_on_in_test_and_ranks_only_where_asked(pytester):
    result, outcomes = _run(pytester, "no option")
    assert {t: outcomes[t] for t in ("test_fixture", "test_plain")} == {
        "test_fixture": "passed", "test_plain": "passed"}, result.stdout.str()


# A test that asks for nothing; with the option (or ini key) on it runs emulated. No spawn here:
# the ranks' side is the first test's.
EMULATED_WITHOUT_ASKING = r'''
def test_emulated_without_asking():
    from linattn.emulation import active_compute_dtype
    import fla.ops.kda as kda

    assert str(active_compute_dtype()) == "torch.float64"
    assert kda.chunk_kda.__module__ == "linattn.emulation.kda"
'''


def test_option_and_ini_turn_it_on_for_every_test(pytester):
    _run(pytester, "option")[0].assert_outcomes(passed=1)
    _run(pytester, "ini")[0].assert_outcomes(passed=1)
    _run(pytester, "ini, option off")[0].assert_outcomes(failed=1)  # the command line wins over the ini key


def test_bad_value_names_the_option(pytester):
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "pytest_linattn", "--linattn-fla-on-cpu=maybe")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--linattn-fla-on-cpu*expected on or off*maybe*"])


# fla's Triton kernel reached on a CPU without the emulation: in the test process and on a rank
WITHOUT_EMULATION = r'''
import pytest
import torch


def call_chunk_kda():
    from fla.ops.kda import chunk_kda

    x = torch.randn(1, 8, 2, 8)
    return chunk_kda(x, x, x, torch.randn(1, 8, 2, 8).sigmoid().log(), torch.rand(1, 8, 2))


def test_in_the_test_process():
    call_chunk_kda()


def test_on_a_rank(spawn):
    spawn(call_chunk_kda, 2)


def test_other_errors_keep_their_report():
    raise RuntimeError("0 active drivers ([]). There should only be one.")  # no fla frame: not fla's
'''
HINT = ("fla's Triton kernels cannot run on a CPU (Triton finds no GPU driver), reached through "
        "fla.ops.kda.chunk.chunk_kda: run fla's ops emulated on linattn's float64 references with the fla_on_cpu "
        "fixture, or --linattn-fla-on-cpu (ini linattn_fla_on_cpu = on) for every test (docs/fla-on-cpu.md)")


def test_fla_kernel_on_a_cpu_fails_with_one_line_naming_the_emulation(pytester):
    result, outcomes = _run(pytester, "no option")
    assert {t: outcomes[t] for t in ("test_in_the_test_process", "test_on_a_rank",
                                     "test_other_errors_keep_their_report")} == {
        "test_in_the_test_process": "failed", "test_on_a_rank": "failed",
        "test_other_errors_keep_their_report": "failed"}, result.stdout.str()
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["linattn fla-on-cpu: off (fla's ops are emulated only in tests using the "
                                 "fla_on_cpu fixture; --linattn-fla-on-cpu for every test)"])
    for test in ("test_in_the_test_process", "test_on_a_rank"):
        section = out.split(f"_ {test} _", 1)[1].split("\n", 1)[1]  # after the test's header line
        first, after = section.split("\n")[:2]
        assert first == HINT and after[:1] in "_-=", section  # the report is that line; then the next section
        assert f"FAILED test_inner.py::{test} - fla's Triton kernels cannot" in out  # -ra's line, cut to width
    # An error that is not fla's keeps pytest's own report, without the hint (the -ra line may be cut
    # to the terminal's width, so only the test's own section is read).
    other = out.split("_ test_other_errors_keep_their_report _", 1)[1].split("short test summary info", 1)[0]
    assert "E       RuntimeError: 0 active drivers ([]). There should only be one." in other, other
    assert "fla's Triton kernels cannot" not in other, other


def test_header_says_the_emulation_is_on(pytester):
    result, _ = _run(pytester, "option")
    result.stdout.fnmatch_lines(["linattn fla-on-cpu: on, in every test and rank (--linattn-fla-on-cpu): "
                                 "fla's ops run on linattn's references"])


# name: (files, ini, extra arguments). "no option": two files, the fixture's and fla's kernel on a
# CPU without the emulation (the run that also shows the header's "off")
RUNS = {
    "no option": ({"test_asked": INNER, "test_inner": WITHOUT_EMULATION}, None,
                  ("-rf", "--linattn-device", "cpu")),
    "option": ({"test_inner": EMULATED_WITHOUT_ASKING}, None, ("--linattn-fla-on-cpu",)),
    "ini": ({"test_inner": EMULATED_WITHOUT_ASKING}, "[pytest]\nlinattn_fla_on_cpu = on\n", ()),
    "ini, option off": ({"test_inner": EMULATED_WITHOUT_ASKING}, "[pytest]\nlinattn_fla_on_cpu = on\n",
                        ("--linattn-fla-on-cpu=off",)),
}


def test_under_the_emulation_the_line_says_the_call_is_not_emulated():
    from pytest_linattn.fla_hint import triton_on_cpu_line

    text = ('  File "/venv/fla/backends.py", line 200, in wrapper\n'
            '  File "/venv/fla/ops/utils/cumsum.py", line 9, in chunk_local_cumsum\n'
            '  File "/venv/triton/runtime/driver.py", line 20, in _create_driver\n'
            'RuntimeError: 0 active drivers ([]). There should only be one.\n')
    assert triton_on_cpu_line(text, emulated=True) == (
        "fla's Triton kernels cannot run on a CPU (Triton finds no GPU driver), and fla.ops.utils.cumsum."
        "chunk_local_cumsum reached one while fla_on_cpu was on: the emulation does not cover that call "
        "(docs/fla-on-cpu.md lists what it covers)")
    assert triton_on_cpu_line(text.replace("0 active", "1 active"), emulated=False) is None


def test_the_fla_cpu_extra_installs_what_the_emulation_needs():
    # fla imports triton and einops when imported, on a CPU too; neither fla package pulls triton
    import re
    import tomllib
    from pathlib import Path

    from linattn.emulation import FLA_VERSION

    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["fla-cpu"]
    assert {re.split(r"[=<>!~\[; ]", r)[0] for r in extra} >= {"flash-linear-attention", "fla-core", "triton",
                                                              "einops"}
    assert {f"flash-linear-attention=={FLA_VERSION}", f"fla-core=={FLA_VERSION}"} <= set(extra)  # the one checked
