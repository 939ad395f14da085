"""The spawn fixture and its rank pools, exercised in pytest runs of their own: forked from a server
that imported torch once (inner_pytest), or cold subprocesses where the test signals its pytest.

Each inner run packs several scenarios into one session, because a pool start costs seconds on
a small CPU: the same session checks that a failure is contained and the next test passes.
The 10x xdist stress run is behind ``LINATTN_STRESS=10`` (the default suite runs it once).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

import pytest

from inner_pytest import (BACKSTOP, LONG_WAIT, junit_durations, junit_outcomes, no_leftovers, pids_in,
                          process_alive, runpytest_forked)
from pytest_linattn.ranks import pool

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


def _stress_rounds() -> int:
    return int(os.environ.get("LINATTN_STRESS", "1"))


def test_xdist_pools_never_collide(pytester):
    """20 distributed tests under ``-n 2``; ``LINATTN_STRESS=10`` repeats the run 10 times."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_many=r'''
import pytest
import torch
import torch.distributed as dist


def reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("i", range(20))
def test_many(spawn, i):
    ws = 2 if i % 2 else 3
    assert spawn(reduce_rank, ws) == [ws * (ws - 1) / 2] * ws
''')
    for round_ in range(_stress_rounds()):
        start = time.monotonic()
        result = runpytest_forked(pytester, "-p", "pytest_linattn", "--linattn-device", "cpu",
                                  "-n", "2", "-p", "no:randomly")
        text = result.stdout.str()
        assert result.ret == 0, f"round {round_}:\n{text}"
        result.assert_outcomes(passed=20)
        assert "rendezvous" not in text.lower() and "address already in use" not in text.lower()
        print(f"round {round_}: 20 passed in {time.monotonic() - start:.1f} s")


SLEEPER = r"""
import os, time
import torch.distributed as dist


def pid():
    return os.getpid()


def test_sleep(spawn):
    pids = spawn(pid, 2)
    with open(os.environ["PIDS_FILE"], "w") as f:
        f.write(" ".join(map(str, pids)))
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_no_rank_outlives_its_pytest(pytester, sig):
    """Ctrl-C: pytest shuts the pools down. SIGKILL of pytest: the ranks notice and exit."""
    import signal

    pytester.makepyfile(test_sleeper=SLEEPER)
    pids_file = pytester.path / "pids.txt"
    tag = f"kill-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PIDS_FILE": str(pids_file), "LINATTN_LEAK_TAG": tag}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "pytest_linattn", "-q",
                             "-p", "no:cacheprovider", "--linattn-device", "cpu", "test_sleeper.py"],
                            cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # even if ignored here
    try:
        deadline = time.monotonic() + LONG_WAIT
        while not (pids_file.exists() and pids_file.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.1)
        pids = pids_in(pids_file)
        assert len(pids) == 2 and all(process_alive(p) for p in pids)
        proc.send_signal(getattr(signal, sig))
        proc.wait(LONG_WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == "SIGINT":
        assert proc.returncode == pytest.ExitCode.INTERRUPTED
    assert not no_leftovers(tag), f"ranks alive after {sig} of their pytest"
    # a killed pytest leaves its pool's directory; the next pool started (here, or in another
    # xdist worker first) removes it
    os.rmdir(pool._make_tmpdir())
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"linattn-pool-{proc.pid}-*"))


def test_a_new_pool_removes_the_directories_of_dead_processes_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    stale, live, foreign = (tmp_path / f"linattn-pool-{gone}-a", tmp_path / f"linattn-pool-{os.getpid()}-b",
                            tmp_path / "linattn-pool-c")
    for d in (stale, live, foreign):
        d.mkdir()
        (d / "rank0.stack").write_text("")
    made = pool._make_tmpdir()
    assert not stale.exists() and live.exists() and foreign.exists()
    assert os.path.dirname(made) == str(tmp_path) and os.path.basename(made).startswith(f"linattn-pool-{os.getpid()}-")


def test_gpu_leases_never_share(tmp_path):
    # flock is per open file: two leases conflict even inside one process, as across xdist workers.
    from pytest_linattn.ranks.gpus import GpuLease, NotEnoughGpus

    ids = ["0", "1", "2", "3"]
    a = GpuLease(2, lock_dir=str(tmp_path), gpu_ids=ids)
    b = GpuLease(2, lock_dir=str(tmp_path), gpu_ids=ids)
    assert a.acquire(timeout=1) == ["0", "1"]
    assert b.acquire(timeout=1) == ["2", "3"]
    with pytest.raises(TimeoutError, match="could not lease 1 GPUs"):
        GpuLease(1, lock_dir=str(tmp_path), gpu_ids=ids).acquire(timeout=0.3)
    # A waiting lease first frees its owner's idle GPUs (on_wait), then takes them.
    c = GpuLease(1, lock_dir=str(tmp_path), gpu_ids=ids)
    assert c.acquire(timeout=1, on_wait=a.release) == ["0"]
    with pytest.raises(NotEnoughGpus, match="needs 5 GPUs"):
        GpuLease(5, lock_dir=str(tmp_path), gpu_ids=ids).acquire(timeout=0.1)
    with pytest.raises(ValueError, match="n must be"):
        GpuLease(0)
    b.release()
    c.release()
    assert GpuLease(4, lock_dir=str(tmp_path), gpu_ids=ids).acquire(timeout=1) == ids


def test_parity_records_made_on_ranks_reach_the_summary(pytester):
    pytester.makepyfile(test_rank_parity=r'''
import torch
import torch.distributed as dist
from pytest_linattn import assert_parity


def compare():
    x = torch.randn(4, 3, dtype=torch.float64)
    y = x.clone()
    if dist.get_rank() == 1:
        y[2, 1] += 1.0
    assert_parity(y, x, rtol=1e-10, name="h")


def test_on_ranks(spawn):
    spawn(compare, 2)
''')
    result = runpytest_forked(pytester, "-p", "pytest_linattn", "--linattn-device", "cpu", rank_servers=True)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 failed*", "*2 check(s), 1 failed*",
                                 "*test_rank_parity.py::test_on_ranks*rank1:h*FAIL*"])


_KEPT_GROUPS = {}  # on the ranks: a group a test keeps across its calls


def groups_made_and_threads():
    """Makes a TP group as a harness call does, and uses one kept from the first call; returns
    the two all-reduces and this rank's threads."""
    import torch
    import torch.distributed as dist

    from linattn.parallel import new_groups

    tp_group, _ = new_groups(dist.get_world_size())
    kept = _KEPT_GROUPS.setdefault("tp", new_groups(dist.get_world_size())[0])
    sums = [torch.ones(2), torch.ones(2)]
    dist.all_reduce(sums[0], group=tp_group)
    dist.all_reduce(sums[1], group=kept)
    return sums, len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_groups_of_earlier_calls_do_not_pile_up(spawn):
    # A gloo group holds three threads; before the groups of earlier calls were destroyed a
    # rank held 126 after 20 such calls (12 after the first). A group the test keeps stays.
    out = [spawn(groups_made_and_threads, 2) for _ in range(6)]
    assert all(t.tolist() == [2.0, 2.0] for call in out for sums, _ in call for t in sums)
    threads = [[n for _, n in call] for call in out]
    assert threads[-1] == threads[1], threads
