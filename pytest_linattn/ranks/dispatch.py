"""Where a call on several ranks runs: under torchrun (WORLD_SIZE set) on the launcher's process
group, every rank getting every rank's value (pytest_linattn.ranks.launcher); otherwise on a
spawned pool (pytest_linattn.ranks.pool)."""

from __future__ import annotations

from typing import Any, Callable

from ..options import DEFAULT_TIMEOUT, parse_timeout
from .launcher import LauncherSession, launcher_rank, launcher_world_size
from .pool import PoolManager, check_world_size, resolve_device

_LAUNCHER_SESSION = None


def run_on_ranks(fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None, *,
                 device: str, timeout: float, pools: Callable[[], PoolManager] | None,
                 launcher: LauncherSession | None = None, fla_on_cpu=None, test: str = "",
                 ranks_per_gpu: int = 1, collectives=None) -> list[Any]:
    """fn(*args, **kwargs) on world_size ranks; the values in rank order, on CPU.

    Under torchrun (WORLD_SIZE set) fn runs on the launcher's process group, through `launcher`
    or else this process's own session; `test` names the caller in a report when the ranks'
    calls disagree; on cuda up to `ranks_per_gpu` local ranks share a GPU. Otherwise on a spawned
    pool of `pools()`, the caller's PoolManager (asked for only then, and sharing GPUs as it was
    made to); `fla_on_cpu` and `collectives` as in `Pool.run`.
    """
    if launcher is None and launcher_world_size() is not None:
        launcher = _launcher_session(world_size)
    if launcher is None:
        return pools().run(fn, world_size, args, kwargs, timeout=timeout, fla_on_cpu=fla_on_cpu,
                           collectives=collectives)
    if collectives is not None:
        raise NotImplementedError("collective mutation testing does not run under torchrun (the launcher's ranks "
                                  "cannot be restarted after a mutant breaks them): run the tests without "
                                  "torchrun, on spawn's rank pool")
    return launcher.run(fn, check_world_size(world_size), args, kwargs, device=resolve_device(device),
                        timeout=parse_timeout(timeout), test=test, ranks_per_gpu=ranks_per_gpu)


def run_in_launcher(fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    *, device: str = "cpu", timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """fn on the launcher's existing process group; every rank gets all ranks' values in order.
    Failures are reported through a side channel (see pytest_linattn.ranks.launcher)."""
    return run_on_ranks(fn, world_size, args, kwargs, device=device, timeout=timeout, pools=None,
                        launcher=_launcher_session(world_size))


def _launcher_session(world_size: int) -> LauncherSession:
    global _LAUNCHER_SESSION
    if _LAUNCHER_SESSION is None:
        _LAUNCHER_SESSION = LauncherSession(launcher_rank(), launcher_world_size() or world_size)
    return _LAUNCHER_SESSION
