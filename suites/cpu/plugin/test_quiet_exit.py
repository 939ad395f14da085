"""A run's last line is pytest's summary: nothing printed after it at the interpreter's exit.

The run below imports Triton the way the plugin's own tests do (first inside an in-process
pytester run, which drops it from sys.modules afterwards: pytest_linattn.quiet_exit says why that
made nanobind print screens of "leaked" objects after the summary), then spawns ranks that import
it too. (Not the test process again: a Triton imported a second time into one process aborts it,
nanobind refusing to register its types twice.) A cold `python -m pytest` (the interpreter's
exit is what is checked, so not a fork), its stdout and stderr in one stream, in the order a
terminal or a CI log shows them.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

RUN = '''
import pytest

pytest_plugins = ["pytester"]


def test_an_inner_run_imports_triton_first(pytester):
    pytester.makepyfile(test_inner="import triton\\n\\ndef test_version():\\n    assert triton.__version__\\n")
    pytester.runpytest("-p", "no:cacheprovider", "-p", "no:xdist").assert_outcomes(passed=1)


def rank_sum_with_triton(x):
    import torch
    import torch.distributed as dist
    import triton  # noqa: F401

    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return t.item()


def test_ranks_import_triton(spawn):
    assert spawn(rank_sum_with_triton, 2, 1.0) == [2.0, 2.0]
'''

SUMMARY = re.compile(r"^=+ 2 passed in [\d.]+s( \(\d+:\d\d:\d\d\))? =+$")


def test_the_summary_is_the_last_line(pytester):
    pytester.makepyfile(test_triton_run=RUN)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_linattn", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "--linattn-device", "cpu", "test_triton_run.py"],
                         cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.strip()]
    assert run.returncode == 0, run.stdout
    assert "nanobind: leaked" not in run.stdout, run.stdout
    assert lines and SUMMARY.match(lines[-1]), f"the last line is not pytest's summary:\n{run.stdout}"
