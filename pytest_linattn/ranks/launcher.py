"""Launcher mode: spawn's calls when pytest itself runs under torchrun (WORLD_SIZE set); no pytest.

Every rank runs the same session, so the n-th call on one rank is the n-th call on every rank.
A call runs fn on the launcher's process group, then each rank posts its outcome ("ok" + value
or "error" + traceback) to a side channel that does not depend on that group: the launcher's
TCPStore. A watchdog thread per rank turns a stuck call into a readable failure:

- the call's deadline passes, or a rank posted an error and the others have not answered
  FAILURE_GRACE seconds later, or torchrun sends SIGTERM (a rank exited): the call is aborted;
- on abort every rank posts its main thread's Python stack, a rank stuck in Python is
  interrupted (SIGUSR2), and every rank that is free destroys its process groups, which frees a
  rank blocked in a collective with it ("Connection closed by peer");
- a collective left half done cannot be repaired in-process, so an aborted call raises
  BrokenGroup: the session must stop (the plugin stops it after the failing test);
- a rank 0 that is still stuck after FREE_WAIT writes the report to the terminal itself and exits.

Only rank 0 reports; the others run quietly and wait for rank 0 to finish before they exit, so
torchrun does not kill rank 0 while it prints.
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from .reports import (FAILURE_GRACE, RankFailure, RankTimeout, call_name, describe_ranks, launcher_abort,
                           raised_lines)
from .worker import to_cpu

__all__ = ["BrokenGroup", "LauncherSession", "launcher_rank", "launcher_world_size"]

STACK_WAIT = 3.0  # after an abort, how long to wait for every live rank's stack
FREE_WAIT = 4.0  # after an abort, how long a stuck rank gets to be freed
OVER_WAIT = 60.0  # how long a non-zero rank waits for rank 0 to finish its report
_POLL = 0.02
_WATCH = 0.1
_RETURNED = "(had returned: waiting for the other ranks)"  # the stack a rank posts once fn returned


class BrokenGroup(RankFailure):
    """A call was aborted with a collective left half done: the process group is unusable."""


class _Interrupted(BaseException):
    """Raised in the main thread (by SIGUSR2) to free a rank stuck in Python after an abort."""


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


class _Call:
    def __init__(self, number: int, deadline: float, timeout: float):
        self.number = number
        self.deadline = deadline
        self.timeout = timeout
        self.in_fn = False
        self.aborted = threading.Event()
        self.stack_posted = threading.Event()
        self.first_error_at = None
        self.aborted_at = None
        self.stop_reason = None  # set by SIGTERM


class LauncherSession:
    """One pytest session's launcher-mode state on one rank."""

    def __init__(self, rank: int, world_size: int, *, terminal_fd: int | None = None):
        self.rank = rank
        self.world_size = world_size
        self.terminal_fd = terminal_fd
        self.calls = 0
        self.store = None
        self.broken = None  # the story of the call that broke the group
        self._call: _Call | None = None
        self._main = threading.main_thread().ident
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
        call = self._call
        if signum == signal.SIGTERM:
            if call is None:
                raise KeyboardInterrupt("the launcher sent SIGTERM (another rank exited)")
            call.stop_reason = "the launcher sent SIGTERM: another rank exited"
        if call is not None and call.in_fn and (call.aborted.is_set() or call.stop_reason):
            raise _Interrupted()

    def _key(self, *parts) -> str:
        return self._prefix + "/".join(map(str, parts))

    def finish(self) -> None:
        """At the end of the session: rank 0 says it has reported; the others wait for that."""
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        if self.store is None:
            return
        try:
            if self.rank == 0:
                self.store.set(self._key("over"), "1")
            else:
                self._wait_keys([self._key("over")], OVER_WAIT)
        except Exception:
            pass  # the launcher's store is gone: the run is over anyway

    def _wait_keys(self, keys, seconds) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.store.check(keys):
                return True
            time.sleep(_POLL)
        return False

    def _ensure_group(self, device: str, timeout: float):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # The group's own timeout is a backstop only: the watchdog enforces the call's.
            dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://",
                                    timeout=datetime.timedelta(seconds=max(timeout, 1800.0)))
        if self.store is None:
            self.store = dist.distributed_c10d._get_default_store()
            self._watchdog = threading.Thread(target=self._watch, name="linattn-launcher-watchdog",
                                              daemon=True)
            self._watchdog.start()
        return dist

    # -- one call

    def run(self, fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None, *,
            device: str = "cpu", timeout: float, test: str = "") -> list[Any]:
        # world_size and timeout: checked by the caller, pytest_linattn.ranks.dispatch.run_on_ranks
        if self.broken is not None:
            raise BrokenGroup("the process group was broken by an earlier call; no more "
                              "distributed calls in this session:\n" + self.broken)
        if world_size != self.world_size:
            raise ValueError(f"world_size={world_size} but this run was launched with WORLD_SIZE="
                             f"{self.world_size}: under torchrun, spawn can only use the "
                             f"launcher's world size")
        dist = self._ensure_group(device, timeout)
        self.calls += 1
        call = _Call(self.calls, time.monotonic() + timeout, timeout)
        self._call = call
        try:
            outcome = self._run_fn(call, fn, args, kwargs or {})
            status = outcome[0]
            self.store.set(self._key(call.number, "out", self.rank), pickle.dumps((*outcome, test)))
            self.store.set(self._key(call.number, "status", self.rank), status)
            keys = [self._key(call.number, "status", r) for r in range(self.world_size)]
            while not call.aborted.is_set() and not self.store.check(keys):
                time.sleep(_POLL)
            # Another rank's abort may have freed this one (closed its connections) before this
            # rank's watchdog saw it: every status is then in, and only the store says aborted.
            if call.aborted.is_set() or self.store.check([self._key(call.number, "abort")]):
                self._raise_broken(call, dist, fn)
            outcomes = [pickle.loads(self.store.get(self._key(call.number, "out", r)))
                        for r in range(self.world_size)]
        finally:
            self._call = None
        self._clean_up(call.number)
        errors = {r: o[1] for r, o in enumerate(outcomes) if o[0] == "error"}
        if errors:
            message = "\n".join([f"{self._call_name(fn, call)}: {describe_ranks(errors)} failed.",
                                 *raised_lines(errors)])
            if not self._group_works(dist):
                self.broken = message
                raise BrokenGroup(message + "\nThe process group no longer works after this "
                                  "failure (a collective check failed).")
            raise RankFailure(message)
        return [o[1] for o in outcomes]

    def _call_name(self, fn, call: _Call) -> str:
        return f"{call_name(fn, self.world_size)} (launcher mode, call {call.number})"

    def _run_fn(self, call: _Call, fn, args, kwargs) -> tuple:
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

    def _group_works(self, dist) -> bool:
        # After a plain failure every rank returned; a collective that errored (a gloo timeout,
        # a closed connection) leaves the group unusable, and the next test must not find out.
        try:
            if dist.get_backend() != "gloo":
                return True
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
            return True
        except Exception:
            return False

    def _clean_up(self, number: int) -> None:
        # The last rank to read a call's outcomes deletes them: values may be large. The few bytes
        # of status stay: a watchdog may be between checking one and getting it, and a get of a
        # deleted key waits for the store's timeout (holding the store client from the main thread).
        try:
            if self.store.add(self._key(number, "read"), 1) == self.world_size:
                for r in range(self.world_size):
                    self.store.delete_key(self._key(number, "out", r))
        except Exception:
            pass

    # -- the watchdog thread

    def _watch(self) -> None:
        while True:
            time.sleep(_WATCH)
            call = self._call
            if call is None:
                continue
            try:
                if self._call is not call:
                    continue  # the call completed meanwhile
                if not call.aborted.is_set():
                    reason = self._abort_reason(call)
                    if reason is None:
                        continue
                    if reason:  # else another rank set it
                        self.store.compare_set(self._key(call.number, "abort"), "", reason)
                    call.aborted.set()
                    call.aborted_at = time.monotonic()
                if not call.stack_posted.is_set():
                    self.store.set(self._key(call.number, "stack", self.rank), self._main_stack(call))
                    call.stack_posted.set()
                    if call.in_fn:
                        signal.pthread_kill(self._main, signal.SIGUSR2)
                elif call.in_fn and time.monotonic() > call.aborted_at + FREE_WAIT:
                    self._give_up(call)
            except Exception:
                continue  # the store went away: the launcher is ending the run

    def _abort_reason(self, call: _Call) -> str | None:
        """None while the call may still complete; "" when another rank aborted it; else why
        this rank aborts it, with the ranks that had answered ("reason|0,2")."""
        if self.store.check([self._key(call.number, "abort")]):
            return ""
        statuses = {}
        for r in range(self.world_size):
            key = self._key(call.number, "status", r)
            if self.store.check([key]):
                statuses[r] = self.store.get(key).decode()
        if len(statuses) == self.world_size:
            return None
        waiting = describe_ranks(set(range(self.world_size)) - set(statuses))
        failed = sorted(r for r, s in statuses.items() if s == "error")
        now = time.monotonic()
        if call.stop_reason:
            reason = call.stop_reason
        elif now >= call.deadline:
            reason = f"timed out after {call.timeout:g} s; {waiting} had not returned"
        elif failed:
            if call.first_error_at is None:
                call.first_error_at = now
            if now < call.first_error_at + FAILURE_GRACE:
                return None
            reason = (f"{describe_ranks(failed)} raised and {waiting} had not answered "
                      f"{FAILURE_GRACE:g} s later")
        else:
            return None
        return reason + "|" + ",".join(map(str, sorted(statuses)))

    def _main_stack(self, call: _Call) -> str:
        if not call.in_fn:
            return _RETURNED
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "(no stack)"
        frames = traceback.extract_stack(frame)
        # From fn down: drop pytest's and this module's frames above it.
        for i, summary in enumerate(frames):
            if summary.filename == __file__ and summary.name == "_run_fn":
                frames = frames[i + 1:]
                break
        return "".join(traceback.format_list(frames)).rstrip()

    def _give_up(self, call: _Call) -> None:
        # The main thread is stuck where no signal reaches it (C code, a collective with a rank
        # that is stuck too): report from here and end this process.
        if self.rank == 0:
            story = self._abort_story(None, call, 0.5)[0]
            self._write_terminal(
                f"\n{'!' * 30} linattn: a distributed call could not be freed {'!' * 30}\n"
                f"{story}\nrank 0's main thread is still stuck {FREE_WAIT:g} s after the abort; "
                f"this rank ends the session now (exit code 1) without pytest's summary.\n")
            try:
                self.store.set(self._key("over"), "1")
            except Exception:
                pass
        else:
            try:
                self._wait_keys([self._key("over")], OVER_WAIT)
            except Exception:
                pass
        os._exit(1)

    def _write_terminal(self, text: str) -> None:
        fd = self.terminal_fd if self.terminal_fd is not None else 2
        try:
            os.write(fd, text.encode(errors="replace"))
        except OSError:
            pass

    # -- an aborted call

    def _raise_broken(self, call: _Call, dist, fn) -> None:
        call.stack_posted.wait(STACK_WAIT)
        # Free ranks close their connections: a peer blocked in a collective with this rank
        # gets "Connection closed by peer" and can answer.
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        story, timed_out, silent = self._abort_story(fn, call, FREE_WAIT)
        self.broken = story
        if self.rank != 0 and 0 in silent:
            # Rank 0 died or is stuck: its report may never come, so this rank says what it saw.
            self._write_terminal(f"\nlinattn, rank {self.rank}: rank 0 did not answer; what this "
                                 f"rank saw:\n{story}\n")
        raise (BrokenTimeout if timed_out else BrokenGroup)(story)

    def _abort_story(self, fn, call: _Call, wait: float) -> tuple[str, bool, set]:
        """What every rank posted for an aborted call: the ranks that sent nothing (dead, or
        stuck outside Python), the errors posted before the abort, the stacks of the ranks that
        had not returned. Also: whether it was a timeout, and the silent ranks."""
        t0 = time.monotonic()
        stack_keys = [self._key(call.number, "stack", r) for r in range(self.world_size)]
        out_keys = [self._key(call.number, "out", r) for r in range(self.world_size)]
        # Stacks come at once from every live rank; outcomes once a stuck rank has been freed.
        while time.monotonic() < t0 + min(wait, STACK_WAIT) and not self.store.check(stack_keys):
            time.sleep(_POLL)
        while time.monotonic() < t0 + wait and not self.store.check(out_keys):
            time.sleep(_POLL)
        stacks, outcomes = {}, {}
        for r in range(self.world_size):
            if self.store.check([stack_keys[r]]):
                stacks[r] = self.store.get(stack_keys[r]).decode(errors="replace")
            if self.store.check([out_keys[r]]):
                outcomes[r] = pickle.loads(self.store.get(out_keys[r]))
        reason, _, answered = self.store.get(self._key(call.number, "abort")).decode().partition("|")
        answered = {int(r) for r in answered.split(",") if r}
        silent = set(range(self.world_size)) - set(stacks) - set(outcomes)
        errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error" and r in answered}
        for r, o in outcomes.items():
            # Freed by the abort before its watchdog looked: where it raised is where it was.
            if r not in answered and o[0] == "error" and stacks.get(r) == _RETURNED:
                stacks[r] = o[1]
        story = launcher_abort(self._call_name(fn, call), reason, silent=silent, errors=errors,
                               stacks={r: st for r, st in stacks.items() if r not in answered},
                               tests={o[2] for o in outcomes.values() if len(o) > 2})
        return story, reason.startswith("timed out"), silent


class BrokenTimeout(BrokenGroup, RankTimeout):
    """An aborted call that timed out: every rank's stack is in the message."""
