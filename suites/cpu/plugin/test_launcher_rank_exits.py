"""Launcher mode's session-ending faults beyond the one-node and two-node runs of
test_plugin_launcher.py, each a short torchrun run of its own: rank 0 (the one that reports)
dying in a call, a rank dying between calls, a launcher stop in a teardown; and how a gone
process is told to the ranks elsewhere. Each torchrun run's agent and
ranks run on a warm python (tools.inner_pytest.torchrun_command).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tools.inner_pytest import BACKSTOP, LONG_WAIT, no_leftovers, one_node_torchrun

pytest_plugins = ["pytester"]


RANK_ZERO_EXITS = r'''
import os
import torch.distributed as dist


def exit_on_zero():
    if dist.get_rank() == 0:
        os._exit(5)
    dist.barrier()


def test_rank_zero_exits(spawn):
    spawn(exit_on_zero, 2)
'''


def test_rank_zero_gone_under_torchrun(pytester):
    # Rank 0, the one that reports, dies in a call: rank 1 says what it saw, and ends at once
    # instead of waiting for a report that will not come (torchrun then kills it 30 s later).
    pytester.makepyfile(test_rank_zero=RANK_ZERO_EXITS)
    tag = f"rank-zero-{os.getpid()}-{time.monotonic_ns()}"
    returncode, text = one_node_torchrun(pytester, tag, "--linattn-timeout", str(LONG_WAIT), "test_rank_zero.py",
                                          timeout=BACKSTOP)
    assert returncode != 0
    report = text.split("linattn, rank 1: rank 0 did not answer; what this rank saw:", 1)[1]
    assert "exit_on_zero(...) on 2 ranks (launcher mode, call 1)" in report, text
    assert "--- rank 0 sent nothing: it died (its process exited" in report, text
    assert "--- rank 1 raised:" in report, text
    assert "in exit_on_zero" in report and "dist.barrier()" in report, text
    # torchrun SIGKILLs a rank 30 s after its SIGTERM: rank 1 ended on its own, not waiting for
    # a report (launcher_watchdog.OVER_WAIT, 60 s) that would not come
    assert "Unable to shutdown process" not in text, "rank 1 waited for rank 0's report until torchrun killed it"
    assert not no_leftovers(tag), "a rank outlived its torchrun"


RANK_ONE_EXITS_BETWEEN_CALLS = r'''
import os, time
import torch.distributed as dist


def rank():
    return dist.get_rank()


def test_first(spawn):
    assert spawn(rank, 2) == [0, 1]


def test_rank_one_exits_outside_a_call():
    if dist.get_rank() == 0:
        open("rank0-is-here", "w").close()
        time.sleep(600)  # rank 0 is in no distributed call when its launcher's SIGTERM comes
    while not os.path.exists("rank0-is-here"):  # not before rank 0 is in this test
        time.sleep(0.05)
    os._exit(3)


def test_after(spawn):
    assert spawn(rank, 2) == [0, 1]
'''


def test_rank_gone_between_calls_under_torchrun(pytester):
    # No call to fail: the launcher's SIGTERM interrupts rank 0's session, which names the test
    # it came in and lists what did not run.
    pytester.makepyfile(test_between=RANK_ONE_EXITS_BETWEEN_CALLS)
    tag = f"between-{os.getpid()}-{time.monotonic_ns()}"
    returncode, text = one_node_torchrun(pytester, tag, "test_between.py", timeout=BACKSTOP)
    assert returncode != 0
    assert ("linattn: 2 test(s) not run: the launcher stopped this session during "
            "test_between.py::test_rank_one_exits_outside_a_call (a rank on its node exited)") in text, text
    assert "NOT RUN test_between.py::test_rank_one_exits_outside_a_call\nNOT RUN test_between.py::test_after" in text
    assert "LauncherStopped: the launcher sent SIGTERM: a rank on this node exited" in text, text
    assert "1 passed" in text, text
    # the sleep was cut short by the SIGTERM, not killed 30 s later by torchrun
    assert "Unable to shutdown process" not in text, text
    assert not no_leftovers(tag), "a rank outlived its torchrun"


STOPPED_IN_TEARDOWN = r'''
import pytest
from pytest_linattn.ranks.launcher import LauncherStopped
from pytest_linattn.spawn import LauncherStops


def pytest_configure(config):  # as launcher mode registers it
    config.pluginmanager.register(LauncherStops(), LauncherStops.name)


@pytest.fixture
def stopped_after():
    yield
    raise LauncherStopped("the launcher sent SIGTERM: a rank on this node exited")
'''


def test_a_launcher_stop_in_a_teardown_does_not_list_the_test_that_ran(pytester):
    # The SIGTERM can come after a test's call was reported (its teardown): that test ran.
    pytester.makeconftest(STOPPED_IN_TEARDOWN)
    pytester.makepyfile(test_stop="def test_ran(stopped_after):\n    pass\n\n\ndef test_next():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:randomly")
    text = result.stdout.str()
    assert "linattn: 1 test(s) not run: the launcher stopped this session after test_stop.py::test_ran" in text, text
    assert "NOT RUN test_stop.py::test_next" in text and "NOT RUN test_stop.py::test_ran" not in text, text
    assert "1 passed" in text, text


# A child that prints its process_identity(), then reads its stdin to the end
PRINT_IDENTITY = ("import sys; from pytest_linattn.ranks.launcher_recovery import process_identity; "
                  "print(process_identity(), flush=True); sys.stdin.read()")


def test_a_process_is_gone_once_it_exits():
    # Launcher mode's dead-rank check: a rank's identity, posted at its first call, is gone once
    # its process exited (a zombie its launcher has not reaped yet counts); a live one, or one on
    # another machine, is not.
    from pytest_linattn.ranks.launcher_recovery import is_gone, process_identity

    child = subprocess.Popen([sys.executable, "-c", PRINT_IDENTITY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    identity = child.stdout.readline().strip()
    machine, pid, start = identity.split(" ")
    assert int(pid) == child.pid and process_identity().split(" ")[0] == machine
    assert not is_gone(identity) and not is_gone(process_identity())
    child.stdin.close()  # the child reads to the end and exits; not reaped yet, it is a zombie
    deadline = time.monotonic() + LONG_WAIT
    while not is_gone(identity) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert is_gone(identity)
    assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # not reaped
    assert child.wait(LONG_WAIT) == 0
    assert is_gone(identity)  # reaped
    assert not is_gone(f"another-machine {pid} {start}") and not is_gone("")
    assert is_gone(f"{machine} {os.getpid()} 1")  # the pid lives, but a later process took it


def test_a_rank_seen_gone_is_told_to_the_ranks_elsewhere(monkeypatch):
    # Only a rank on the gone rank's machine can see its process gone; it posts that to the
    # launcher's store, where rank 0 on another node (which cannot see it) reads it.
    import torch.distributed as dist
    from pytest_linattn.ranks import launcher

    exited = subprocess.run([sys.executable, "-c", PRINT_IDENTITY], stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, check=True).stdout.strip()
    store = dist.HashStore()
    elsewhere, here = launcher.LauncherSession(0, 3), launcher.LauncherSession(1, 3)
    elsewhere.store = here.store = store
    store.set(here.key("process", 2), exited)
    with monkeypatch.context() as m:  # rank 0 cannot see rank 2's machine
        m.setattr(launcher, "is_gone", lambda identity: False)
        assert elsewhere.gone_ranks([0, 1, 2]) == set()
    assert here.gone_ranks([2]) == {2}
    with monkeypatch.context() as m:
        m.setattr(launcher, "is_gone", lambda identity: False)
        assert elsewhere.gone_ranks([0, 1, 2]) == {2}
