"""Running pytest inside a test: inner runs forked from a server that imported torch (and fla) once
per test process, and what a test reads after an inner run (its junit file, what it left running).

`pytester.runpytest_subprocess` starts `python -m pytest` cold: ~2.5 s of CPU for pytest and
torch, ~8 s where the inner run imports fla. `runpytest_forked(pytester, *args)` gives the same
RunResult from a fork of a server (pytest_linattn.ranks.servers) that imported those modules
already: the inner session is a process of its own, in pytester's directory and the test's
environment, output to pytester's stdout/stderr files, but its interpreter did not start cold.

For inner runs that test what a session does, not how a process starts: plugin loading, import
costs and `fla_interpreted` (fla must not be imported yet) keep `runpytest_subprocess`. A test
that signals the inner pytest (Ctrl-C, SIGKILL) starts it with Popen, on a warm python
(`warm_python_command`: a process of its own whose program runs in a fork of the server); so do
torchrun's agents and ranks (`torchrun_command`), and the inner run's `sys.executable` is one, so
its xdist workers start warm too. The inner session's own rank server starts cold, as before, in
the test's environment: a leak tag (`tagged_processes` reads /proc/<pid>/environ, the environment
a process was started with, and the pids the warm python's forks recorded) marks it and its ranks.
With `rank_servers=True` the inner session's rank servers are forked from the same server
(faster, but untagged).

Two differences from a cold start, both harmless to these tests: a module the server imported
is not imported again (fla brings anyio, pytest's plugin: the inner run's "cannot be rewritten"
warning for it is filtered), and sys.path is the cold one's (the directory, PYTHONPATH, the
interpreter's own), rebuilt by hand.
"""
from __future__ import annotations

import atexit
import gc
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from _pytest.pathlib import make_numbered_dir

from tools import warm_python

# Nothing of a pytest plugin's distribution (pytest_linattn, linattn, xdist) is imported in the
# server or in the fork before pytest.main: pytest rewrites their asserts when it imports them.
REWRITE_WARNING = ("-W", "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning")
TIMEOUT = 600.0
# Waits an inner run's tests show are not taken (a call's timeout, the grace after a failure, a
# rank's sleep) are set to LONG_WAIT or more: minutes, which no expected path takes even on a
# machine loaded many times over, while the wrong path always does; which path was taken, the
# test reads from the reports. BACKSTOP only ends an inner run that hangs.
LONG_WAIT = 600
BACKSTOP = 1800
# The servers start in the environment of this module's import (collection), not a test's: a leak
# tag set by a test must mark only what its inner run starts.
_START_ENVIRON = dict(os.environ)


def runpytest_forked(pytester, *args: str, fla: bool = False, rank_servers: bool = False,
                     timeout: float = TIMEOUT) -> pytest.RunResult:
    """`pytester.runpytest_subprocess(*args)`, forked. fla: the server imported fla too (else the
    inner run imports it itself, as a cold one). rank_servers: the inner session's rank servers
    are forks of that server too (servers.CHAIN_ENV), not cold: for runs that check no leak tag,
    which a fork's /proc/<pid>/environ does not show."""
    from pytest_linattn.ranks import servers

    fla = fla and servers.can_preload_fla("cpu")
    server = servers.preloaded_server(servers.FLA_ROOT_PRELOAD if fla else servers.ROOT_PRELOAD, environ=_START_ENVIRON)
    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    args = (f"--basetemp={basetemp}", *REWRITE_WARNING, *map(str, args))
    for plugin in pytester.plugins:  # as runpytest_subprocess: by name only
        if not isinstance(plugin, str):
            raise ValueError(f"a forked run takes plugins by name only, got {plugin!r}")
        args = ("-p", plugin, *args)
    env = dict(os.environ)
    if rank_servers:
        env[servers.CHAIN_ENV] = "forked"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    python = warm_python_command(env, server)  # the inner run's xdist workers start warm too
    out, err = pytester.path / "stdout", pytester.path / "stderr"
    start = time.monotonic()
    proc = servers.fork_process(server, target=_inner_main, name="forked-pytest",
                                args=(args, os.getcwd(), env, str(out), str(err), python))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise pytester.TimeoutExpired(f"{timeout} second timeout expired running pytest {args}")
    lines = [p.read_text(encoding="utf8").splitlines() for p in (out, err)]
    for name, text in zip(("stdout", "stderr"), lines):
        print(f"--- forked pytest {name}:", *text, sep="\n")
    return pytest.RunResult(proc.exitcode, lines[0], lines[1], time.monotonic() - start)


def warm_python_command(env: dict, server=None) -> str:
    """A `python` for processes started with `env` (set up here) that runs its program in a fork
    of `server` (default: this process's torch server; tools.warm_python): a cold start's imports, skipped."""
    from pytest_linattn.ranks import servers

    server = server or servers.preloaded_server(servers.ROOT_PRELOAD, environ=_START_ENVIRON)
    return warm_python.warm_python_command(env, server._forkserver_address)


def _inner_main(args, cwd, env, out, err, python):
    """In the fork: what a cold start of `python -m pytest` in `cwd` has (working directory,
    environment, sys.path, output files), pytest.main, then the interpreter's exit handlers (a
    forked process skips them) and its exit code."""
    warm_python.leave_the_server()
    gc.freeze()  # what the server imported stays: out of the inner run's collections
    server_path = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    interpreter_path = [p for p in sys.path if p and p not in server_path]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = [cwd] + [p for p in env["PYTHONPATH"].split(os.pathsep) if p] + interpreter_path
    sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), *args]
    sys.executable = python
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    try:
        code = int(pytest.main(list(args)))
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# after an inner run


def process_alive(pid: int) -> bool:
    # A zombie is dead for our purpose (its parent has not reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_in(path) -> list[int]:
    return [int(p) for line in path.read_text().split("\n") for p in line.split()]


def forked_pids(tag: str) -> list[int]:
    """The pids of the warm python's forks started with LINATTN_LEAK_TAG=tag, alive or not."""
    path = Path(warm_python.forked_pids_file(tag))
    return pids_in(path) if path.exists() else []


def tagged_processes(tag: str) -> list[int]:
    """Live processes started with LINATTN_LEAK_TAG=tag in their environment: the inner pytest
    run's ranks and anything else it started (a warm python's fork: by the pid it recorded)."""
    needle = f"LINATTN_LEAK_TAG={tag}".encode()
    found = [pid for pid in forked_pids(tag) if process_alive(pid)]
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if needle in env and process_alive(int(d)) and int(d) not in found:
            found.append(int(d))
    return found


def no_leftovers(tag: str, wait: float = 60.0) -> list[int]:
    """The processes tagged `tag` still alive after up to `wait` s (they may be exiting: a loaded
    machine takes its time)."""
    deadline = time.monotonic() + wait
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not left and os.path.exists(warm_python.forked_pids_file(tag)):
        os.unlink(warm_python.forked_pids_file(tag))
    return left


def junit_durations(junit) -> dict[str, float]:
    root = ET.parse(junit).getroot()
    return {case.get("name"): float(case.get("time")) for case in root.iter("testcase")}


def junit_outcomes(junit) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kids = [c.tag for c in case]
        out[case.get("name")] = ("failed" if "failure" in kids or "error" in kids
                                 else "skipped" if "skipped" in kids else "passed")
    return out


# -- pytest under a real torchrun (launcher mode)


def torchrun_env(tag):
    env = {**os.environ, "LINATTN_LEAK_TAG": tag, "GLOO_SOCKET_IFNAME": "lo", "LINATTN_LONG_WAIT": str(LONG_WAIT)}
    env.pop("PYTEST_ADDOPTS", None)
    return env


def torchrun_command(env, *args: str) -> list[str]:
    """`python -m torch.distributed.run args` with a warm python (tools.warm_python): the agent and
    the ranks it starts each skip a cold interpreter's imports."""
    return [warm_python_command(env), "-m", "torch.distributed.run", *args]


TORCHRUN_PYTEST = ["-m", "pytest", "-p", "pytest_linattn", "--linattn-device", "cpu", "-p", "no:randomly",
          "-p", "no:cacheprovider", "-p", "no:xdist", "--junitxml=junit.xml"]


def finish(procs, timeout) -> list[str]:
    """Every process's output; a process still running after `timeout` is killed with its group."""
    texts = []
    try:
        deadline = time.monotonic() + timeout
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            texts.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return texts


def one_node_torchrun(pytester, tag: str, *pytest_args: str, timeout: float) -> tuple[int, str]:
    """pytest under `torchrun --standalone` with 2 ranks: (exit code, output). The output is
    printed too: pytest shows a failed test's captured output whole (an assertion's message it cuts)."""
    env = torchrun_env(tag)
    cmd = torchrun_command(env, "--standalone", "--nproc-per-node", "2", *TORCHRUN_PYTEST, *pytest_args)
    proc = subprocess.Popen(cmd, cwd=pytester.path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    [text] = finish([proc], timeout)
    print(f"===== torchrun output, exit code {proc.returncode} =====\n{text}")
    return proc.returncode, text
