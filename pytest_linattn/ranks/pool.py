"""Persistent rank pools: run one function on N ranks with torch.distributed initialised.

Usable without pytest::

    from pytest_linattn.ranks.pool import PoolManager
    with PoolManager(device="cpu") as pools:
        results = pools.run(fn, 4, args=(x,), timeout=60)   # one value per rank, rank order

A pool is N processes, each with its process group initialised once (gloo on CPU, NCCL on GPU),
kept per (world size, device) and reused by every later call. CPU ranks are forked from a server
that has imported torch (and fla, once the session uses it) already, CUDA ranks spawned
(pytest_linattn.ranks.servers). Any failure (exception, death, timeout) kills and discards that
pool; the next call starts a fresh one, so a broken process group never leaks into another test.

Rendezvous goes through a TCPStore the parent binds to port 0 (the kernel picks a free port), so
parallel pytest processes (``pytest -n N``) never collide on a port.

The parent's side; the ranks run pytest_linattn.ranks.worker, a failure's report comes from
pytest_linattn.ranks.reports. ``assert_parity`` records made on a rank join the parent's
``parity.RECORDS`` (tensor named ``rank<r>:<name>``), so they appear in the run's summary.

Where a call runs (torchrun's world or a pool): `pytest_linattn.ranks.dispatch`.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable

from . import reports, servers
from .gpus import GpuLease, NotEnoughGpus, gpu_count, gpus_for, rank_gpus, sharing_note
from ..options import DEFAULT_TIMEOUT, DEVICES, parse_device, parse_timeout
from .replies import gather_replies
from .reports import FAILURE_GRACE, RankFailure, RankTimeout
from .worker import add_rank_records, rank_main, task_message, to_cpu

__all__ = ["DEFAULT_TIMEOUT", "NotEnoughGpus", "Pool", "PoolManager", "RankFailure", "RankTimeout",
           "resolve_device", "to_cpu"]

START_TIMEOUT = 120.0
_SHUTDOWN_WAIT = 5.0
_POOL_DEVICES = tuple(d for d in DEVICES if d != "auto")
_TMP_PREFIX = "linattn-pool-"


def resolve_device(device: str) -> str:
    """cpu or cuda; auto: cuda when a GPU is visible."""
    device = parse_device(device)
    if device == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    return device


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def thread_share(processes: int) -> int:
    """CPU threads for each of `processes` processes sharing this machine (a pool's ranks, xdist's
    workers), unless OMP_NUM_THREADS says otherwise: more OpenMP threads than cores spin and
    thrash, and slow every process (gpu-1's four xdist workers on 16 cores: their tests' summed
    time was 454 s with torch's 16 threads each, 135 s with 4; 2026-12-01, nvidia-h200)."""
    return max(1, (os.cpu_count() or 1) // max(1, processes))


def xdist_thread_share(per_worker: int, environ=os.environ) -> int:
    """Threads for each of `per_worker` processes in every xdist worker (PYTEST_XDIST_WORKER_COUNT,
    set in each worker before its config; 1 without xdist): a worker itself (per_worker 1), or
    each rank of a CPU pool (per_worker = world_size), every pool of every worker at once."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return thread_share(per_worker * workers)


def _make_tmpdir() -> str:
    """A new pool's directory (its ranks' stack files), named after this process, made after
    removing those of pools whose process is gone: a process killed outright (SIGKILL: no atexit,
    and its ranks die with it) leaves its pools' directories behind."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        owner = name[len(_TMP_PREFIX):].split("-", 1)[0] if name.startswith(_TMP_PREFIX) else ""
        if owner.isdigit() and not _process_exists(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Pool:
    """world_size ranks of one device with an initialised process group, reusable until broken."""

    def __init__(self, world_size: int, device: str = "cpu", *, timeout: float = DEFAULT_TIMEOUT,
                 gpu_ids: list[str] | None = None, fla: bool = False, ranks_per_gpu: int = 1,
                 backend: str | None = None):
        """gpu_ids: the GPUs of a cuda pool (CUDA_VISIBLE_DEVICES of its ranks), up to
        `ranks_per_gpu` ranks on each. backend: the process group's; by default gloo on cpu,
        nccl on cuda, and the staged transport (pytest_linattn.ranks.staged) where ranks share a
        GPU; "staged" on cpu runs that transport over CPU tensors."""
        self.world_size = check_world_size(world_size)
        if device not in _POOL_DEVICES:
            raise ValueError(f"device must be one of {', '.join(_POOL_DEVICES)}, got {device!r}")
        self.device = device
        self.rank_gpus = rank_gpus(world_size, ranks_per_gpu) if device == "cuda" else [None] * world_size
        gpus = len(set(self.rank_gpus))
        if device == "cuda" and len(gpu_ids or []) < gpus:
            raise ValueError(f"{world_size} ranks at {ranks_per_gpu} per GPU need {gpus} GPU ids, got {gpu_ids!r}")
        own_gpus = device == "cuda" and gpus == world_size
        allowed = ("gloo", "staged") if device == "cpu" else ("nccl", "staged") if own_gpus else ("staged",)
        backend = backend or allowed[0]
        if backend not in allowed:
            raise ValueError(f"backend must be one of {', '.join(allowed)} for {world_size} {device} ranks"
                             + (f" on {gpus} GPU(s) (NCCL needs a GPU per rank)" if device == "cuda" else "")
                             + f", got {backend!r}")
        self.backend = backend
        # what every report of this pool says of its transport, when it is not the usual one
        self.transport_note = (sharing_note(world_size, gpus) if device == "cuda"
                               else "collectives staged through gloo" if backend == "staged" else None)
        self.broken = False
        self._closed = False
        self._tmpdir = _make_tmpdir()
        # faulthandler's output of every rank (worker), read by reports
        self._dump_paths = [os.path.join(self._tmpdir, f"rank{r}.stack") for r in range(world_size)]
        self._dump_offsets = [0] * world_size  # where the current call's output begins
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        try:
            # fla: the ranks should have fla imported (a server that preloads it, where one may)
            self.starter = servers.starter(device, fla)
            self.fla = self.starter.fla
            self._start(timeout, gpu_ids)
        except BaseException:
            self.kill()
            raise

    # -- lifecycle

    def _start(self, timeout: float, gpu_ids) -> None:
        import torch.distributed as dist

        timeout = parse_timeout(timeout)
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout))
        env = dict(os.environ)  # the rank's whole environment: a server's is from its own start
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids or [])
        if (self.backend != "nccl" and "GLOO_SOCKET_IFNAME" not in os.environ
                and os.path.exists("/sys/class/net/lo")):
            # All ranks share this host: loopback always works, while the hostname may resolve
            # to an address gloo cannot bind in a container.
            env["GLOO_SOCKET_IFNAME"] = "lo"
        if self.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(xdist_thread_share(self.world_size))
        start = self.starter
        # The collective timeout is a backstop only: the parent enforces the real one.
        pg_timeout = max(timeout, 1800.0)
        for rank in range(self.world_size):
            parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
            proc = start.process(
                target=rank_main, name=f"linattn-rank{rank}", daemon=True,
                args=(rank, self.world_size, self.device, self.backend, self.rank_gpus[rank], self._store.port,
                      child_conn, start.parent_pid,
                      start.pdeathsig, self._dump_paths[rank], env, list(sys.path), pg_timeout))
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        # Starting is not the call being timed: a cold start takes seconds on a busy machine.
        replies = self._collect(max(timeout, START_TIMEOUT), what="starting the pool")
        for reply in replies:
            if reply[0] != "ready":  # pragma: no cover - _collect raises on errors
                raise RankFailure(f"unexpected reply while starting: {reply!r}")

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
            timeout: float = DEFAULT_TIMEOUT, fla_on_cpu=None, collectives=None) -> list[Any]:
        """fn(*args, **kwargs) on every rank; the return values in rank order, on CPU.

        fla_on_cpu: None, or the fla modes (`linattn.emulation.active_modes()`: fla's ops
        emulated, fla's kernels interpreted) entered on every rank around fn. collectives: None, or
        the collective interception of pytest_linattn.mutation (its calls go back to
        `mutation.plan.calls_returned`). Raises RankFailure
        (RankTimeout on a hang) and breaks the pool on any failure.
        """
        timeout = parse_timeout(timeout)
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        if not self.alive():
            raise RuntimeError("this pool is broken or closed; start a new one")
        msg = task_message(fn, tuple(args), dict(kwargs or {}), fla_on_cpu, collectives)
        self._dump_offsets = reports.dump_sizes(self._dump_paths)
        try:
            for conn in self.conns:
                conn.send_bytes(msg)
        except (OSError, ValueError):
            pass  # a dead rank: _collect reports it
        try:
            what = reports.call_name(fn, self.world_size)
            if self.transport_note:
                what += f" ({self.transport_note})"
            replies = self._collect(timeout, what=what)
        except BaseException:
            self.kill()
            raise
        return [r[1] for r in replies]

    def _collect(self, timeout: float, what: str) -> list:
        """One reply per rank; on any failure kills the pool and raises with every rank's story."""
        got = gather_replies(self.procs, self.conns, timeout, grace=FAILURE_GRACE)
        if got.records:
            add_rank_records(got.records)
        if got.calls:
            from ..mutation.plan import calls_returned

            calls_returned(got.calls)
        if got.complete:
            return [got.values[r] for r in range(self.world_size)]
        self.broken = True
        live = {r: p for r, p in enumerate(self.procs) if r not in got.deaths}
        stacks = reports.dump_stacks(live, self._dump_paths)
        # before kill() removes the files
        fatal = {r: reports.read_dump(self._dump_paths[r], self._dump_offsets[r]) for r in got.deaths}
        self.kill()
        raise reports.pool_failure(what, timeout, self.world_size, [p.pid for p in self.procs],
                                   pending=got.pending, errors=got.errors, deaths=got.deaths, fatal=fatal,
                                   stacks=stacks, blocked=got.blocked)


class PoolManager:
    """Keeps one Pool per (world size, device); replaces broken ones; closes all on close().

    On CUDA each pool leases whole GPUs through file locks (see gpus.py), so parallel pytest
    processes on one machine never share a GPU.
    """

    def __init__(self, device: str = "cpu", *, lock_dir: str | None = None,
                 lease_timeout: float = 600.0, ranks_per_gpu: int = 1):
        self.device = resolve_device(device)
        self.ranks_per_gpu = ranks_per_gpu  # on cuda: up to this many ranks share a GPU
        self.lock_dir = lock_dir
        self.lease_timeout = lease_timeout
        self._pools: dict[int, Pool] = {}
        self._leases: dict[int, GpuLease] = {}
        _LIVE.add(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def pool(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT, fla: bool = False) -> Pool:
        """The live pool of world_size ranks, else a new one. fla: the call runs fla's ops
        emulated, so a pool whose ranks have no fla preloaded is replaced by one that has (forking
        one costs less than importing fla on every rank); new pools preload fla once this process
        has imported it."""
        world_size = check_world_size(world_size)
        pool = self._pools.get(world_size)
        if pool is not None and pool.alive() and (pool.fla or not fla
                                                  or not servers.can_preload_fla(self.device)):
            return pool
        self._discard(world_size)
        gpu_ids = None
        if self.device == "cuda":
            lease = GpuLease(gpus_for(world_size, self.ranks_per_gpu), lock_dir=self.lock_dir)
            # Our own idle pools hold GPUs too: free them rather than wait on ourselves.
            try:
                lease.acquire(timeout=self.lease_timeout, on_wait=self._free_gpus)
            except NotEnoughGpus as exc:
                shared = f" at {self.ranks_per_gpu} ranks per GPU" if self.ranks_per_gpu > 1 else ""
                raise NotEnoughGpus(f"{world_size} ranks{shared}: {exc} (--linattn-ranks-per-gpu N lets up "
                                    f"to N ranks share a GPU)") from None
            self._leases[world_size] = lease
            gpu_ids = lease.ids
        try:
            pool = Pool(world_size, self.device, timeout=timeout, gpu_ids=gpu_ids,
                        fla=fla or servers.process_uses_fla(), ranks_per_gpu=self.ranks_per_gpu)
        except BaseException:
            self._discard(world_size)
            raise
        self._pools[world_size] = pool
        return pool

    def run(self, fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float = DEFAULT_TIMEOUT, fla_on_cpu=None, collectives=None) -> list[Any]:
        pool = self.pool(world_size, timeout=timeout, fla=fla_on_cpu is not None)
        try:
            return pool.run(fn, args, kwargs, timeout=timeout, fla_on_cpu=fla_on_cpu, collectives=collectives)
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
