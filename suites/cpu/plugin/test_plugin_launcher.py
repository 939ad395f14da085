"""Launcher mode: pytest itself under a real torchrun (2 ranks, gloo on the CPU).

A failure that leaves a collective half done breaks the process group and ends the session, so
each such fault needs its own torchrun run: four runs, one after another, each with a hard timeout.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from test_plugin_spawn import _no_leftovers

pytest_plugins = ["pytester"]

LAUNCHED_TESTS = r'''
import os, time
import pytest
import torch
import torch.distributed as dist
from pytest_linattn.ranks import launcher
from pytest_linattn.ranks.pool import RankFailure


def info(x):
    return dist.get_rank(), os.getpid(), torch.tensor([x * (dist.get_rank() + 1)])


def raise_on_one():
    if dist.get_rank() == 1:
        raise KeyError("launched rank one")
    return "fine"


def raise_in_collective():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def exit_on_one():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def hang_on_zero():
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.barrier()


def test_gathered(spawn):
    out = spawn(info, 2, 3)
    assert [o[0] for o in out] == [0, 1]
    assert [o[2].item() for o in out] == [3, 6]
    assert out[dist.get_rank()][1] == os.getpid()  # ran here, not in a spawned process


def test_world_size_must_match(spawn):
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        spawn(info, 4, 1)


def test_failure_keeps_the_group(spawn):
    # No collective was left half done: every rank learns of the failure, the group lives on.
    with pytest.raises(RankFailure, match="rank 1 failed") as err:
        spawn(raise_on_one, 2)
    assert "KeyError: 'launched rank one'" in str(err.value)
    assert spawn(info, 2, 1)[1][2].item() == 2


@pytest.mark.tp_sizes(2, 4)
def test_sized(spawn, tp_size):
    assert len(spawn(info, tp_size, 1)) == 2


def test_fault(spawn):
    fault = os.environ["FAULT"]
    if fault == "raise_late_watchdog" and dist.get_rank() == 0:
        # rank 0's watchdog looks every 1.5 s: rank 1's abort frees rank 0's barrier (closed
        # connection) before rank 0's watchdog has seen it, as on a loaded two-core machine
        launcher._WATCH = 1.5
    fn = {"raise": raise_in_collective, "raise_late_watchdog": raise_in_collective, "exit": exit_on_one,
          "hang": hang_on_zero}[fault]
    spawn(fn, 2)


def test_after_the_fault(spawn):
    spawn(info, 2, 1)
'''


def _torchrun(path, fault, timeout_s, tag):
    env = {**os.environ, "FAULT": fault, "LINATTN_LEAK_TAG": tag}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "pytest", "-p", "pytest_linattn", "--linattn-device", "cpu", "-p", "no:randomly",
           "-p", "no:cacheprovider", "--tp", "2,4,3", "--linattn-timeout", str(timeout_s),
           "test_launched.py"]
    return subprocess.Popen(cmd, cwd=path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _session_seconds(text: str) -> float:
    return float(re.findall(r" in ([\d.]+)s", text)[-1])


def test_faults_under_torchrun(pytester):
    pytester.makepyfile(test_launched=LAUNCHED_TESTS)
    tag = f"launcher-{os.getpid()}-{time.monotonic_ns()}"
    # The hang uses a short timeout; raise and exit a long one, which they must not wait for.
    # One torchrun at a time: three side by side (six ranks and three agents on a two-core CI
    # machine) let torchrun's agent stop rank 0 before it had reported.
    runs, texts = {}, {}
    try:
        for fault, timeout_s in (("raise", 120), ("raise_late_watchdog", 120), ("exit", 120), ("hang", 4)):
            runs[fault] = proc = _torchrun(pytester.path, fault, timeout_s, tag)
            out, _ = proc.communicate(timeout=240)
            texts[fault] = out.decode(errors="replace")
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    for fault, text in texts.items():
        # pytest shows a failed test's captured output whole (an assertion's message it cuts)
        print(f"===== torchrun output, fault {fault!r}, exit code {runs[fault].returncode} =====\n{text}")
    for fault, text in texts.items():
        assert runs[fault].returncode != 0, text
        # One report: rank 1 runs quietly; the fault's test fails, the session stops after it.
        assert text.count("test session starts") == 1, text
        assert "1 failed, 4 passed, 1 deselected in" in text, text
        assert "the process group is broken after a failure in test_launched.py::test_fault" in text
        # Sizes that do not fit WORLD_SIZE are deselected, with the reason; unsupported ones named.
        assert "tp_size x cp_size = WORLD_SIZE=2: test_launched.py::test_sized[tp4]" in text
        assert "test_launched.py::test_sized: not run at tp 3 asked for; the test supports tp 2, 4" in text
    # The same report whichever rank's watchdog saw the abort first (before the fix, a rank 0
    # freed before its watchdog looked reported "ranks 0, 1 failed" with no reason)
    for raised in (texts["raise"], texts["raise_late_watchdog"]):
        assert "raise_in_collective(...) on 2 ranks" in raised
        assert "rank 1 raised and rank 0 had not answered 2 s later" in raised
        assert "ValueError: rank one is unhappy" in raised and "in raise_in_collective" in raised
        assert "rank 0 stack at the abort (it had not returned)" in raised and "in barrier" in raised
        assert _session_seconds(raised) < 60, raised
    exited = texts["exit"]
    # The death first, then the survivor's consequence.
    assert exited.index("rank 1 sent nothing: it died") < exited.index("--- rank 0 raised"), exited
    assert _session_seconds(exited) < 60, exited
    hung = texts["hang"]
    assert "hang_on_zero(...) on 2 ranks (launcher mode, call 5): timed out after 4 s" in hung
    assert "rank 0 stack at the abort" in hung and "rank 1 stack at the abort" in hung
    assert "time.sleep(600)" in hung and "in barrier" in hung
    assert _session_seconds(hung) < 4 + 10 + 15, hung  # timeout + 10 s, plus the session's start
    assert not _no_leftovers(tag), "a rank outlived its torchrun"
