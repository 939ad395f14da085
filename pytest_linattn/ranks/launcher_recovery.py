"""Launcher mode after a failed call (pytest_linattn.ranks.launcher): the report of an aborted
call, read from what every rank posted to the launcher's store, and the process group made anew.

A failed call can leave the process group unusable: an aborted one always (a collective left half
done), a plain failure sometimes (a collective that errored on every rank). Then every rank
destroys its groups and comes back to make a new world group on the launcher's store, under a
prefix of that call's own (`regroup`). When every rank comes within REGROUP_WAIT, the new group is
made and the session goes on. A rank that does not come is gone (it exited, was killed, or stayed
stuck where it could not be freed): no group can be made without it, and every rank gets the
same verdict, through the store, that the session ends.
"""
from __future__ import annotations

import datetime
import os
import pickle
import time
from typing import Callable

from .reports import describe_ranks, launcher_abort

__all__ = ["REGROUP_WAIT", "RETURNED", "abort_story", "agree_group_works", "group_works", "is_gone",
           "process_identity", "regroup", "wait_keys"]

POLL = 0.02
STACK_WAIT = 3.0  # after an abort, how long to wait for every live rank's stack
REGROUP_WAIT = 20.0  # how long the ranks wait for each other to make a new group
CHECK_WAIT = 15.0  # how long the ranks wait for each other's group check
RETURNED = "(had returned: waiting for the other ranks)"  # the stack a rank posts once fn returned
REBUILT = "Every rank came back: a new process group replaced the old one, and the session goes on."


def wait_keys(store, keys, seconds) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if store.check(keys):
            return True
        time.sleep(POLL)
    return False


def gone_ending(verdict: str) -> str:
    """The last line of a report when no new group can be made (verdict: why, from regroup)."""
    return (f"No new process group can be made without every rank: {verdict}. The session stops "
            f"after this test; the summary lists the tests that did not run.")


# ----------------------------------------------------------------------------------------------
# is a rank's process gone? (on this machine, where /proc can tell)


def _machine() -> str:
    """This machine and pid namespace: pids are compared only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), or None when it is gone: exited
    (a zombie not yet reaped by its launcher counts as exited) or never there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields[19]


def process_identity() -> str:
    """"machine pid start-time" of this process; "" where /proc cannot tell."""
    machine = _machine()
    start = _start_time(os.getpid()) if machine else None
    return f"{machine} {os.getpid()} {start}" if start else ""


def is_gone(identity: str) -> bool:
    """True when the process `identity` (process_identity) ran on this machine and has exited.
    False when it lives, or runs elsewhere (then only its silence can tell)."""
    if not identity:
        return False
    machine, pid, start = identity.split(" ")
    return machine == _machine() and _start_time(int(pid)) != start


# ----------------------------------------------------------------------------------------------
# the report of an aborted call


def abort_story(store, key: Callable, world_size: int, what: str, wait: float,
                places: dict[int, str], gone: Callable[[list], set] = lambda ranks: set()
                ) -> tuple[str, bool, set]:
    """What every rank posted for an aborted call (key: this call's store keys): the ranks that
    sent nothing (dead, or stuck outside Python), the errors posted before the abort, the stacks
    of the ranks that had not returned. Also: whether it was a timeout, and the silent ranks.
    gone(ranks): those of `ranks` whose process is seen gone; nothing more is waited for from them."""
    t0 = time.monotonic()
    stack_keys = [key("stack", r) for r in range(world_size)]
    out_keys = [key("out", r) for r in range(world_size)]

    def posted(keys) -> bool:
        if store.check(keys):
            return True
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        return gone(missing) == set(missing)

    # Stacks come at once from every live rank; outcomes once a stuck rank has been freed.
    while time.monotonic() < t0 + min(wait, STACK_WAIT) and not posted(stack_keys):
        time.sleep(POLL)
    while time.monotonic() < t0 + wait and not posted(out_keys):
        time.sleep(POLL)
    stacks, outcomes = {}, {}
    for r in range(world_size):
        if store.check([stack_keys[r]]):
            stacks[r] = store.get(stack_keys[r]).decode(errors="replace")
        if store.check([out_keys[r]]):
            outcomes[r] = pickle.loads(store.get(out_keys[r]))
    reason, _, answered = store.get(key("abort")).decode().partition("|")
    answered = {int(r) for r in answered.split(",") if r}
    silent = set(range(world_size)) - set(stacks) - set(outcomes)
    errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error" and r in answered}
    for r, o in outcomes.items():
        # Freed by the abort before its watchdog looked: where it raised is where it was.
        if r not in answered and o[0] == "error" and stacks.get(r) == RETURNED:
            stacks[r] = o[1]
    story = launcher_abort(what, reason, silent=silent, dead=gone(sorted(silent)), errors=errors,
                           stacks={r: st for r, st in stacks.items() if r not in answered},
                           tests={o[2] for o in outcomes.values() if len(o) > 2}, places=places)
    return story, reason.startswith("timed out"), silent


# ----------------------------------------------------------------------------------------------
# after a plain failure: does the group still work?


def group_works(dist) -> bool:
    # After a plain failure every rank returned; a collective that errored (a gloo timeout,
    # a closed connection) leaves the group unusable, and the next test must not find out.
    try:
        if dist.get_backend() != "gloo":
            return True
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
        return True
    except Exception:
        return False


def agree_group_works(store, key: Callable, rank: int, world_size: int, works: bool) -> bool:
    """True when every rank's check says the group works (key: this call's store keys); a rank
    that does not post its check within CHECK_WAIT counts as a no."""
    store.set(key("works", rank), "1" if works else "0")
    keys = [key("works", r) for r in range(world_size)]
    return wait_keys(store, keys, CHECK_WAIT) and all(store.get(k) == b"1" for k in keys)


# ----------------------------------------------------------------------------------------------
# a new process group


def regroup(store, key: Callable, rank: int, world_size: int, *, backend: str,
            timeout: datetime.timedelta, stopping: Callable[[], str | None], place: str = "",
            gone: Callable[[list], set] = lambda ranks: set(), wait: float = REGROUP_WAIT) -> str | None:
    """Destroy this rank's process groups and make a new world group (backend, timeout) with
    every rank, on `store` under this call's prefix (key: the call's store keys). None when it is
    made; else why not, the same text on every rank: a rank seen gone (`gone(ranks)`: those whose
    process exited), one whose launcher is stopping it (`stopping()` says why; place: this rank's
    place), or a rank that did not come within `wait`. A rank seen gone is named first: torchrun
    stops the others of its node only some time after it exited."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    here = [key("here", r) for r in range(world_size)]
    verdict_key = key("verdict")
    deadline = time.monotonic() + wait
    came = False
    while True:
        stop = stopping()
        dead = gone([r for r, k in enumerate(here) if r != rank and not store.check([k])])
        if dead:
            proposal = f"{describe_ranks(sorted(dead))} exited"
        elif stop:
            proposal = f"rank {rank}{place}: {stop}"
        elif store.check([verdict_key]):
            proposal = None  # another rank has decided
        else:
            if not came:
                store.set(here[rank], "1")
                came = True
            if store.check(here):
                proposal = "rebuild"
            elif time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(here) if not store.check([k])]
                proposal = f"{describe_ranks(missing)} did not come back within {wait:g} s"
            else:
                time.sleep(POLL)
                continue
        break
    # The first proposal wins, on every rank.
    verdict = (store.compare_set(verdict_key, "", proposal) if proposal else store.get(verdict_key)).decode()
    if verdict != "rebuild":
        return verdict
    # Its own prefix: no key of the old group (or of its subgroups) is read again.
    dist.init_process_group(backend, store=dist.PrefixStore(key("group"), store), rank=rank,
                            world_size=world_size, timeout=timeout)
    return None
