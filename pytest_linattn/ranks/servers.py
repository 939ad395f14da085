"""Where a CPU pool's ranks come from: forked from a preloaded server, not spawned.

A spawned rank is a fresh interpreter that imports torch (and, where a test runs fla-based
layers, fla: seconds of CPU each) before it can join its process group. Here a server process
(multiprocessing's forkserver, one instance per flavour) imports them once per session; every
rank after that is a fork of it, ready in a fraction of a second (../shared/notes/rank-start.md:
4 fla-importing ranks in 0.2 s instead of ~40 s on a loaded 2-core machine).

Flavours: "torch" (torch, torch.distributed, pytest, this package, linattn) and "fla" (those
plus fla and linattn.emulation, only on a machine without a visible GPU; under Triton's
interpreter an "fla" server imports fla with TRITON_INTERPRET=1 set, so its kernels are the
interpreted ones, and each rank applies the interpreter's patches). A server is also keyed by
the environment variables its preloaded modules read when imported (TRITON_*, OMP_*, ...): a
change starts another one. Each process (each xdist worker) has its own servers; they exit with it.

Safety of the fork: the server only imports (no tensor op, no thread of its own: numpy's
OpenBLAS pool shuts itself down around a fork), never opens a process group and never touches
CUDA: CUDA pools spawn their ranks. A rank closes its copy of the server's "alive" pipe, so the
server exits as soon as the test process does (even killed), and the ranks, whose
PR_SET_PDEATHSIG is set against the server, die with it (worker.rank_main).
"""
from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import signal
import socket
import sys
import threading
from multiprocessing import connection, forkserver, popen_forkserver, spawn, util
from multiprocessing.context import ForkServerProcess, reduction, set_spawning_popen

__all__ = ["Starter", "can_fork_from_servers", "can_preload_fla", "close_servers", "detach_from_server",
           "fla_stage_from_parent_server", "fork_process", "preloaded_server", "process_uses_fla", "starter"]

# Stages: servers that import only what no test process rewrites (pytest rewrites its plugins'
# asserts on import), from which the others are forked; so torch, and fla, are imported once per
# process and environment however many servers start (the suites' inner pytest runs use them too).
ROOT_PRELOAD = ("torch", "torch.distributed")
FLA_ROOT_PRELOAD = ROOT_PRELOAD + ("fla",)
_STAGES = (FLA_ROOT_PRELOAD, ROOT_PRELOAD)  # the longest first
_PLUGIN_PRELOAD = ("pytest", "pytest_linattn", "pytest_linattn.ranks.worker", "pytest_linattn.autotune",
                   "pytest_linattn.parity.check", "linattn", "linattn.layers", "linattn.parallel", "linattn.reference")
BASE_PRELOAD = ROOT_PRELOAD + _PLUGIN_PRELOAD
FLA_PRELOAD = FLA_ROOT_PRELOAD + _PLUGIN_PRELOAD + ("linattn.emulation",)
# read by the preloaded modules when imported: a server started under other values is stale
_IMPORT_ENV_PREFIXES = ("TRITON", "FLA_", "TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS_", "KMP_",
                        "CUDA")
CHAIN_ENV = "LINATTN_RANK_SERVERS"  # "forked": see _ForkedServer

_servers: dict[tuple, forkserver.ForkServer] = {}
_lock = threading.Lock()


class Starter:
    """How a pool starts its ranks: `process(...)` makes a multiprocessing.Process (not started);
    `parent_pid` is the pid the ranks' parent has (a server's, or this process's), `pdeathsig`
    whether PR_SET_PDEATHSIG may be used (the forking thread outlives the ranks), `fla` whether
    fla is already imported in the ranks."""

    def __init__(self, server: forkserver.ForkServer | None, fla: bool):
        self._server = server
        self.fla = fla
        if server is None:
            self.method = "spawn"
            self.parent_pid = os.getpid()
            self.pdeathsig = threading.current_thread() is threading.main_thread()
        else:
            self.method = f"forked from a preloaded server ({'fla' if fla else 'torch'})"
            self.parent_pid = server._forkserver_pid
            self.pdeathsig = True  # the server forks from its main thread

    def process(self, **kwargs) -> multiprocessing.Process:
        if self._server is None:
            return multiprocessing.get_context("spawn").Process(**kwargs)
        return fork_process(self._server, **kwargs)


def starter(device: str, want_fla: bool) -> Starter:
    """The Starter for a new pool: spawn for CUDA (a forked CUDA context is unusable, and the
    server must never touch CUDA) and where LINATTN_RANK_START=spawn; else a server, with fla
    preloaded if `want_fla` and it may be (see the module's docstring)."""
    if not _use_servers(device):
        return Starter(None, False)
    fla = want_fla and _fla_preload_allowed()
    return Starter(preloaded_server(FLA_PRELOAD if fla else BASE_PRELOAD), fla)


def preloaded_server(preload: tuple[str, ...], environ=None) -> forkserver.ForkServer:
    """This process's running server that has imported the modules `preload` (in this order) under
    the import-time environment of now; started if there is none. Stopped at exit. environ: the
    environment a server starts in, if not os.environ (and multiprocessing's resource tracker, if
    this starts it): its children set their own."""
    environ = os.environ if environ is None else environ
    with _lock:
        return _running_server(tuple(preload), environ, _import_env_key(environ))


def _import_env_key(environ) -> tuple:
    return tuple(sorted((k, v) for k, v in environ.items() if k.startswith(_IMPORT_ENV_PREFIXES)))


def _running_server(preload: tuple[str, ...], environ, env_key) -> forkserver.ForkServer:
    server = _servers.get((preload, env_key))
    if server is None:
        # forked from the longest stage it extends (started first), else cold
        stage = next((s for s in _STAGES if len(s) < len(preload) and preload[:len(s)] == s), None)
        server = _new_server(None if stage is None else _running_server(stage, environ, env_key))
        server.set_forkserver_preload(list(preload))
        _servers[(preload, env_key)] = server
    saved = None if environ is os.environ else dict(os.environ)
    if saved is not None:
        os.environ.clear()
        os.environ.update(environ)
    try:
        server.ensure_running()  # (re)started if it died; a new one preloads while the pool starts
    finally:
        if saved is not None:
            os.environ.clear()
            os.environ.update(saved)
    return server


def _new_server(stage: forkserver.ForkServer | None) -> forkserver.ForkServer:
    if stage is not None:
        return _ForkedServer(stage)
    parent = _parent_server()
    if os.environ.get(CHAIN_ENV) == "forked" and parent is not None:
        return _ForkedServer(parent)
    return forkserver.ForkServer()


def _parent_server() -> forkserver.ForkServer | None:
    """The server this process is a fork of (a warm python's program, a forked pytest run), or None."""
    address = forkserver._forkserver._forkserver_address  # set in a fork of a server
    if address is None:
        return None
    server = forkserver.ForkServer()
    server._forkserver_address = address
    server.ensure_running = lambda: None  # running: this process is a fork of it
    return server


def fla_stage_from_parent_server() -> bool:
    """In a process forked from a server that imported torch and fla (an xdist worker the suites
    start warm): this process's fla stage is a fork of that server instead of a cold interpreter
    importing them again. The torch stage stays cold: its ranks must not have fla imported. Whether
    this process's fla stage is such a fork."""
    parent = _parent_server()
    if parent is None or not _fla_preload_allowed():
        return False
    key = (FLA_ROOT_PRELOAD, _import_env_key(os.environ))
    with _lock:
        if key not in _servers:
            _servers[key] = _ForkedServer(parent)
            _servers[key].set_forkserver_preload(list(FLA_ROOT_PRELOAD))
        stage = _servers[key]
    return isinstance(stage, _ForkedServer) and stage._parent._forkserver_address == parent._forkserver_address


class _ForkedServer(forkserver.ForkServer):
    """A server forked by another: a stage of this process, or the server this process is itself a
    fork of (CHAIN_ENV=forked: a pytest run of suites/tools/inner_pytest.py); so it starts with that
    one's imports instead of cold. It is that server's child, not this process's: watched through
    the exit status that one sends. It exits when this process closes its "alive" pipe or dies, as
    a cold one does."""

    def __init__(self, parent: forkserver.ForkServer):
        super().__init__()
        self._parent = parent
        self._proc = None

    def ensure_running(self):
        self._parent.ensure_running()
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                return
            self._stop_unlocked()
            with socket.socket(socket.AF_UNIX) as listener:
                address = connection.arbitrary_address("AF_UNIX")
                listener.bind(address)
                if not util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                alive_r, alive_w = os.pipe()
                # what the fork takes as its parent's "alive" copy (and closes): not alive_w
                parent_alive = self._parent._forkserver_alive_fd
                self._parent._forkserver_alive_fd = alive_r
                try:
                    proc = fork_process(self._parent, target=_serve, name="linattn-rank-server", daemon=True,
                                        args=(_Fd(listener.fileno()), _Fd(alive_r), list(self._preload_modules),
                                              list(sys.path), dict(os.environ)))
                    proc.start()
                except BaseException:
                    os.close(alive_w)
                    raise
                finally:
                    os.close(alive_r)
                    self._parent._forkserver_alive_fd = parent_alive
            self._proc, self._forkserver_address = proc, address
            self._forkserver_alive_fd, self._forkserver_pid = alive_w, proc.pid

    def _stop_unlocked(self):
        if self._proc is None:
            return
        os.close(self._forkserver_alive_fd)  # the server's signal to exit
        self._proc.join()
        if not util.is_abstract_socket_namespace(self._forkserver_address):
            os.unlink(self._forkserver_address)
        self._proc = self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None


class _Fd:
    """An fd that goes to a forked process with it (duplicated while the process is pickled)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _serve(listener_fd: int, alive_r: int, preload: list, sys_path: list, environ: dict) -> None:
    """A forked server's body: multiprocessing's forkserver loop, in the caller's sys.path and
    environment, after importing what its parent server had not."""
    detach_from_server()
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(environ)
    forkserver.main(listener_fd, alive_r, preload)


def fork_process(server: forkserver.ForkServer, **kwargs) -> multiprocessing.Process:
    """A multiprocessing.Process (not started; Process's keyword arguments) that `server` forks."""
    proc = _ServerProcess(**kwargs)
    proc._linattn_server = server  # taken off before the process object is pickled
    return proc


def process_uses_fla() -> bool:
    """Whether this process has imported fla: its tests' functions probably import it on the
    ranks too, so new pools start with it."""
    return "fla" in sys.modules


def can_preload_fla(device: str) -> bool:
    """Whether a new pool on `device` would have fla imported in its ranks from the start."""
    return _use_servers(device) and _fla_preload_allowed()


def can_fork_from_servers(device: str) -> bool:
    """Whether processes on `device` may be forked from a preloaded server here (CPU, Linux, not
    LINATTN_RANK_START=spawn)."""
    return _use_servers(device)


def _use_servers(device: str) -> bool:
    return (device == "cpu" and os.environ.get("LINATTN_RANK_START") != "spawn"
            and sys.platform.startswith("linux") and reduction.HAVE_SEND_HANDLE)


def _fla_preload_allowed() -> bool:
    # Under fla_interpreted too: the server starts in this environment (TRITON_INTERPRET=1, part of
    # its key), so it defines fla's kernels interpreted, as a rank importing fla would; the rest of
    # the setup (Triton's patches, its self-check) acts when kernels run, and the rank applies it.
    try:
        from .gpus import gpu_count

        return gpu_count() == 0  # fla's import asks Triton for a GPU driver: none may start here
    except Exception:
        return False


def close_servers() -> None:
    """Stop every server of this process (their ranks die with them: close the pools first).
    Killed, not asked: a server's own exit tears down an interpreter holding torch and fla, a
    second or more each, and it has nothing to save."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        if server._forkserver_pid is not None:
            try:
                os.kill(server._forkserver_pid, signal.SIGKILL)
            except OSError:
                pass
    for server in servers:
        try:
            server._stop()  # closes its "alive" pipe, reaps it
        except Exception:
            pass


atexit.register(close_servers)  # pool.py's own atexit (closing the pools) runs before this one


def detach_from_server() -> None:
    """In a rank forked from a server: close the rank's copy of the server's "alive" pipe, so the
    server sees the test process's end (its own copy closing) and exits, taking the ranks along."""
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


class _ServerPopen(popen_forkserver.Popen):
    """popen_forkserver.Popen asking a given server rather than multiprocessing's global one."""

    def __init__(self, process_obj, server):
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj):  # popen_forkserver.Popen._launch, with self._server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _ServerProcess(ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _ServerPopen(process_obj, process_obj.__dict__.pop("_linattn_server"))
