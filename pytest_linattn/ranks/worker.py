"""The rank side of a pool (pytest_linattn.ranks.pool): what runs inside each spawned rank process,
and the two ends of what crosses its pipe.

A rank joins the pool's process group once, then answers calls until the parent sends an empty
message or goes away. A call is a message from `task_message`: ``fn`` and its arguments pickled
by reference (module + name); the parent's ``sys.path``, which the rank mirrors (pytest's import
modes edit it during collection); and the files of the modules they come from, so a rank can
load a module pytest imported outside ``sys.path`` (``--import-mode=importlib``). The answer is
(status, value or traceback, the parity records made on this rank, see `add_rank_records`).
As a call starts, the groups earlier calls made that nothing holds are destroyed
(`pytest_linattn.ranks.groups`): a test makes its groups in the function spawn runs.

faulthandler writes this rank's stack to its dump file on SIGUSR1 (a hang) and on a fatal signal;
`trim_stack` hides this module's frames in that dump, the parent reads it (reports).
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import datetime
import gc
import importlib
import importlib.util
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types

from .blocked import BlockedLook
from .groups import destroy_earlier_groups

__all__ = ["RANK_DEVICE_ENV", "add_rank_records", "rank_main", "set_parent_death_signal", "task_message", "to_cpu",
           "trim_stack"]

RANK_DEVICE_ENV = "LINATTN_RANK_DEVICE"  # cpu | cuda: where this rank computes (set by the pool and the launcher)
_PARENT_POLL = 0.5
_BLOCKED_LOOK = 0.1  # how often a rank looks whether its main thread is blocked


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


# ----------------------------------------------------------------------------------------------
# a call's message: written by the parent, read by a rank


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


def task_message(fn, args: tuple, kwargs: dict, fla_dtype, collectives=None) -> bytes:
    """What the parent sends every rank for one call of fn(*args, **kwargs). fla_dtype: None, or
    the fla modes to enter around fn (`linattn.emulation.active_modes()`); collectives: None, or
    the collective interception to enter around fn (`pytest_linattn.mutation.plan.active_message()`)."""
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
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            files[name] = path
    return pickle.dumps((list(sys.path), files, buf.getvalue(), fla_dtype, collectives),
                        protocol=pickle.HIGHEST_PROTOCOL)


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
# parity records: assert_parity called on a rank records there; the parent adds them to its own


def _take_parity_records() -> list:
    parity = sys.modules.get("pytest_linattn.parity.check")
    if parity is None or not parity.RECORDS:
        return []
    records = list(parity.RECORDS)
    parity.RECORDS.clear()
    return records


def add_rank_records(records: dict[int, list]) -> None:
    """In the parent: the records of each rank's reply (rank -> records) join parity.RECORDS."""
    try:
        from ..parity import check as parity
    except Exception:  # pragma: no cover - parity needs torch, which the ranks had
        return
    test = parity.current_test()
    for rank in sorted(records):
        for rec in records[rank]:
            # The rank's own idea of the test is stale (its environment dates from its start).
            rec["test"] = test
            rec["tensor"] = f"rank{rank}:{rec.get('tensor', '?')}"
            parity.RECORDS.append(rec)


# ----------------------------------------------------------------------------------------------
# one rank


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


class _CallWatch:
    """Tells the parent, once per call, that this rank's main thread is blocked in
    torch.distributed (pytest_linattn.ranks.blocked): once another rank has failed, the parent
    then stops waiting for this one. Its messages and the call's reply share `conn`: `lock`."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()
        self.in_call = self.told = False
        self.main = BlockedLook(threading.get_ident())

        def watch():  # (the name trim_stack leaves out of a rank's stack)
            while True:
                time.sleep(_BLOCKED_LOOK)
                where = self.main.look() if self.in_call and not self.told else None
                if where:
                    with self.lock:
                        if self.in_call:
                            self.conn.send_bytes(pickle.dumps(("blocked", where)))
                            self.told = True

        threading.Thread(target=watch, name="linattn-blocked-watch", daemon=True).start()

    def begin(self) -> None:
        self.main.forget()
        self.told, self.in_call = False, True

    def reply(self, out: bytes) -> None:
        with self.lock:
            self.in_call = False
            self.conn.send_bytes(out)


def _set_threads(torch) -> None:
    # OpenMP read OMP_NUM_THREADS when torch was imported: in a forked rank, in the server
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _sync_sys_path(paths: list[str]) -> None:
    if sys.path != paths:
        sys.path[:] = paths




def _take_collective_calls() -> list | None:
    # the calls pytest_linattn.mutation.rank recorded in this call, when it intercepted them
    rank = sys.modules.get("pytest_linattn.mutation.rank")
    return None if rank is None else rank.take_calls()


def _run_task(msg: bytes) -> tuple:
    status, value = _run_task_inner(msg)
    return status, value, _take_parity_records(), _take_collective_calls()


def _run_task_inner(msg: bytes) -> tuple:
    # BaseException: SystemExit too, a rank must always answer.
    try:
        destroy_earlier_groups()
        sys_path, files, payload, fla_dtype, collectives = pickle.loads(msg)
        _sync_sys_path(sys_path)
        fn, args, kwargs = _FileAwareUnpickler(io.BytesIO(payload), files).load()
        rank_context = contextlib.ExitStack()
        if fla_dtype is not None:  # linattn.emulation.active_modes() of the test process
            from linattn.emulation import modes_context

            rank_context.enter_context(modes_context(fla_dtype))
        if collectives is not None:  # --linattn-mutate-collectives: record, maybe mutate
            from ..mutation.rank import intercepting

            rank_context.enter_context(intercepting(collectives))
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


def rank_main(rank, world_size, device, backend, gpu, port, conn, parent_pid, use_pdeathsig, dump_path, env,
              sys_path, pg_timeout):
    """A rank's process (spawned, or forked from a preloaded server: pytest_linattn.ranks.servers):
    join the process group (`backend`: gloo, nccl, or staged for ranks sharing a GPU) through the
    parent's store on `port`, say "ready", then answer calls on `conn` until told to stop. `gpu`:
    this rank's GPU among the visible ones (cuda). `parent_pid`: the pid this process's parent
    has; `env`: the whole environment it runs in (a server's own dates from the server's start)."""
    from .servers import detach_from_server

    detach_from_server()
    os.environ.clear()
    os.environ.update(env)
    os.environ[RANK_DEVICE_ENV] = device
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
    from .. import compile_log

    compile_log.install()  # LINATTN_COMPILE_LOG: this rank's Triton compiles, for the suite's summary
    try:
        from .. import autotune

        # the test process's --linattn-autotune (env LINATTN_AUTOTUNE), before any kernel runs here
        autotune.apply_in_rank(device)
        import torch

        _set_threads(torch)
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        if device == "cuda":
            torch.cuda.set_device(gpu)
        if backend == "nccl":
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, device_id=torch.device("cuda", gpu))
        else:
            if backend == "staged":
                from .staged import register

                register()
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    # Everything alive now (torch, fla: imported here or in the server this rank is forked from)
    # stays: out of every later collection, which would scan it each time and, in a fork, copy
    # its pages by touching it.
    gc.freeze()
    conn.send(("ready", os.getpid()))
    call = _CallWatch(conn)
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not msg:  # empty message: shut down
            break
        call.begin()
        out = pickle.dumps(_run_task(msg), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            call.reply(out)
        except (EOFError, OSError):
            break
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    if os.environ.get(autotune.RECORDS_ENV):  # suites/bench/dump_fla_configs.py collects them
        autotune.write_rank_records(os.environ[autotune.RECORDS_ENV])


def trim_stack(dump: str) -> str:
    """A faulthandler dump of a rank without this module's machinery: the parent-watch thread
    and the frames below the call of fn."""
    blocks = []
    for block in dump.strip().split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("Extension modules:"):
            continue  # a fatal error's list of loaded C extensions
        if any(__file__ in ln and ln.endswith(" in watch") for ln in lines):
            continue
        for i, ln in enumerate(lines):
            if __file__ in ln and ln.endswith((" in _run_task_inner", " in _run_task",
                                                " in rank_main")):
                idle = ln.endswith(" in rank_main") and i == 1
                lines = lines[:i] + (["  (idle: waiting for the next call)"] if idle else [])
                break
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
