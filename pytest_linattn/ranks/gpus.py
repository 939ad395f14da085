"""GPU leasing: whole GPUs per process through file locks, so parallel pytest workers never share one.

Every process on the machine (pytest-xdist workers, separate pytest runs) that leases GPUs takes
one lock file per GPU under a shared directory (``$PYTEST_LINATTN_LOCK_DIR`` or
``<tmp>/pytest-linattn-gpu-locks``). A lease of n GPUs holds n of those locks until release();
the ranks then see only those GPUs through CUDA_VISIBLE_DEVICES.
"""
from __future__ import annotations

import ctypes
import os
import random
import re
import sys
import tempfile
import time
from typing import Callable

__all__ = ["GpuLease", "NotEnoughGpus", "default_lock_dir", "gpu_count", "gpus_for", "rank_gpus", "sharing_note",
           "visible_gpu_ids"]


class NotEnoughGpus(Exception):
    """The machine (or the run's device choice) has fewer GPUs than asked for."""


def gpus_for(ranks: int, ranks_per_gpu: int = 1) -> int:
    """The GPUs `ranks` ranks run on when up to `ranks_per_gpu` share one: ceil(ranks / ranks_per_gpu)."""
    return -(-ranks // ranks_per_gpu)


def rank_gpus(ranks: int, ranks_per_gpu: int = 1) -> list[int]:
    """Each rank's GPU among the `gpus_for(ranks, ranks_per_gpu)` it runs on: consecutive ranks
    share (ranks 0..n-1 the first), as tensor-parallel neighbours would share a node."""
    return [rank // ranks_per_gpu for rank in range(ranks)]


def sharing_note(ranks: int, gpus: int) -> str | None:
    """What a header or a report says of ranks sharing GPUs (the staged transport); None if they do not."""
    if gpus >= ranks:
        return None
    return (f"{ranks} ranks on {gpus} GPU{'s' * (gpus > 1)}, collectives staged through gloo, not NCCL")


def visible_gpu_ids() -> list[str]:
    """The GPUs this process may use, as the ids CUDA_VISIBLE_DEVICES takes."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [x.strip() for x in env.split(",") if x.strip()]
        # CUDA stops at the first invalid entry ("-1" hides every GPU).
        out = []
        for x in ids:
            if x.startswith("-"):
                break
            out.append(x)
        return out
    return [str(i) for i in range(_torch_device_count())]


def _gpu_driver_present() -> bool:
    """Whether a GPU driver torch could count devices with is on this machine. torch reaches
    NVIDIA GPUs through the CUDA driver library and AMD ones through ROCm's kernel driver; on a
    Linux machine with neither the count is 0, so there is no need to import torch (seconds) to
    learn it. Elsewhere, or once torch is imported, torch answers."""
    if not sys.platform.startswith("linux") or "torch" in sys.modules:
        return True
    if os.path.exists("/dev/kfd"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _torch_device_count() -> int:
    if not _gpu_driver_present():
        return 0
    try:
        import torch
    except ImportError:
        return 0
    try:
        # NVML-based count where available: does not create a CUDA context in this process.
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def gpu_count() -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return _torch_device_count()
    visible = visible_gpu_ids()
    return min(len(visible), _torch_device_count()) if visible else 0


def default_lock_dir() -> str:
    return os.environ.get("PYTEST_LINATTN_LOCK_DIR") or os.path.join(
        tempfile.gettempdir(), "pytest-linattn-gpu-locks")


class GpuLease:
    """n whole GPUs held through file locks until release()."""

    def __init__(self, n: int, *, lock_dir: str | None = None, gpu_ids: list[str] | None = None):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        self.n = n
        self.lock_dir = lock_dir or default_lock_dir()
        self.candidates = list(gpu_ids) if gpu_ids is not None else visible_gpu_ids()
        self.ids: list[str] = []
        self._locks: list = []

    def _lock_path(self, gpu_id: str) -> str:
        return os.path.join(self.lock_dir, "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", gpu_id) + ".lock")

    def try_acquire(self) -> bool:
        """Take n free GPUs now or none at all."""
        from filelock import FileLock, Timeout

        os.makedirs(self.lock_dir, exist_ok=True)
        got = []
        for gpu in self.candidates:
            lock = FileLock(self._lock_path(gpu))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            got.append((gpu, lock))
            if len(got) == self.n:
                break
        if len(got) < self.n:
            for _, lock in got:
                lock.release()
            return False
        self.ids = [g for g, _ in got]
        self._locks = [lk for _, lk in got]
        return True

    def acquire(self, timeout: float = 600.0, on_wait: Callable[[], None] | None = None) -> list[str]:
        if self.n > len(self.candidates):
            raise NotEnoughGpus(f"needs {self.n} GPUs, this machine has {len(self.candidates)}")
        deadline = time.monotonic() + timeout
        delay = 0.05
        waited = False
        while not self.try_acquire():
            if not waited and on_wait is not None:
                on_wait()  # e.g. free our own idle pools' GPUs, then retry at once
                waited = True
                continue
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not lease {self.n} GPUs within {timeout:g} s "
                                   f"(lock dir {self.lock_dir}): other processes hold them")
            # Random backoff: workers that all released and retry must not stay in lockstep.
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)
        return self.ids

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []
        self.ids = []

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
