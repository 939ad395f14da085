"""The rank pools' life as processes: xdist workers' pools never collide, no rank outlives its
pytest (whatever signal ends it), a new pool removes only dead processes' directories, GPU leases
never share, parity records made on ranks reach the summary, and the process groups of earlier
calls do not pile up. Inner pytest runs as in test_plugin_spawn.py.
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

from tools.inner_pytest import LONG_WAIT, forked_pids, no_leftovers, pids_in, process_alive, runpytest_forked, warm_python_command
from pytest_linattn.ranks import pool

pytest_plugins = ["pytester"]


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
    proc = subprocess.Popen([warm_python_command(env), "-m", "pytest", "-p", "pytest_linattn", "-q",
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
    [pytest_pid] = forked_pids(tag)  # the fork the warm python ran it in
    assert not no_leftovers(tag), f"ranks alive after {sig} of their pytest"
    # a killed pytest leaves its pool's directory; the next pool started (here, or in another
    # xdist worker first) removes it
    os.rmdir(pool._make_tmpdir())
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"linattn-pool-{pytest_pid}-*"))


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
