"""Persistent rank pools: run one function on N ranks with torch.distributed initialised.

Usable without pytest::

    from pytest_linattn.pool import PoolManager
    with PoolManager(device="cpu") as pools:
        results = pools.run(fn, 4, args=(x,), timeout=60)   # one value per rank, rank order

A pool is N processes started with the 'spawn' start method, each with its process group
initialised once (gloo on CPU, NCCL on GPU), kept per (world size, device) and reused by every
later call. Any failure (exception, death, timeout) kills and discards that pool; the next call
starts a fresh one, so a broken process group never leaks into another test.

Rendezvous goes through a TCPStore the parent binds to port 0 (the kernel picks a free port), so
parallel pytest processes (``pytest -n N``) never collide on a port.

``fn`` travels pickled by reference (module + name). The ranks mirror the parent's ``sys.path``
on every call (pytest's prepend/append import modes edit it during collection) and can load a
module from its file when it is not importable by name (``--import-mode=importlib``).

``assert_parity`` records made on a rank travel back with its reply and join the parent's
``parity.RECORDS`` (tensor named ``rank<r>:<name>``), so they appear in the run's summary.

Launcher mode (``run_in_launcher``): when the caller itself runs under torchrun, fn runs on the
existing process group and every rank gets every rank's return value; failures travel through
the launcher's store (pytest_linattn.launcher).
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import datetime
import importlib
import importlib.util
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import Any, Callable

from .gpus import GpuLease, NotEnoughGpus, gpu_count

__all__ = [
    "DEFAULT_TIMEOUT",
    "NotEnoughGpus",
    "Pool",
    "PoolManager",
    "RankFailure",
    "RankTimeout",
    "launcher_world_size",
    "resolve_device",
    "run_in_launcher",
    "to_cpu",
]

DEFAULT_TIMEOUT = 300.0
# After the first rank fails, the others get this long to report before they are killed: a rank
# blocked in a collective with a rank that raised would otherwise wait for the full timeout.
FAILURE_GRACE = 2.0
START_TIMEOUT = 120.0
_SHUTDOWN_WAIT = 5.0
_PARENT_POLL = 0.5


class RankFailure(Exception):
    """A distributed call failed on one or more ranks; the message holds every rank's story."""


class RankTimeout(RankFailure):
    """A distributed call ran past its timeout; the message holds every rank's Python stack."""


# ----------------------------------------------------------------------------------------------
# helpers shared by parent and ranks


def resolve_device(device: str) -> str:
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    return device


def _check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _check_timeout(timeout) -> float:
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}") from None
    if not value > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return value


def to_cpu(obj):
    """Tensors (also nested in lists, tuples, namedtuples and dicts) detached and moved to CPU."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        # Pickling a view sends its whole storage: copy small views of big buffers.
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        return t
    if isinstance(obj, dict):
        moved = {k: to_cpu(v) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        out = copy.copy(obj)  # keeps OrderedDict / defaultdict and their extras
        out.update(moved)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


class _RecordingPickler(pickle.Pickler):
    """Pickles as usual and notes the modules of every function and class it references."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: set[str] = set()

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)):
            mod = getattr(obj, "__module__", None)
            if mod:
                self.modules.add(mod)
        return NotImplemented


def _dumps_task(fn, args, kwargs) -> tuple[bytes, dict[str, str]]:
    buf = io.BytesIO()
    pickler = _RecordingPickler(buf)
    try:
        pickler.dump((fn, args, kwargs))
    except Exception as exc:
        raise ValueError(
            f"fn and its arguments must be picklable by reference (fn a module-level function, "
            f"not a lambda or a nested function): {type(exc).__name__}: {exc}") from exc
    files = {}
    for name in pickler.modules:
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if path:
            files[name] = path
    return buf.getvalue(), files


class _FileAwareUnpickler(pickle.Unpickler):
    """Imports by name as usual; falls back to the parent's file for modules pytest imported
    outside sys.path (importlib import mode)."""

    def __init__(self, file, files: dict[str, str]):
        super().__init__(file)
        self.files = files

    def find_class(self, module, name):
        if module not in sys.modules:
            try:
                importlib.import_module(module)
            except ImportError:
                path = self.files.get(module)
                if path is None:
                    raise
                spec = importlib.util.spec_from_file_location(module, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[module] = mod
                try:
                    spec.loader.exec_module(mod)
                except BaseException:
                    del sys.modules[module]
                    raise
        obj = sys.modules[module]
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj


# ----------------------------------------------------------------------------------------------
# the rank side


def set_parent_death_signal(sig: int) -> None:
    """PR_SET_PDEATHSIG: the kernel sends `sig` to this process when its parent dies (even by
    SIGKILL). Linux only, best effort. It tracks the parent *thread*."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except Exception:
            pass


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    # Killed with the parent; as PR_SET_PDEATHSIG tracks the parent thread, it is only set when
    # the pool was started from the main thread; the polling thread covers every other case
    # (and non-Linux).
    if use_pdeathsig:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch():
        while True:
            time.sleep(_PARENT_POLL)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="linattn-parent-watch", daemon=True).start()


def _sync_sys_path(paths: list[str]) -> None:
    if sys.path != paths:
        sys.path[:] = paths


def _take_parity_records() -> list:
    # assert_parity called on a rank records there; the parent adds them to its own summary.
    parity = sys.modules.get("pytest_linattn.parity")
    if parity is None or not parity.RECORDS:
        return []
    records = list(parity.RECORDS)
    parity.RECORDS.clear()
    return records


def _run_task(msg: bytes) -> tuple:
    status, value = _run_task_inner(msg)
    return status, value, _take_parity_records()


def _run_task_inner(msg: bytes) -> tuple:
    # BaseException: SystemExit too, a rank must always answer.
    try:
        sys_path, files, payload, fla_dtype = pickle.loads(msg)
        _sync_sys_path(sys_path)
        fn, args, kwargs = _FileAwareUnpickler(io.BytesIO(payload), files).load()
        rank_context = contextlib.nullcontext()
        if fla_dtype is not None:
            from linattn.emulation import fla_on_cpu

            rank_context = fla_on_cpu(fla_dtype)
    except BaseException:
        return ("error", "could not load the function on this rank:\n" + traceback.format_exc())
    try:
        with rank_context:
            result = fn(*args, **kwargs)
    except BaseException as exc:
        # tb_next: start at fn, not at this frame.
        return ("error", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)))
    try:
        result = to_cpu(result)
        pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        return ("error", "could not send the return value back:\n" + traceback.format_exc())
    return ("ok", result)


def _worker_main(rank, world_size, device, port, conn, parent_pid, use_pdeathsig, dump_path, env,
                 sys_path, pg_timeout):
    os.environ.update(env)
    # Ctrl-C reaches the whole process group: the parent handles it and shuts the ranks down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid, use_pdeathsig)
    dump_file = open(dump_path, "w")
    # The parent sends SIGUSR1 to collect every rank's stack when a call hangs.
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True, chain=False)
    # SIGSEGV, SIGABRT, ...: the stack goes to the same file, so the parent can show it.
    faulthandler.enable(file=dump_file, all_threads=True)
    _sync_sys_path(sys_path)
    try:
        from . import autotune

        # the test process's --linattn-autotune (env LINATTN_AUTOTUNE), before any kernel runs here
        autotune.apply_in_rank(device)
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        if device == "cuda":
            torch.cuda.set_device(rank)
            backend = "nccl"
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not msg:  # empty message: shut down
            break
        out = pickle.dumps(_run_task(msg), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            conn.send_bytes(out)
        except (EOFError, OSError):
            break
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    if os.environ.get(autotune.RECORDS_ENV):  # suites/bench/dump_fla_configs.py collects them
        autotune.write_rank_records(os.environ[autotune.RECORDS_ENV])


# ----------------------------------------------------------------------------------------------
# the parent side


def _exit_story(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"died with signal {signal.Signals(-code).name}"
        except ValueError:
            return f"died with signal {-code}"
    return f"died with exit code {code}"


def _forward_parity_records(records: dict[int, list]) -> None:
    try:
        from . import parity
    except Exception:  # pragma: no cover - parity needs torch, which the ranks had
        return
    test = parity.current_test()
    for rank in sorted(records):
        for rec in records[rank]:
            # The rank's own idea of the test is stale (its environment dates from its start).
            rec["test"] = test
            rec["tensor"] = f"rank{rank}:{rec.get('tensor', '?')}"
            parity.RECORDS.append(rec)


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip().splitlines(True)) + "\n"


class Pool:
    """world_size ranks of one device with an initialised process group, reusable until broken."""

    def __init__(self, world_size: int, device: str = "cpu", *, timeout: float = DEFAULT_TIMEOUT,
                 gpu_ids: list[str] | None = None, env: dict[str, str] | None = None):
        self.world_size = _check_world_size(world_size)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        self.broken = False
        self._closed = False
        self._tmpdir = tempfile.mkdtemp(prefix="linattn-pool-")
        self._dump_paths = [os.path.join(self._tmpdir, f"rank{r}.stack") for r in range(world_size)]
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        try:
            self._start(timeout, gpu_ids, env or {})
        except BaseException:
            self.kill()
            raise

    # -- lifecycle

    def _start(self, timeout: float, gpu_ids, extra_env) -> None:
        import torch.distributed as dist

        timeout = _check_timeout(timeout)
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout))
        env = dict(extra_env)
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids or [])
        if (self.device == "cpu" and "GLOO_SOCKET_IFNAME" not in os.environ
                and os.path.exists("/sys/class/net/lo")):
            # All ranks share this host: loopback always works, while the hostname may resolve
            # to an address gloo cannot bind in a container.
            env["GLOO_SOCKET_IFNAME"] = "lo"
        if self.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # N ranks on a shared CPU: one thread each unless told otherwise, to avoid thrashing.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.world_size))
        ctx = multiprocessing.get_context("spawn")
        main_thread = threading.current_thread() is threading.main_thread()
        # The collective timeout is a backstop only: the parent enforces the real one.
        pg_timeout = max(timeout, 1800.0)
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main, name=f"linattn-rank{rank}", daemon=True,
                args=(rank, self.world_size, self.device, self._store.port, child_conn, os.getpid(),
                      main_thread, self._dump_paths[rank], env, list(sys.path), pg_timeout))
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        # Starting is not the call being timed: a cold start takes seconds on a busy machine.
        replies = self._collect(max(timeout, START_TIMEOUT), what="starting the pool")
        for reply in replies:
            if reply[0] != "ready":  # pragma: no cover - _collect raises on errors
                raise RankFailure(f"unexpected reply while starting: {reply!r}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def alive(self) -> bool:
        return not self.broken and not self._closed and all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        """Kill every rank now and free the pool's resources."""
        self.broken = True
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            if p.pid is not None:
                p.join(_SHUTDOWN_WAIT)
        self._release()

    def close(self) -> None:
        """Ask the ranks to exit (they destroy their process groups), kill any that do not."""
        if self._closed:
            return
        if not self.broken:
            for conn in self.conns:
                try:
                    conn.send_bytes(b"")
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + _SHUTDOWN_WAIT
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        self._store = None
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # -- calls

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float = DEFAULT_TIMEOUT, fla_on_cpu=None) -> list[Any]:
        """fn(*args, **kwargs) on every rank; the return values in rank order, on CPU.

        fla_on_cpu: None, or the compute dtype of `linattn.emulation.fla_on_cpu`, active on
        every rank around fn. Raises RankFailure (RankTimeout on a hang) and breaks the pool on
        any failure.
        """
        timeout = _check_timeout(timeout)
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        if not self.alive():
            raise RuntimeError("this pool is broken or closed; start a new one")
        payload, files = _dumps_task(fn, tuple(args), dict(kwargs or {}))
        msg = pickle.dumps((list(sys.path), files, payload, fla_on_cpu), protocol=pickle.HIGHEST_PROTOCOL)
        name = getattr(fn, "__qualname__", repr(fn))
        self._dump_offsets = self._dump_sizes()
        try:
            for conn in self.conns:
                conn.send_bytes(msg)
        except (OSError, ValueError):
            pass  # a dead rank: _collect reports it
        try:
            replies = self._collect(timeout, what=f"{name}(...) on {self.world_size} ranks")
        except BaseException:
            self.kill()
            raise
        return [r[1] for r in replies]

    def _collect(self, timeout: float, what: str) -> list:
        """One reply per rank; on any failure kills the pool and raises with every rank's story."""
        start = time.monotonic()
        deadline = start + timeout
        replies: dict[int, tuple] = {}
        records: dict[int, list] = {}
        errors: dict[int, str] = {}
        deaths: dict[int, int | None] = {}
        failed_at = None
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            waitables = {}
            for r in pending:
                waitables[self.conns[r]] = r
                waitables[self.procs[r].sentinel] = r
            ready = multiprocessing.connection.wait(list(waitables), deadline - now)
            for r in sorted({waitables[w] for w in ready}):
                if r not in pending:
                    continue
                conn = self.conns[r]
                reply = None
                eof = False
                try:
                    if conn.poll():
                        reply = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    eof = True
                except Exception:
                    reply = ("error", "the parent could not unpickle this rank's return value:\n"
                             + traceback.format_exc())
                if reply is None:
                    if self.procs[r].is_alive() and not eof:
                        continue  # spurious wakeup
                    self.procs[r].join(2.0)  # a closed pipe means the rank is going away
                    deaths[r] = self.procs[r].exitcode
                    pending.discard(r)
                    continue
                pending.discard(r)
                if len(reply) > 2 and reply[2]:
                    records[r] = reply[2]
                if reply[0] == "error":
                    errors[r] = reply[1]
                else:
                    replies[r] = reply
            if (errors or deaths) and failed_at is None:
                failed_at = time.monotonic()
                deadline = min(deadline, failed_at + FAILURE_GRACE)
        if records:
            _forward_parity_records(records)
        if not pending and not errors and not deaths:
            return [replies[r] for r in range(self.world_size)]
        self.broken = True
        stacks = self._dump_stacks(sorted(set(range(self.world_size)) - set(deaths)))
        fatal = {r: self._fatal_dump(r) for r in deaths}  # before kill() removes the files
        self.kill()
        lines = []
        timed_out = not errors and not deaths
        if timed_out:
            lines.append(f"{what}: timed out after {timeout:g} s; {_ranks(pending)} had not "
                         f"returned. "
                         f"Every rank's Python stack follows; the ranks were killed.")
        elif deaths:
            # The death first: the survivors' errors (a closed connection) are its consequence.
            lines.append(f"{what}: " + "; ".join(f"rank {r} {_exit_story(deaths[r])}"
                                                 for r in sorted(deaths))
                         + (f"; {_ranks(errors)} raised after that." if errors else "."))
        else:
            lines.append(f"{what}: {_ranks(errors)} failed.")
        for r in sorted(deaths):
            lines.append(f"--- rank {r} {_exit_story(deaths[r])} (pid {self.procs[r].pid})")
            if fatal[r]:
                lines.append(_indent(fatal[r]))
        for r in sorted(errors):
            lines.append(f"--- rank {r} raised:")
            lines.append(_indent(errors[r]))
        if pending and not timed_out:
            lines.append(f"{_ranks(pending)} had not returned "
                         f"{FAILURE_GRACE:g} s after the failure and were killed; their stacks:")
        for r in range(self.world_size):
            if r in stacks and (timed_out or r in pending):
                state = "still running" if r in pending else "had returned"
                lines.append(f"--- rank {r} stack ({state}, pid {self.procs[r].pid}):")
                lines.append(_indent(stacks[r] or "(no stack dumped)"))
        cls = RankTimeout if timed_out else RankFailure
        raise cls("\n".join(lines))

    def _dump_sizes(self) -> list[int]:
        sizes = []
        for path in self._dump_paths:
            try:
                sizes.append(os.path.getsize(path))
            except OSError:
                sizes.append(0)
        return sizes

    def _fatal_dump(self, rank: int) -> str:
        """What faulthandler wrote for a rank killed by a fatal signal during this call."""
        offsets = getattr(self, "_dump_offsets", None) or [0] * self.world_size
        try:
            with open(self._dump_paths[rank], errors="replace") as f:
                f.seek(offsets[rank])
                return _trim_stack(f.read())
        except OSError:
            return ""

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every listed live rank's Python stack, via faulthandler on SIGUSR1."""
        sizes = {}
        for r in ranks:
            p = self.procs[r]
            if p.pid is None or not p.is_alive():
                continue
            try:
                sizes[r] = os.path.getsize(self._dump_paths[r])
                os.kill(p.pid, signal.SIGUSR1)
            except (OSError, ProcessLookupError):
                continue
        # faulthandler writes from its signal handler: wait until every file has grown and settled.
        out: dict[int, str] = {}
        deadline = time.monotonic() + 2.0
        last = dict(sizes)
        while sizes and time.monotonic() < deadline:
            time.sleep(0.05)
            now = {r: os.path.getsize(self._dump_paths[r]) for r in sizes}
            if all(now[r] > sizes[r] and now[r] == last[r] for r in sizes):
                break
            last = now
        for r, size in sizes.items():
            try:
                with open(self._dump_paths[r], errors="replace") as f:
                    f.seek(size)
                    out[r] = _trim_stack(f.read())
            except OSError:
                out[r] = ""
        return out


def _trim_stack(dump: str) -> str:
    """A faulthandler dump without the pool's own machinery: the parent-watch thread and the
    frames below the call of fn."""
    blocks = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("Extension modules:"):
            continue  # a fatal error's list of loaded C extensions
        if any(__file__ in ln and ln.endswith(" in watch") for ln in lines):
            continue
        for i, ln in enumerate(lines):
            if __file__ in ln and ln.endswith((" in _run_task_inner", " in _run_task",
                                                " in _worker_main")):
                idle = ln.endswith(" in _worker_main") and i == 1
                lines = lines[:i] + (["  (idle: waiting for the next call)"] if idle else [])
                break
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


class PoolManager:
    """Keeps one Pool per (world size, device); replaces broken ones; closes all on close().

    On CUDA each pool leases whole GPUs through file locks (see gpus.py), so parallel pytest
    processes on one machine never share a GPU.
    """

    def __init__(self, device: str = "cpu", *, lock_dir: str | None = None,
                 lease_timeout: float = 600.0):
        self.device = resolve_device(device)
        self.lock_dir = lock_dir
        self.lease_timeout = lease_timeout
        self._pools: dict[int, Pool] = {}
        self._leases: dict[int, GpuLease] = {}
        _LIVE.add(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def pids(self) -> list[int]:
        return [pid for pool in self._pools.values() for pid in pool.pids]

    def pool(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT) -> Pool:
        world_size = _check_world_size(world_size)
        pool = self._pools.get(world_size)
        if pool is not None and pool.alive():
            return pool
        self._discard(world_size)
        gpu_ids = None
        if self.device == "cuda":
            lease = GpuLease(world_size, lock_dir=self.lock_dir)
            # Our own idle pools hold GPUs too: free them rather than wait on ourselves.
            lease.acquire(timeout=self.lease_timeout, on_wait=self._free_gpus)
            self._leases[world_size] = lease
            gpu_ids = lease.ids
        try:
            pool = Pool(world_size, self.device, timeout=timeout, gpu_ids=gpu_ids)
        except BaseException:
            self._discard(world_size)
            raise
        self._pools[world_size] = pool
        return pool

    def run(self, fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float = DEFAULT_TIMEOUT, fla_on_cpu=None) -> list[Any]:
        pool = self.pool(world_size, timeout=timeout)
        try:
            return pool.run(fn, args, kwargs, timeout=timeout, fla_on_cpu=fla_on_cpu)
        finally:
            if not pool.alive():
                self._discard(world_size)

    def _free_gpus(self) -> None:
        for ws in list(self._pools):
            self._discard(ws)

    def _discard(self, world_size: int) -> None:
        pool = self._pools.pop(world_size, None)
        if pool is not None:
            pool.close()
        lease = self._leases.pop(world_size, None)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        for ws in list(self._pools) + list(self._leases):
            self._discard(ws)
        _LIVE.discard(self)


_LIVE: set[PoolManager] = set()


@atexit.register
def _close_all() -> None:
    # Safety net for callers that forget close(); daemon ranks also die with multiprocessing.
    for manager in list(_LIVE):
        manager.close()


# ----------------------------------------------------------------------------------------------
# launcher mode (pytest itself under torchrun)


def launcher_world_size(environ=None) -> int | None:
    """WORLD_SIZE when this process was started by a launcher (torchrun), else None."""
    from .launcher import launcher_world_size as world_size

    return world_size(environ)


_LAUNCHER_SESSION = None


def run_in_launcher(fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    *, device: str = "cpu", timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """fn on the launcher's existing process group; every rank gets all ranks' values in order.
    Failures are reported through a side channel (see pytest_linattn.launcher)."""
    global _LAUNCHER_SESSION
    from .launcher import LauncherSession, launcher_rank

    if _LAUNCHER_SESSION is None:
        _LAUNCHER_SESSION = LauncherSession(launcher_rank(), launcher_world_size() or world_size)
    return _LAUNCHER_SESSION.run(fn, world_size, args, kwargs, device=device, timeout=timeout)
