"""suites/tools/warm_python.py: a warm `python` runs a program as the cold interpreter would (arguments,
sys.path, working directory, environment, stdio, exit status, signals), dies with its command,
and leaves what it cannot run warm to the real interpreter."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tools import warm_python
from tools.inner_pytest import forked_pids, process_alive, warm_python_command

REPORT = ("import json, os, sys; print(json.dumps(dict(argv=sys.argv, path=sys.path, cwd=os.getcwd(), "
          "env=os.environ.get('WARM_CHECK'), torch='torch' in sys.modules, line=sys.stdin.readline())))")


@pytest.fixture
def env(tmp_path):
    environ = {**os.environ, "WARM_CHECK": "seen", "PYTHONPATH": str(tmp_path / "extra")}
    return environ, warm_python_command(environ)


def _report(python, env, cwd, *args):
    done = subprocess.run([python, *args], input="a line\n", capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("form", ["-c", "-m", "script"])
def test_a_program_sees_what_a_cold_interpreter_gives_it(tmp_path, env, form):
    environ, warm = env
    (tmp_path / "report_mod.py").write_text(REPORT)
    args = {"-c": ["-c", REPORT, "x", "-y"], "-m": ["-u", "-m", "report_mod", "x", "-y"],
            "script": [str(tmp_path / "report_mod.py"), "x", "-y"]}[form]
    cold = _report(sys.executable, environ, tmp_path, *args)
    warmed = _report(warm, environ, tmp_path, *args)
    assert warmed.pop("torch") and not cold.pop("torch")  # the only difference: torch is there already
    assert warmed == cold


def test_exit_status_and_signals_pass_through(env):
    environ, warm = env
    assert subprocess.run([warm, "-c", "raise SystemExit(7)"], env=environ, timeout=120).returncode == 7
    failed = subprocess.run([warm, "-c", "raise KeyError('gone')"], env=environ, capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 1 and failed.stderr.startswith("Traceback") and "KeyError: 'gone'" in failed.stderr
    assert "warm_python" not in failed.stderr  # from the program's own frame, as Python reports it
    killed = subprocess.run([warm, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], env=environ,
                            timeout=120)
    assert killed.returncode == -signal.SIGTERM
    proc = subprocess.Popen([warm, "-c", "import time; print('up', flush=True); time.sleep(600)"], env=environ,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGINT)  # forwarded: KeyboardInterrupt in the program
    assert proc.wait(120) == 128 + signal.SIGINT


def test_the_fork_dies_with_its_command(env):
    environ, warm = env
    tag = f"warm-{os.getpid()}-{time.monotonic_ns()}"
    environ["LINATTN_LEAK_TAG"] = tag
    proc = subprocess.Popen([warm, "-c", "import time; print('up', flush=True); time.sleep(600)"], env=environ,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    [fork] = forked_pids(tag)
    assert fork != proc.pid and process_alive(fork)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while process_alive(fork) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(fork)
    os.unlink(warm_python.forked_pids_file(tag))


def test_what_it_cannot_run_warm_runs_on_the_real_interpreter(env):
    environ, warm = env
    done = subprocess.run([warm, "-I", "-c", "import sys; print('torch' in sys.modules, sys.flags.isolated)"],
                          env=environ, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "1"], done.stderr  # -I: not a flag it takes: exec'd cold
    del environ[warm_python.ADDRESS_ENV]
    done = subprocess.run([warm, "-c", "import sys; print('torch' in sys.modules)"], env=environ, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["False"], done.stderr
