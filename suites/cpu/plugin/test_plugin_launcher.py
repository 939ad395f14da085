"""Launcher mode: pytest itself under a real torchrun (gloo on the CPU, loopback).

A failed call no longer ends the session: the ranks make a new process group and the next test
runs; only a rank that is gone ends it. So one torchrun session holds every fault, each followed
by a test that must pass, and ends with the fault that ends it: one node of 2 ranks, then two
nodes of 2 ranks (two torchrun agents on this machine), one run after another, each with a hard
timeout (the other session-ending faults: test_launcher_rank_exits.py). torchrun's agent
and its ranks run on a warm python (tools.inner_pytest.torchrun_command): each is a process of its own,
as in a real launch, without a cold interpreter's imports.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from tools.inner_pytest import (BACKSTOP, LONG_WAIT, TORCHRUN_PYTEST, finish, junit_durations, junit_outcomes, no_leftovers,
                          one_node_torchrun, torchrun_command, torchrun_env)

pytest_plugins = ["pytester"]

SUITES = Path(__file__).resolve().parents[2]

LAUNCHED_TESTS = r'''
import os, time
import pytest
import torch
import torch.distributed as dist
from pytest_linattn.ranks import launcher_watchdog
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


# Each fault, then a test on the same session that must pass; a rank that exits ends it.
@pytest.mark.parametrize("step", ["raise", "raise:next", "raise_late_watchdog", "raise_late_watchdog:next",
                                  "hang", "hang:next", "exit", "exit:next"])
def test_fault(spawn, step, monkeypatch):
    fault, _, then = step.partition(":")
    if then:
        assert spawn(info, 2, 1)[1][2].item() == 2
        return
    if fault == "raise_late_watchdog" and dist.get_rank() == 0:
        # rank 0's watchdog looks every 1.5 s, and does not see its barrier blocked: rank 1's
        # abort after the grace frees rank 0's barrier (closed connection) before rank 0's
        # watchdog has seen it, as on a loaded two-core machine
        monkeypatch.setattr(launcher_watchdog, "WATCH", 1.5)
        monkeypatch.setattr(launcher_watchdog.Watchdog, "_blocked_in", lambda self, call: None)
    if fault == "raise":
        # only seeing rank 0 blocked in its barrier can end this one before the (long) grace
        monkeypatch.setattr(launcher_watchdog, "FAILURE_GRACE", float(os.environ["LINATTN_LONG_WAIT"]))
    if fault == "hang":
        spawn.timeout = 2  # the others run at LONG_WAIT, which they must not wait for
    fn = {"raise": raise_in_collective, "raise_late_watchdog": raise_in_collective, "exit": exit_on_one,
          "hang": hang_on_zero}[fault]
    spawn(fn, 2)


def test_last(spawn):
    spawn(info, 2, 1)
'''


def test_faults_under_torchrun(pytester):
    pytester.makepyfile(test_launched=LAUNCHED_TESTS)
    tag = f"launcher-{os.getpid()}-{time.monotonic_ns()}"
    returncode, text = one_node_torchrun(pytester, tag, "--tp", "2,4,3", "--linattn-timeout", str(LONG_WAIT),
                                          "test_launched.py", timeout=BACKSTOP)
    assert returncode != 0, text
    # One report (rank 1 runs quietly); after each fault the next test passes; the exit ends it.
    assert text.count("test session starts") == 1, text
    assert "4 failed, 7 passed, 1 deselected in" in text, text
    outcomes = junit_outcomes(pytester.path / "junit.xml")
    for fault in ("raise", "raise_late_watchdog", "hang", "exit"):
        assert outcomes[f"test_fault[{fault}]"] == "failed", outcomes
    for fault in ("raise", "raise_late_watchdog", "hang"):
        assert outcomes[f"test_fault[{fault}:next]"] == "passed", outcomes
    # Sizes that do not fit WORLD_SIZE are deselected, with the reason; unsupported ones named.
    assert "tp_size x cp_size = WORLD_SIZE=2: test_launched.py::test_sized[tp4]" in text
    assert "test_launched.py::test_sized: not run at tp 3 asked for; the test supports tp 2, 4" in text
    reports = _reports(text)
    # The same report whichever rank's watchdog saw the abort first (before that fix, a rank 0
    # freed before its watchdog looked reported "ranks 0, 1 failed" with no reason)
    # rank 0's watchdog sees it blocked in the barrier: no grace; a late watchdog: the grace
    assert "rank 1 raised and rank 0 was blocked in torch.distributed (barrier)" in reports["raise"]
    assert "rank 1 raised and rank 0 had not answered 2 s later" in reports["raise_late_watchdog"]
    for fault in ("raise", "raise_late_watchdog"):
        raised = reports[fault]
        assert "raise_in_collective(...) on 2 ranks" in raised
        assert "ValueError: rank one is unhappy" in raised and "in raise_in_collective" in raised
        assert "rank 0 stack at the abort (it had not returned)" in raised and "in barrier" in raised
        assert "a new process group replaced the old one, and the session goes on" in raised
    hung = reports["hang"]
    assert "hang_on_zero(...) on 2 ranks (launcher mode, call 9): timed out after 2 s" in hung
    assert "rank 0 stack at the abort" in hung and "rank 1 stack at the abort" in hung
    assert "time.sleep(600)" in hung and "in barrier" in hung
    assert "a new process group replaced the old one" in hung
    exited = reports["exit"]
    # The death first, then the survivor's consequence; then the session's end, and what it left.
    # (rank 0 saw rank 1's process gone: it waited for nothing more from it)
    died = exited.index("rank 1 sent nothing: it died (its process exited")
    assert died < exited.index("--- rank 0 raised"), exited
    # the same verdict whenever torchrun's SIGTERM reaches rank 0 (before, it raced the regroup)
    assert "No new process group can be made without every rank: rank 1 exited." in exited, exited
    assert "linattn: a rank is gone after a failure in test_launched.py::test_fault[exit]" in text
    assert "linattn: 2 test(s) not run: a rank was gone after test_launched.py::test_fault[exit]" in text
    assert "NOT RUN test_launched.py::test_fault[exit:next]" in text
    assert "NOT RUN test_launched.py::test_last" in text
    durations = junit_durations(pytester.path / "junit.xml")
    print("durations:", durations)
    # the reports above say which path each took; none waited for the call timeout or the grace
    for fault in ("raise", "raise_late_watchdog", "exit", "hang"):
        assert durations[f"test_fault[{fault}]"] < LONG_WAIT, durations
    assert not no_leftovers(tag), "a rank outlived its torchrun"


def _reports(text: str) -> dict[str, str]:
    """Each failed test_fault[...]'s report, from pytest's FAILURES section."""
    blocks = text.split("_ test_fault[")[1:]
    return {block.split("]", 1)[0]: block for block in blocks}


TWO_NODE_TESTS = r'''
import os, signal, sys
import pytest
import torch.distributed as dist

sys.path[:0] = [os.environ["LINATTN_SUITES"], os.path.join(os.environ["LINATTN_SUITES"], "cpu", "library")]
# The cpu suite's TP x CP = 2 x 2 parity test (every layer family), collected here: it runs first.
from test_layers_cp import test_tp_cp_layer_matches_replicated  # noqa: E402,F401


def on_node_one():  # node 1's second rank: global rank 3
    return os.environ["GROUP_RANK"] == "1" and os.environ["LOCAL_RANK"] == "1"


def raise_on_node_one():
    if on_node_one():
        raise ValueError("node one is unhappy")
    dist.barrier()


def kill_on_node_one():
    if on_node_one():
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def node():
    return int(os.environ["GROUP_RANK"])


@pytest.mark.parametrize("step", ["raise", "raise:next", "kill", "kill:next"])
def test_node_one(spawn, step):
    fault, _, then = step.partition(":")
    if then:
        assert spawn(node, 4) == [0, 0, 1, 1]
        return
    spawn({"raise": raise_on_node_one, "kill": kill_on_node_one}[fault], 4)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes(pytester):
    # Two torchrun agents on this machine, two ranks each, over loopback, each told its node rank
    # (torchrun's static rendezvous, as a cluster launch gives it): node 0's agent hosts the store.
    # (With the c10d rendezvous the order of joining decides, which a loaded machine can swap.)
    pytester.makepyfile(test_two_nodes=TWO_NODE_TESTS)
    tag = f"two-nodes-{os.getpid()}-{time.monotonic_ns()}"
    port = _free_port()
    env = {**torchrun_env(tag), "LINATTN_SUITES": str(SUITES)}
    procs = []
    for node in (0, 1):
        cmd = torchrun_command(env, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "--local-addr", "127.0.0.1",
                               *TORCHRUN_PYTEST, "--tp", "2", "--cp", "2", "--linattn-timeout", str(LONG_WAIT),
                               "test_two_nodes.py")
        procs.append(subprocess.Popen(cmd, cwd=pytester.path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    texts = finish(procs, BACKSTOP)
    for node, (proc, text) in enumerate(zip(procs, texts)):
        print(f"===== node {node}'s torchrun, exit code {proc.returncode} =====\n{text}")
    node0, node1 = texts
    # One report, from global rank 0 on node 0; node 1's ranks run quietly.
    assert node0.count("test session starts") == 1 and "test session starts" not in node1, \
        "node 0's agent did not report"
    assert all(proc.returncode != 0 for proc in procs)
    outcomes = junit_outcomes(pytester.path / "junit.xml")
    parity = {name: o for name, o in outcomes.items() if name.startswith("test_tp_cp_layer")}
    assert len(parity) == 3 and set(parity.values()) == {"passed"}, outcomes
    assert outcomes["test_node_one[raise]"] == "failed" and outcomes["test_node_one[raise:next]"] == "passed"
    assert outcomes["test_node_one[kill]"] == "failed" and "test_node_one[kill:next]" not in outcomes
    assert "2 failed, 4 passed" in node0, node0
    reports = {block.split("]", 1)[0]: block for block in node0.split("_ test_node_one[")[1:]}
    host = socket.gethostname()
    # A rank on node 1 raises: reported once, with its node, and the session goes on.
    raised = reports["raise"]
    assert "raise_on_node_one(...) on 4 ranks" in raised
    assert f"--- rank 3 (node 1 = {host}, local rank 1) raised:" in raised, raised
    assert "ValueError: node one is unhappy" in raised
    # (pytest's -ra summary repeats the whole message when it runs on a CI: only the reports count)
    assert (node0.split("short test summary info")[0] + node1).count("ValueError: node one is unhappy") == 1
    assert "a new process group replaced the old one, and the session goes on" in raised
    # A rank on node 1 is killed: the session ends, with the report on node 0.
    killed = reports["kill"]
    assert f"--- rank 3 (node 1 = {host}, local rank 1) sent nothing: it died (its process exited" in killed, \
        killed
    assert "No new process group can be made without every rank" in killed, killed
    assert "NOT RUN test_two_nodes.py::test_node_one[kill:next]" in node0
    durations = junit_durations(pytester.path / "junit.xml")
    print("durations:", durations)
    assert durations["test_node_one[raise]"] < LONG_WAIT and durations["test_node_one[kill]"] < LONG_WAIT, durations
    assert not no_leftovers(tag), "a rank outlived its torchrun"
