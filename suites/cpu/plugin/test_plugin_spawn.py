"""The spawn fixture and its rank pools, exercised in pytest runs of their own: forked from a server
that imported torch once (tools.inner_pytest), or cold subprocesses where the test signals its pytest.

Each inner run packs several scenarios into one session, because a pool start costs seconds on
a small CPU: the same session checks that a failure is contained and the next test passes.
The pools' life as processes is in test_spawn_pools.py.
"""
from __future__ import annotations

import os
import time

from tools.inner_pytest import (BACKSTOP, LONG_WAIT, junit_durations, junit_outcomes, no_leftovers, pids_in,
                          process_alive, runpytest_forked)

pytest_plugins = ["pytester"]

RANK_TESTS = r'''
import os, signal, time
import pytest
import torch
import torch.distributed as dist


def rank_info(scale):
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    with open("/proc/self/environ", "rb") as f:  # what the outer test's leak check reads
        tagged = os.environ["LINATTN_LEAK_TAG"].encode() in f.read()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(), "tagged": tagged,
            "sum": t * scale, "pair": (torch.arange(3) + dist.get_rank(), [dist.get_rank()])}


def raise_on_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def die_on_zero():
    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


def kill_self_on_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def segv_on_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def raise_while_zero_computes():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy while rank zero computes")
    time.sleep(3600)  # not in torch.distributed: rank 0 might yet answer, so it gets the grace


def _record(out):
    with open(os.environ["PIDS_FILE"], "a") as f:
        f.write(" ".join(str(o["pid"]) for o in out) + "\n")


def test_tensors_in_rank_order(spawn):
    out = spawn(rank_info, 2, scale=2.0)
    _record(out)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 for o in out)
    assert all(o["tagged"] for o in out)  # the outer test's leak check sees the ranks
    for r, o in enumerate(out):
        assert o["sum"].device.type == "cpu"
        assert torch.equal(o["sum"], torch.full((2,), 6.0))
        assert torch.equal(o["pair"][0], torch.arange(3) + r)
        assert o["pair"][1] == [r]


def test_pool_is_reused(spawn):
    a = spawn(rank_info, 2, 1.0)
    b = spawn(rank_info, 2, 1.0)
    _record(a)
    assert [o["pid"] for o in a] == [o["pid"] for o in b]


def test_world_size_one(spawn):
    out = spawn(rank_info, 1, 1.0)
    _record(out)
    assert len(out) == 1 and out[0]["world"] == 1 and out[0]["sum"].tolist() == [1.0, 1.0]


def test_raising_rank(spawn, monkeypatch):
    from pytest_linattn.ranks import pool
    # only seeing rank 0 blocked in its barrier can end this one before the (long) grace
    monkeypatch.setattr(pool, "FAILURE_GRACE", float(os.environ["LINATTN_LONG_WAIT"]))
    spawn(raise_on_one, 2)


def test_raising_rank_beside_a_busy_one(spawn):
    spawn(raise_while_zero_computes, 2)


def test_after_raise(spawn):
    _record(spawn(rank_info, 2, 1.0))


def test_dying_rank(spawn):
    spawn(die_on_zero, 2)


def test_signalled_rank(spawn):
    spawn(kill_self_on_one, 2)


def test_segfaulting_rank(spawn):
    spawn(segv_on_one, 2)


def test_parity_failure_shows_no_library_frames():
    from pytest_linattn import assert_parity
    x = torch.ones(3, dtype=torch.float64)
    assert_parity(x + 1, x, rtol=1e-10, name="y")


def test_after_death(spawn):
    _record(spawn(rank_info, 2, 1.0))


def test_nested_function_is_refused(spawn):
    def local():
        return 1
    with pytest.raises(ValueError, match="picklable by reference"):
        spawn(local, 2)
    _record(spawn(rank_info, 2, 1.0))  # the pool survived the refusal


def test_bad_world_size(spawn):
    with pytest.raises(ValueError, match="world_size"):
        spawn(rank_info, 0, 1.0)
'''

HANG_TESTS = r'''
import os, time
import torch.distributed as dist


def hang_on_zero():
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()


def pid():
    return os.getpid()


def test_hang(spawn):
    spawn(hang_on_zero, 2)


def test_next_passes(spawn):
    pids = spawn(pid, 2)
    with open(os.environ["PIDS_FILE"], "a") as f:
        f.write(" ".join(map(str, pids)) + "\n")
'''


def test_spawn_results_and_contained_failures(pytester, monkeypatch):
    pytester.makepyfile(test_ranks=RANK_TESTS)
    pids_file = pytester.path / "pids.txt"
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    tag = f"spawn-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("LINATTN_LEAK_TAG", tag)
    junit = pytester.path / "junit.xml"
    monkeypatch.setenv("LINATTN_LONG_WAIT", str(LONG_WAIT))
    result = runpytest_forked(pytester, "-p", "pytest_linattn", "--linattn-device", "cpu",
                              "--linattn-timeout", str(LONG_WAIT), f"--junitxml={junit}", timeout=BACKSTOP)
    outcomes = junit_outcomes(junit)
    assert outcomes == {
        "test_tensors_in_rank_order": "passed", "test_pool_is_reused": "passed",
        "test_world_size_one": "passed", "test_raising_rank": "failed",
        "test_raising_rank_beside_a_busy_one": "failed", "test_after_raise": "passed", "test_dying_rank": "failed",
        "test_signalled_rank": "failed", "test_segfaulting_rank": "failed",
        "test_parity_failure_shows_no_library_frames": "failed", "test_after_death": "passed",
        "test_nested_function_is_refused": "passed", "test_bad_world_size": "passed",
    }, result.stdout.str()
    text = result.stdout.str()
    # The raising rank: its number and its own traceback, and the stuck rank's stack.
    assert "raise_on_one(...) on 2 ranks: rank 1 failed." in text
    assert "ValueError: rank one is unhappy" in text
    assert 'test_ranks.py", line' in text
    # The other rank, blocked in the barrier, is not waited for; one still in its own code is,
    # for the grace: it might raise too.
    raised = text.split("raise_on_one(...) on 2 ranks:", 1)[1].split("\n_", 1)[0]
    assert "rank 0 was blocked in torch.distributed (barrier) and was killed; its stack:" in raised, raised
    busy = text.split("raise_while_zero_computes(...) on 2 ranks: rank 1 failed.", 1)[1].split("\n_", 1)[0]
    assert "rank 0 had not returned 2 s after the failure and was killed; its stack:" in busy, busy
    assert "in raise_while_zero_computes" in busy.split("--- rank 0 stack", 1)[1], busy
    # The dying ranks: rank and exit code / signal name.
    assert "rank 0 died with exit code 7" in text
    assert "rank 1 died with signal SIGKILL" in text
    # A death comes before the survivor's error (its consequence), and a fatal signal has a stack.
    signalled = text.split("kill_self_on_one(...) on 2 ranks:", 1)[1]
    assert signalled.index("--- rank 1 died") < signalled.index("--- rank 0 raised"), signalled
    segv = text.split("segv_on_one(...) on 2 ranks: rank 1 died with signal SIGSEGV", 1)[1]
    assert "Fatal Python error: Segmentation fault" in segv
    assert 'test_ranks.py", line 36 in segv_on_one' in segv.split("--- rank 0 raised")[0], segv
    # A parity failure starts at the test's line, not in assert_parity's own source.
    parity = text.split("test_parity_failure_shows_no_library_frames ___", 1)[1]
    parity = parity.split("\n", 1)[1].split("\n_", 1)[0].split("\n- generated", 1)[0]
    assert "assert_parity(x + 1, x" in parity and "def assert_parity" not in parity, parity
    assert "pytest_linattn/parity/" not in parity, parity
    # Which path each failure took, the reports say; neither waited for the call's timeout, nor
    # the first for its grace (both LONG_WAIT there), nor the second for rank 0's hour of sleep.
    durations = junit_durations(junit)
    assert durations["test_raising_rank"] < LONG_WAIT and durations["test_raising_rank_beside_a_busy_one"] < LONG_WAIT
    # No rank outlives the run.
    pids = pids_in(pids_file)
    assert pids and not [p for p in pids if process_alive(p)]
    assert not no_leftovers(tag)


def test_hang_times_out_with_every_stack(pytester, monkeypatch):
    pytester.makepyfile(test_hang=HANG_TESTS)
    pids_file = pytester.path / "pids.txt"
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    junit = pytester.path / "junit.xml"
    result = runpytest_forked(pytester, "-p", "pytest_linattn", "--linattn-device", "cpu",
                              "--linattn-timeout", "5", f"--junitxml={junit}", rank_servers=True)
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "hang_on_zero(...) on 2 ranks: timed out after 5 s" in text
    # Both ranks' Python stacks: rank 0 in its sleep, rank 1 in the barrier.
    assert "rank 0 stack (still running" in text and "rank 1 stack (still running" in text
    assert 'test_hang.py", line 8 in hang_on_zero' in text
    assert "in barrier" in text
    assert junit_durations(junit)["test_hang"] < LONG_WAIT  # ended by the 5 s timeout, not the hour's sleep
    assert not [p for p in pids_in(pids_file) if process_alive(p)]


def test_importlib_mode(pytester):
    # A test module inside a package-less subfolder, imported with --import-mode=importlib: the
    # ranks cannot import it by name from sys.path and must load it from its file.
    pytester.makepyfile(**{"tests/sub/test_deep.py": r'''
import torch.distributed as dist
from dataclasses import dataclass


@dataclass
class Box:
    value: int


def add(box):
    return Box(box.value + dist.get_rank())


def test_deep(spawn):
    assert [b.value for b in spawn(add, 2, Box(10))] == [10, 11]
'''})
    # (The default prepend mode is what every other test here uses.)
    result = runpytest_forked(pytester, "-p", "pytest_linattn", "--linattn-device", "cpu",
                              "--import-mode=importlib", "tests", rank_servers=True)
    result.assert_outcomes(passed=1)
