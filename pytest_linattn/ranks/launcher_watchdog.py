"""Launcher mode's watchdog (pytest_linattn.ranks.launcher): a thread per rank that turns a stuck
call into a readable failure.

- The call's deadline passes, or a rank posted an error and the others have not answered
  FAILURE_GRACE seconds later (at once when each of them is blocked in torch.distributed: in the
  same C call at two looks), or torchrun sent SIGTERM (a rank on this node exited): the
  watchdog aborts the call (the `abort` key in the launcher's store; the first reason wins).
- On abort every rank posts its main thread's Python stack and interrupts a main thread stuck in
  Python (SIGUSR2); the launcher then frees the ranks blocked in a collective (it destroys the
  group) and makes a new one (pytest_linattn.ranks.launcher_recovery).
- A main thread still stuck FREE_WAIT after the abort (C code, where no signal reaches it) cannot
  be freed: rank 0 writes the report to the terminal itself, and the rank exits.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from .blocked import BlockedLook
from .launcher_recovery import RETURNED, abort_story, wait_keys
from .reports import FAILURE_GRACE, blocked_ranks, call_name, describe_ranks

__all__ = ["FREE_WAIT", "OVER_WAIT", "STOPPED", "Call", "Watchdog"]

FREE_WAIT = 4.0  # after an abort, how long a stuck rank gets to be freed
OVER_WAIT = 60.0  # how long a non-zero rank waits for rank 0 to finish its report
WATCH = 0.1  # how often the watchdog looks
STOPPED = "its launcher sent SIGTERM: a rank on its node exited"


class Call:
    """One distributed call's state on one rank, shared by the main thread and the watchdog."""

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
        self.main = BlockedLook(threading.main_thread().ident)  # where it is blocked, if it is


class Watchdog:
    """The watchdog of a LauncherSession (its store, keys, rank, world and current call);
    `stack_root`: the code object of the frame a call's stack starts below (the session's
    `_run_fn`)."""

    def __init__(self, session, stack_root):
        self.session = session
        self._root = (stack_root.co_filename, stack_root.co_name)
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="linattn-launcher-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        s = self.session
        while True:
            time.sleep(WATCH)
            call = s.current_call
            if call is None:
                continue
            try:
                if s.current_call is not call:
                    continue  # the call completed meanwhile
                if not call.aborted.is_set():
                    reason = self._abort_reason(call)
                    if reason is None:
                        continue
                    if reason:  # else another rank set it
                        s.store.compare_set(s.key(call.number, "abort"), "", reason)
                    call.aborted.set()
                    call.aborted_at = time.monotonic()
                if not call.stack_posted.is_set():
                    s.store.set(s.key(call.number, "stack", s.rank), self._main_stack(call))
                    call.stack_posted.set()
                    if call.in_fn:
                        signal.pthread_kill(self._main, signal.SIGUSR2)
                elif call.in_fn and time.monotonic() > call.aborted_at + FREE_WAIT:
                    self._give_up(call)
            except Exception:
                continue  # the store went away: the launcher is ending the run

    def _abort_reason(self, call: Call) -> str | None:
        """None while the call may still complete; "" when another rank aborted it; else why
        this rank aborts it, with the ranks that had answered ("reason|0,2")."""
        s = self.session
        if s.store.check([s.key(call.number, "abort")]):
            return ""
        blocked_in = self._blocked_in(call)
        statuses = {}
        for r in range(s.world_size):
            key = s.key(call.number, "status", r)
            if s.store.check([key]):
                statuses[r] = s.store.get(key).decode()
        if len(statuses) == s.world_size:
            return None
        unanswered = sorted(set(range(s.world_size)) - set(statuses))
        waiting = describe_ranks(unanswered)
        failed = sorted(r for r, st in statuses.items() if st == "error")
        now = time.monotonic()
        if call.stop_reason:
            reason = f"rank {s.rank}{s.places().get(s.rank, '')}: {call.stop_reason}"
        elif now >= call.deadline:
            reason = f"timed out after {call.timeout:g} s; {waiting} had not returned"
        elif failed:
            if call.first_error_at is None:
                call.first_error_at = now
            if blocked_in and s.rank in unanswered:
                s.store.compare_set(s.key(call.number, "blocked", s.rank), "", blocked_in)
            blocked_keys = [s.key(call.number, "blocked", r) for r in unanswered]
            if s.store.check(blocked_keys):
                # Every rank that has not answered waits in torch.distributed: no grace helps.
                where = {r: s.store.get(k).decode() for r, k in zip(unanswered, blocked_keys)}
                reason = f"{describe_ranks(failed)} raised and {blocked_ranks(where)}"
            elif now < call.first_error_at + FAILURE_GRACE:
                return None
            else:
                reason = (f"{describe_ranks(failed)} raised and {waiting} had not answered "
                          f"{FAILURE_GRACE:g} s later")
        else:
            return None
        return reason + "|" + ",".join(map(str, sorted(statuses)))

    def _blocked_in(self, call: Call) -> str | None:
        """Where the main thread is blocked in torch.distributed, in fn (pytest_linattn.ranks.blocked)."""
        if not call.in_fn:
            call.main.forget()
            return None
        return call.main.look()

    def _main_stack(self, call: Call) -> str:
        if not call.in_fn:
            return RETURNED
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "(no stack)"
        frames = traceback.extract_stack(frame)
        # From fn down: drop pytest's and the launcher's frames above it.
        for i, summary in enumerate(frames):
            if (summary.filename, summary.name) == self._root:
                frames = frames[i + 1:]
                break
        return "".join(traceback.format_list(frames)).rstrip()

    def _give_up(self, call: Call) -> None:
        # The main thread is stuck where no signal reaches it (C code, a collective with a rank
        # that is stuck too): report from here and end this process; the others go on without it.
        s = self.session
        try:  # the others need not wait for it to make a new group: it will not come
            s.store.compare_set(s.key(call.number, "verdict"), "", f"rank {s.rank}{s.places().get(s.rank, '')}: "
                                f"stuck outside Python {FREE_WAIT:g} s after the abort; it exits")
        except Exception:
            pass
        if s.rank == 0:
            what = f"{call_name(None, s.world_size)} (launcher mode, call {call.number})"
            story = abort_story(s.store, lambda *parts: s.key(call.number, *parts), s.world_size,
                                what, 0.5, s.places(), s.gone_ranks)[0]
            s.write_terminal(
                f"\n{'!' * 30} linattn: a distributed call could not be freed {'!' * 30}\n"
                f"{story}\nrank 0's main thread is still stuck {FREE_WAIT:g} s after the abort; "
                f"this rank ends the session now (exit code 1) without pytest's summary.\n")
            try:
                s.store.set(s.key("over"), "1")
            except Exception:
                pass
        else:
            try:
                wait_keys(s.store, [s.key("over")], OVER_WAIT)
            except Exception:
                pass
        os._exit(1)
