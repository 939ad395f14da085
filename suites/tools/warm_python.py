"""A `python` command that starts warm: the program runs in a fork of a server that imported torch.

The suite starts many Python processes that only a real process can stand for: xdist's workers
(execnet runs `python -u -c ...`), torchrun's agents and ranks, pytest sessions that a test
signals. Each cold one imports pytest and torch again: 2.5-3 s of CPU on the 2-core machine. Run
through `tools.inner_pytest.warm_python_command(environ)` instead, the program runs in a fork of
tools.inner_pytest's server, which imported torch once per test process; the command itself is a small
interpreter that imports only the standard library, hands its stdin, stdout and stderr to the fork
and stands for it: it forwards the signals it can catch, and exits with the fork's exit status (or
dies of the same signal). The fork dies with it (a pipe only the command holds closes: the fork
kills itself), as a process in the command's group would under `killpg`; and `sys.executable` in
the fork is the command, so what it starts (torchrun's ranks, xdist's workers) starts warm too.

The fork runs what a cold interpreter would: the same arguments (`-c`, `-m`, a script; `-u`, `-B`,
`-E`), working directory, environment and sys.path (PYTHONPATH, the interpreter's own).
Anything else (other flags, no server address, a Python whose forkserver authenticates its
clients) runs the real interpreter (exec), cold. /proc/<pid>/environ of a fork shows the server's
environment, not the fork's: a fork started with LINATTN_LEAK_TAG set records its pid in
`forked_pids_file(tag)`, where tools.inner_pytest.tagged_processes looks too.
"""
from __future__ import annotations

import os
import signal
import sys

ADDRESS_ENV = "LINATTN_WARM_PYTHON"  # the server's socket address; unset: the real interpreter runs
REAL_PYTHON_ENV = "LINATTN_REAL_PYTHON"
_PR_SET_PDEATHSIG = 1
_FLAGS = {"-u", "-B", "-E"}
_command = None
_replaced_streams = []  # the fork's inherited std streams: kept, so that no collection closes fds 0-2


def warm_python_command(environ: dict, server_address: str) -> str:
    """The path of the warm `python` for processes started with `environ`, which this points at
    the forkserver at `server_address`: the command's file, made once per test process."""
    environ[ADDRESS_ENV] = server_address
    environ[REAL_PYTHON_ENV] = _real_python()
    global _command
    if _command is None:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="linattn-warm-python-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _command = os.path.join(folder, "python")
        with open(_command, "w") as f:
            f.write(f"#!{_real_python()}\nimport sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                    "import warm_python\nwarm_python.main(sys.argv[1:])\n")
        os.chmod(_command, 0o755)
    return _command


def forked_pids_file(tag: str) -> str:
    """Where the forks started with LINATTN_LEAK_TAG=tag record their pids."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"linattn-warm-python-{tag}.pids")


def _real_python() -> str:
    return os.environ.get(REAL_PYTHON_ENV) or sys.executable


def main(args: list[str]) -> None:
    """The command: run `python args` in a fork of the server, or the real interpreter."""
    parsed = _parse(args)
    address = os.environ.get(ADDRESS_ENV)
    if parsed is None or not address or not _fork_allowed():
        real = _real_python()
        os.execv(real, [real, *args])
    pid, status_r = _fork(address, parsed)
    if tag := os.environ.get("LINATTN_LEAK_TAG"):
        with open(forked_pids_file(tag), "a") as f:
            f.write(f"{pid}\n")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _frame: os.kill(pid, s))
    from multiprocessing import forkserver

    try:
        code = forkserver.read_signed(status_r)
    except EOFError:  # the server was killed (its test process ended) and the fork with it
        code = -signal.SIGKILL
    if code < 0:  # the fork died of a signal: so does the command
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _parse(args: list[str]):
    """(flags, kind, target, argv) for the forms a cold interpreter takes, else None."""
    flags, i = set(), 0
    while i < len(args):
        arg = args[i]
        if arg in _FLAGS:
            flags.add(arg)
        elif arg in ("-c", "-m") and i + 1 < len(args):
            target = args[i + 1]
            argv = ["-c" if arg == "-c" else target, *args[i + 2:]]
            return flags, arg, target, argv
        elif not arg.startswith("-"):
            return flags, "script", arg, args[i:]
        else:
            return None
        i += 1
    return None  # an interactive interpreter: the real one


def _fork_allowed() -> bool:
    from multiprocessing import forkserver

    # A forkserver that authenticates its clients (newer Pythons) takes more than this sends.
    return not hasattr(forkserver, "_AUTHKEY_LEN") and sys.platform.startswith("linux")


def _fork(address: str, parsed) -> tuple[int, int]:
    """Ask the server at `address` for a fork running _child_main; (its pid, the fd its exit
    status arrives on)."""
    import io
    import socket
    from multiprocessing import forkserver, reduction
    from multiprocessing.context import ForkServerProcess, set_spawning_popen

    parent_r, child_w = os.pipe()
    child_r, parent_w = os.pipe()
    alive_r, alive_w = os.pipe()  # the fork's "alive" copy of the server's pipe: it closes it
    watch_r, watch_w = os.pipe()  # only this command holds watch_w: the fork dies when it closes
    devnull = os.open(os.devnull, os.O_WRONLY)  # the resource tracker's place: none here
    # sys.path[2:]: not this module's folder, nor the command's (the fork's sys.path is a cold one's)
    body = ForkServerProcess(target=_child_main, name="warm-python",
                             args=(parsed, os.getcwd(), dict(os.environ), sys.path[2:], os.path.abspath(sys.argv[0])))
    buf = io.BytesIO()
    set_spawning_popen(object())  # the process object carries an authkey, pickled only while spawning
    try:
        reduction.dump({"sys_path": sys.path}, buf)
        reduction.dump(body, buf)
    finally:
        set_spawning_popen(None)
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(address)
        reduction.sendfds(client, [child_r, child_w, alive_r, devnull, 0, 1, 2, watch_r])
    for fd in (child_r, child_w, alive_r, alive_w, devnull, watch_r):
        os.close(fd)
    with open(parent_w, "wb", closefd=True) as f:
        f.write(buf.getbuffer())
    return forkserver.read_signed(parent_r), parent_r


def leave_the_server() -> None:
    """In a fork of a multiprocessing forkserver: close this fork's copy of the server's "alive"
    pipe (the server ends with its test process), and die with the server. Standard library only:
    nothing pytest rewrites is imported before the program's own pytest session."""
    import ctypes
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _child_main(parsed, cwd: str, environ: dict, interpreter_path: list, command: str) -> None:
    """In the fork: stdio, directory, environment and sys.path of a cold `python`, then the program,
    then what a real interpreter's exit runs (a fork skips it)."""
    import atexit
    import gc
    import io
    import runpy
    import threading
    from multiprocessing import forkserver

    fds = forkserver._forkserver._inherited_fds
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    watch = fds[3]
    leave_the_server()

    def die_with_the_command():
        os.read(watch, 1)  # EOF: the command is gone
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_the_command, name="warm-python-watch", daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    gc.freeze()
    flags, kind, target, argv = parsed
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    if environ.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
        # read by OpenMP when the server loaded torch, not again: as a cold start would have it
        sys.modules["torch"].set_num_threads(int(environ["OMP_NUM_THREADS"]))
    sys.executable = command  # what this program starts with sys.executable starts warm too
    python_env = {} if "-E" in flags else environ  # -E: the PYTHON* variables are not read
    sys.dont_write_bytecode = "-B" in flags or bool(python_env.get("PYTHONDONTWRITEBYTECODE"))
    pythonpath = [p for p in python_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    interpreter = [p for p in interpreter_path if p not in pythonpath]
    first = os.path.dirname(os.path.abspath(target)) if kind == "script" else (os.getcwd() if kind == "-m" else "")
    sys.path[:] = [first, *pythonpath, *interpreter]
    unbuffered = "-u" in flags or bool(python_env.get("PYTHONUNBUFFERED"))
    _replaced_streams.extend((sys.stdin, sys.stdout, sys.stderr))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), line_buffering=False)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                            write_through=unbuffered, line_buffering=name == "stderr" or unbuffered))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = list(argv)
    code = 0
    try:
        if kind == "-c":
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        elif kind == "-m":
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr) or 1))
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException as e:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the program's frame, as Python's own
        code = 1
    finally:
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(code)
