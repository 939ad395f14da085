"""Launcher mode: spawn's calls when pytest itself runs under torchrun (WORLD_SIZE set); no pytest.

Every rank runs the same session, so the n-th call on one rank is the n-th call on every rank.
The world may span several nodes (torchrun --nnodes N, one agent per node); ranks are global.
A call runs fn on the launcher's process group, then each rank posts its outcome ("ok" + value
or "error" + traceback) to a side channel that does not depend on that group: the launcher's
TCPStore. A watchdog thread per rank (pytest_linattn.ranks.launcher_watchdog) turns a stuck call
into a readable failure: it aborts the call, posts every rank's stack, interrupts a rank stuck in
Python, and here every rank that is free destroys its process groups, which frees a rank blocked
in a collective with it ("Connection closed by peer").

After a failed call whose group may no longer work (an aborted call always; a plain failure when
a collective check fails), every rank makes a new process group, the same world on the
launcher's store under a new prefix (pytest_linattn.ranks.launcher_recovery), and the session
goes on. Only when a rank is gone (exited, killed, stuck outside Python) can no group be made:
the call raises BrokenGroup and the session must stop (the plugin stops it after that test).

Only rank 0 reports; the others run quietly and wait for rank 0 to finish before they exit, so
torchrun does not kill rank 0 while it prints.
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from functools import partial
from typing import Any, Callable

from .launcher_recovery import (POLL, REBUILT, RETURNED, abort_story, agree_group_works, gone_ending,
                                group_works, is_gone, process_identity, regroup, wait_keys)
from .launcher_watchdog import FREE_WAIT, OVER_WAIT, STOPPED, Call, Watchdog
from .reports import (BrokenGroup, BrokenTimeout, RankFailure, RankTimeout, call_name, describe_ranks,
                      raised_lines)
from .groups import destroy_earlier_groups
from .worker import RANK_DEVICE_ENV, to_cpu

__all__ = ["BrokenGroup", "BrokenTimeout", "LauncherSession", "LauncherStopped", "launcher_rank",
           "launcher_world_size", "rank_place"]


class _Interrupted(BaseException):
    """Raised in the main thread (by SIGUSR2) to free a rank stuck in Python after an abort."""


class LauncherStopped(KeyboardInterrupt):
    """The launcher sent SIGTERM outside a distributed call: a rank on this node exited between
    calls. It interrupts the session (pytest_linattn.spawn lists the tests not run)."""


def launcher_world_size(environ=None) -> int | None:
    """WORLD_SIZE when this process was started by a launcher (torchrun), else None."""
    environ = os.environ if environ is None else environ
    value = environ.get("WORLD_SIZE")
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {value!r}") from None


def launcher_rank(environ=None) -> int:
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("RANK", "0"))
    except ValueError:
        raise ValueError(f"RANK must be an integer, got {environ.get('RANK')!r}") from None


def rank_place(environ=None) -> str:
    """Where this rank runs, for reports: ' (node 1 = host, local rank 1)' when the world spans
    several nodes (torchrun's GROUP_WORLD_SIZE > 1; GROUP_RANK is the node), else ''."""
    environ = os.environ if environ is None else environ
    try:
        nodes = int(environ.get("GROUP_WORLD_SIZE", "1"))
    except ValueError:
        nodes = 1
    if nodes <= 1:
        return ""
    return (f" (node {environ.get('GROUP_RANK', '?')} = {socket.gethostname()}, "
            f"local rank {environ.get('LOCAL_RANK', '?')})")


class LauncherSession:
    """One pytest session's launcher-mode state on one rank."""

    def __init__(self, rank: int, world_size: int, *, terminal_fd: int | None = None):
        self.rank = rank
        self.world_size = world_size
        self.terminal_fd = terminal_fd
        self.calls = 0
        self.store = None
        self.gone = None  # the story of the call after which a rank was gone
        self.reported_for_rank0 = False  # rank 0 sent nothing and this rank reported instead
        self.current_call: Call | None = None
        self._places: dict[int, str] = {}
        self._identities: dict[int, str] = {}
        self._backend = None
        self._group_timeout = None
        self._old_handlers = {}
        self._watchdog = None
        # torchrun restarts reuse its store: keys of an earlier attempt must not be read.
        self._prefix = f"linattn/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

    # -- set-up and tear-down

    def install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGUSR2):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        call = self.current_call
        if signum == signal.SIGTERM:
            if call is None:
                raise LauncherStopped("the launcher sent SIGTERM: a rank on this node exited (torchrun's "
                                      "log names it and its exit code)")
            call.stop_reason = STOPPED
        if call is not None and call.in_fn and (call.aborted.is_set() or call.stop_reason):
            raise _Interrupted()

    def key(self, *parts) -> str:
        return self._prefix + "/".join(map(str, parts))

    def places(self) -> dict[int, str]:
        """rank -> where it runs (rank_place), as every rank posted it at its first call."""
        if len(self._places) < self.world_size and self.store is not None:
            for r in range(self.world_size):
                if r not in self._places and self.store.check([self.key("place", r)]):
                    self._places[r] = self.store.get(self.key("place", r)).decode()
        return self._places

    def gone_ranks(self, ranks) -> set[int]:
        """Those of `ranks` whose process is seen to have exited: by this rank, on this machine
        (it then tells the others through the store), or by any rank on theirs."""
        gone = set()
        for r in ranks:
            key = self.key("gone", r)
            if r not in self._identities and self.store.check([self.key("process", r)]):
                self._identities[r] = self.store.get(self.key("process", r)).decode()
            if self.store.check([key]):
                gone.add(r)
            elif is_gone(self._identities.get(r, "")):
                self.store.set(key, "1")
                gone.add(r)
        return gone

    def finish(self) -> None:
        """At the end of the session: rank 0 says it has reported; the others wait for that
        (unless rank 0 was gone and this rank reported instead: nothing will come)."""
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        if self.store is None:
            return
        try:
            if self.rank == 0:
                self.store.set(self.key("over"), "1")
            elif not self.reported_for_rank0:
                wait_keys(self.store, [self.key("over")], OVER_WAIT)
        except Exception:
            pass  # the launcher's store is gone: the run is over anyway

    def _ensure_group(self, device: str, timeout: float, ranks_per_gpu: int = 1):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ[RANK_DEVICE_ENV] = device
            backend = "gloo"
            if device == "cuda":
                # up to ranks_per_gpu local ranks share a GPU, over the staged transport
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) // ranks_per_gpu)
                backend = "nccl"
                if ranks_per_gpu > 1:
                    from .staged import BACKEND, register

                    register()
                    backend = BACKEND
            # The group's own timeout is a backstop only: the watchdog enforces the call's.
            dist.init_process_group(backend, init_method="env://",
                                    timeout=datetime.timedelta(seconds=max(timeout, 1800.0)))
        if self.store is None:
            self.store = dist.distributed_c10d._get_default_store()
            self._backend = dist.get_backend()
            self._group_timeout = datetime.timedelta(seconds=max(timeout, 1800.0))
            self.store.set(self.key("place", self.rank), rank_place())
            self.store.set(self.key("process", self.rank), process_identity())
            self._watchdog = Watchdog(self, LauncherSession._run_fn.__code__)
            self._watchdog.start()
        return dist

    def write_terminal(self, text: str) -> None:
        fd = self.terminal_fd if self.terminal_fd is not None else 2
        try:
            os.write(fd, text.encode(errors="replace"))
        except OSError:
            pass

    # -- one call

    def run(self, fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None, *,
            device: str = "cpu", timeout: float, test: str = "", ranks_per_gpu: int = 1) -> list[Any]:
        # world_size and timeout: checked by the caller, pytest_linattn.ranks.dispatch.run_on_ranks
        if self.gone is not None:
            raise BrokenGroup("a rank was gone after an earlier call; no more distributed calls "
                              "in this session:\n" + self.gone)
        if world_size != self.world_size:
            raise ValueError(f"world_size={world_size} but this run was launched with WORLD_SIZE="
                             f"{self.world_size}: under torchrun, spawn can only use the "
                             f"launcher's world size")
        dist = self._ensure_group(device, timeout, ranks_per_gpu)
        destroy_earlier_groups()  # every rank has finished the call before: see run's wait below
        self.calls += 1
        call = Call(self.calls, time.monotonic() + timeout, timeout)
        key = partial(self.key, call.number)
        self.current_call = call
        try:
            outcome = self._run_fn(call, fn, args, kwargs or {})
            status = outcome[0]
            self.store.set(key("out", self.rank), pickle.dumps((*outcome, test)))
            self.store.set(key("status", self.rank), status)
            keys = [key("status", r) for r in range(self.world_size)]
            while not call.aborted.is_set() and not self.store.check(keys):
                time.sleep(POLL)
            # Another rank's abort may have freed this one (closed its connections) before this
            # rank's watchdog saw it: every status is then in, and only the store says aborted.
            if call.aborted.is_set() or self.store.check([key("abort")]):
                self._after_abort(call, dist, fn)
            outcomes = [pickle.loads(self.store.get(key("out", r))) for r in range(self.world_size)]
            self._clean_up(call.number)
            errors = {r: o[1] for r, o in enumerate(outcomes) if o[0] == "error"}
            if errors:
                self._after_failure(call, dist, fn, errors)
        finally:
            self.current_call = None
        return [o[1] for o in outcomes]

    def _call_name(self, fn, call: Call) -> str:
        return f"{call_name(fn, self.world_size)} (launcher mode, call {call.number})"

    def _run_fn(self, call: Call, fn, args, kwargs) -> tuple:
        try:
            call.in_fn = True
            try:
                value = fn(*args, **kwargs)
            finally:
                call.in_fn = False
            return ("ok", to_cpu(value))
        except _Interrupted:
            call.in_fn = False
            return ("error", "interrupted after the call was aborted (its stack is below)")
        except BaseException as exc:  # SystemExit too: a rank must always answer
            call.in_fn = False
            return ("error", "".join(traceback.format_exception(type(exc), exc,
                                                                exc.__traceback__.tb_next)))

    def _clean_up(self, number: int) -> None:
        # The last rank to read a call's outcomes deletes them: values may be large. The few bytes
        # of status stay: a watchdog may be between checking one and getting it, and a get of a
        # deleted key waits for the store's timeout (holding the store client from the main thread).
        try:
            if self.store.add(self.key(number, "read"), 1) == self.world_size:
                for r in range(self.world_size):
                    self.store.delete_key(self.key(number, "out", r))
        except Exception:
            pass

    # -- a failed call

    def _after_failure(self, call: Call, dist, fn, errors: dict[int, str]) -> None:
        # Every rank returned. A collective that errored (a gloo timeout, a closed connection)
        # leaves the group unusable, and the next test must not find out: then a new group.
        message = "\n".join([f"{self._call_name(fn, call)}: {describe_ranks(errors)} failed.",
                             *raised_lines(errors, self.places())])
        key = partial(self.key, call.number)
        try:
            works = agree_group_works(self.store, key, self.rank, self.world_size, group_works(dist))
        except Exception:
            works = False  # the store failed: regroup says why
        if works:
            raise RankFailure(message)
        self._regroup(call, message + "\nThe process group no longer worked after this failure "
                      "(a collective check failed).", timed_out=False)

    def _after_abort(self, call: Call, dist, fn) -> None:
        if not call.stack_posted.is_set():
            # fn has returned here: post what the watchdog would (it may look only later).
            self.store.compare_set(self.key(call.number, "stack", self.rank), "", RETURNED)
            call.stack_posted.set()
        # Free ranks close their connections: a peer blocked in a collective with this rank
        # gets "Connection closed by peer" and can answer.
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        story, timed_out, silent = abort_story(self.store, partial(self.key, call.number), self.world_size,
                                               self._call_name(fn, call), FREE_WAIT, self.places(),
                                               self.gone_ranks)
        try:
            self._regroup(call, story, timed_out=timed_out)
        except (BrokenGroup, BrokenTimeout):
            if self.rank != 0 and 0 in silent:
                # Rank 0 sent nothing and no new group could be made: it may be gone, and its
                # report never come, so this rank says what it saw. (A rank 0 merely slow to
                # answer, on a loaded machine, comes back into the new group and reports alone.)
                self.write_terminal(f"\nlinattn, rank {self.rank}: rank 0 did not answer; what this "
                                    f"rank saw:\n{story}\n")
                self.reported_for_rank0 = True
            raise

    def _regroup(self, call: Call, story: str, *, timed_out: bool) -> None:
        """A new process group with every rank, then the call's failure; or, when a rank is
        gone, BrokenGroup: the session must stop."""
        try:
            verdict = regroup(self.store, partial(self.key, call.number), self.rank, self.world_size,
                              backend=self._backend, timeout=self._group_timeout,
                              stopping=lambda: call.stop_reason, place=self.places().get(self.rank, ""),
                              gone=self.gone_ranks)
        except Exception as exc:  # the launcher's store (its agent) is gone, or the new group failed
            verdict = f"rank {self.rank} could not make it: {type(exc).__name__}: {exc}"
        if verdict is None:
            raise (RankTimeout if timed_out else RankFailure)(f"{story}\n{REBUILT}")
        self.gone = f"{story}\n{gone_ending(verdict)}"
        raise (BrokenTimeout if timed_out else BrokenGroup)(self.gone)
