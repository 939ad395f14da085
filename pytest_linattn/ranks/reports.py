"""Failure and hang reports of a call on several ranks, for the spawned pool (pytest_linattn.ranks.pool)
and for torchrun's world (pytest_linattn.ranks.launcher): the exceptions they raise, how long the other
ranks get after a first failure, and the text that says what every rank did.

A report names the call and what went wrong first, then one block per rank: a death (with what
faulthandler wrote for a fatal signal), a traceback, or the Python stack of a rank that had not
returned. A spawned rank's stack comes from faulthandler, which each rank registers on SIGUSR1
into its dump file (worker); `dump_stacks` sends the signal and reads the files.
"""
from __future__ import annotations

import os
import signal
import time

from .worker import trim_stack

__all__ = ["FAILURE_GRACE", "BrokenGroup", "BrokenTimeout", "RankFailure", "RankTimeout", "blocked_ranks",
           "call_name", "describe_ranks", "dump_sizes", "dump_stacks", "indent", "launcher_abort", "pool_failure",
           "raised_lines", "read_dump"]

# After the first rank fails, the others get this long to report before they are killed: a rank
# blocked in a collective with a rank that raised would otherwise wait for the full timeout.
FAILURE_GRACE = 2.0
_STACK_WAIT = 2.0  # how long faulthandler gets to write every rank's stack


class RankFailure(Exception):
    """A distributed call failed on one or more ranks; the message holds every rank's story."""


class RankTimeout(RankFailure):
    """A distributed call ran past its timeout; the message holds every rank's Python stack."""


class BrokenGroup(RankFailure):
    """Under torchrun: a call failed and a rank is gone (exited, killed, or stuck where it could
    not be freed), so no new process group can be made: the session must stop."""


class BrokenTimeout(BrokenGroup, RankTimeout):
    """A call that timed out, after which a rank is gone: every rank's stack is in the message."""


# ----------------------------------------------------------------------------------------------
# pieces of a report


def describe_ranks(ranks) -> str:
    """{2} -> 'rank 2'; {0, 3} -> 'ranks 0, 3'."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def blocked_ranks(where: dict[int, str]) -> str:
    """{0: 'barrier'} -> 'rank 0 was blocked in torch.distributed (barrier)' (where: rank -> the
    torch.distributed function it is blocked in, pytest_linattn.ranks.blocked)."""
    return (f"{describe_ranks(where)} {'was' if len(where) == 1 else 'were'} blocked in torch.distributed "
            f"({', '.join(sorted(set(where.values())))})")


def call_name(fn, world_size: int) -> str:
    """'fn(...) on 2 ranks', how a report names the call."""
    name = "a call" if fn is None else getattr(fn, "__qualname__", repr(fn))
    return f"{name}(...) on {world_size} ranks"


def indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip().splitlines(True))


def raised_lines(errors: dict[int, str], places: dict[int, str] | None = None) -> list[str]:
    """One block per rank that raised: a header and its indented traceback. places: rank -> where
    it runs (" (node 1 = host, local rank 1)"), for a world of several nodes."""
    places = places or {}
    lines = []
    for r in sorted(errors):
        lines.append(f"--- rank {r}{places.get(r, '')} raised:")
        lines.append(indent(errors[r]))
    return lines


def exit_story(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"died with signal {signal.Signals(-code).name}"
        except ValueError:
            return f"died with signal {-code}"
    return f"died with exit code {code}"


# ----------------------------------------------------------------------------------------------
# what faulthandler wrote in the spawned ranks' dump files


def dump_sizes(paths: list[str]) -> list[int]:
    """Every dump file's size now: where what a later call writes begins."""
    sizes = []
    for path in paths:
        try:
            sizes.append(os.path.getsize(path))
        except OSError:
            sizes.append(0)
    return sizes


def read_dump(path: str, offset: int) -> str:
    """What faulthandler wrote to a rank's dump file after `offset` (a fatal signal's stack)."""
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return trim_stack(f.read())
    except OSError:
        return ""


def dump_stacks(procs: dict, paths: list[str]) -> dict[int, str]:
    """The Python stack of every live process in `procs` (rank -> multiprocessing.Process), via
    faulthandler on SIGUSR1; paths[rank] is that rank's dump file."""
    sizes = {}
    for r, p in procs.items():
        if p.pid is None or not p.is_alive():
            continue
        try:
            sizes[r] = os.path.getsize(paths[r])
            os.kill(p.pid, signal.SIGUSR1)
        except (OSError, ProcessLookupError):
            continue
    # faulthandler writes from its signal handler: wait until every file has grown and settled.
    deadline = time.monotonic() + _STACK_WAIT
    last = dict(sizes)
    while sizes and time.monotonic() < deadline:
        time.sleep(0.05)
        now = {r: os.path.getsize(paths[r]) for r in sizes}
        if all(now[r] > sizes[r] and now[r] == last[r] for r in sizes):
            break
        last = now
    return {r: read_dump(paths[r], size) for r, size in sizes.items()}


# ----------------------------------------------------------------------------------------------
# the spawned pool's report


def pool_failure(what: str, timeout: float, world_size: int, pids: list, *, pending: set,
                 errors: dict[int, str], deaths: dict[int, int | None], fatal: dict[int, str],
                 stacks: dict[int, str], blocked: dict[int, str] | None = None) -> RankFailure:
    """The exception for a failed pool call: RankTimeout when no rank failed before the timeout.

    pending: the ranks that had not answered; errors: rank -> traceback; deaths: rank -> exit
    code; fatal: rank -> its fatal-signal dump; stacks: rank -> its stack at the end; blocked:
    rank -> the torch.distributed function it was blocked in."""
    blocked = blocked or {}
    timed_out = not errors and not deaths
    if timed_out:
        lines = [f"{what}: timed out after {timeout:g} s; {describe_ranks(pending)} had not "
                 f"returned. Every rank's Python stack follows; the ranks were killed."]
    elif deaths:
        # The death first: the survivors' errors (a closed connection) are its consequence.
        lines = [f"{what}: " + "; ".join(f"rank {r} {exit_story(deaths[r])}" for r in sorted(deaths))
                 + (f"; {describe_ranks(errors)} raised after that." if errors else ".")]
    else:
        lines = [f"{what}: {describe_ranks(errors)} failed."]
    for r in sorted(deaths):
        lines.append(f"--- rank {r} {exit_story(deaths[r])} (pid {pids[r]})")
        if fatal.get(r):
            lines.append(indent(fatal[r]))
    lines += raised_lines(errors)
    if pending and not timed_out:
        one = len(pending) == 1
        waited = (blocked_ranks({r: blocked[r] for r in pending}) if pending <= set(blocked) else
                  f"{describe_ranks(pending)} had not returned {FAILURE_GRACE:g} s after the failure")
        lines.append(f"{waited} and {'was' if one else 'were'} killed; {'its stack' if one else 'their stacks'}:")
    for r in range(world_size):
        if r in stacks and (timed_out or r in pending):
            state = "still running" if r in pending else "had returned"
            lines.append(f"--- rank {r} stack ({state}, pid {pids[r]}):")
            lines.append(indent(stacks[r] or "(no stack dumped)"))
    return (RankTimeout if timed_out else RankFailure)("\n".join(lines))


# ----------------------------------------------------------------------------------------------
# the launcher's report of an aborted call


def launcher_abort(what: str, reason: str, *, silent: set, errors: dict[int, str],
                   stacks: dict[int, str], tests: set, places: dict[int, str] | None = None,
                   dead: set = frozenset()) -> str:
    """silent: the ranks that posted nothing (dead: those of them seen to have exited); errors:
    rank -> the traceback it posted before the abort; stacks: rank -> the stack of a rank that
    had not returned; tests: the ranks' tests; places: rank -> where it runs, as in
    raised_lines. What became of the group comes after."""
    places = places or {}
    lines = [f"{what}: {reason}."]
    # A rank that died comes first: the others' errors are usually its consequence.
    for r in sorted(silent):
        how = ("its process exited" if r in dead else "or is stuck outside Python")
        lines.append(f"--- rank {r}{places.get(r, '')} sent nothing: it died ({how}; torchrun's log "
                     f"gives its exit code)")
    lines += raised_lines(errors, places)
    for r in sorted(stacks):
        lines.append(f"--- rank {r}{places.get(r, '')} stack at the abort (it had not returned):")
        lines.append(indent(stacks[r]))
    if len(tests) > 1:
        lines.append(f"The ranks were in different tests ({', '.join(sorted(tests))}): every "
                     f"rank must make the same spawn calls in the same order.")
    return "\n".join(lines)
