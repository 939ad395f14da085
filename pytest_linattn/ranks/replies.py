"""A pool call's replies: one per rank, gathered until each rank answered, died, or the time ran out.

`gather_replies` only waits and sorts; what a failure means is the pool's (pytest_linattn.ranks.pool)
and the report's (pytest_linattn.ranks.reports).
"""
from __future__ import annotations

import multiprocessing.connection
import pickle
import time
import traceback
from dataclasses import dataclass, field

__all__ = ["Replies", "gather_replies"]


@dataclass
class Replies:
    """What the ranks of one call sent back, by rank."""

    pending: set[int]  # ranks that neither answered nor died
    values: dict[int, tuple] = field(default_factory=dict)  # the "ok" replies
    records: dict[int, list] = field(default_factory=dict)  # assert_parity records made on the rank
    calls: dict[int, list] = field(default_factory=dict)  # the collectives it recorded (pytest_linattn.mutation)
    errors: dict[int, str] = field(default_factory=dict)  # its traceback
    deaths: dict[int, int | None] = field(default_factory=dict)  # its exit code
    blocked: dict[int, str] = field(default_factory=dict)  # the torch.distributed function it is blocked in

    @property
    def complete(self) -> bool:
        return not self.pending and not self.errors and not self.deaths


def gather_replies(procs, conns, timeout: float, *, grace: float) -> Replies:
    """One reply per rank from `conns`, watching `procs` for deaths. After the first error or
    death the others get `grace` seconds more (their own errors make the report); ranks that
    wait in torch.distributed get none, as no grace helps them."""
    deadline = time.monotonic() + timeout
    out = Replies(pending=set(range(len(procs))))
    failed_at = None
    while out.pending:
        now = time.monotonic()
        if now >= deadline:
            break
        waitables = {}
        for r in out.pending:
            waitables[conns[r]] = r
            waitables[procs[r].sentinel] = r
        ready = multiprocessing.connection.wait(list(waitables), deadline - now)
        for r in sorted({waitables[w] for w in ready}):
            if r in out.pending:
                _take_reply(r, procs[r], conns[r], out)
        if (out.errors or out.deaths) and failed_at is None:
            failed_at = time.monotonic()
            deadline = min(deadline, failed_at + grace)
        if (out.errors or out.deaths) and out.pending <= set(out.blocked):
            break  # every rank still out waits in torch.distributed: no grace helps
    return out


def _take_reply(r: int, proc, conn, out: Replies) -> None:
    reply = None
    eof = False
    try:
        if conn.poll():
            reply = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        eof = True
    except Exception:
        reply = ("error", "the parent could not unpickle this rank's return value:\n" + traceback.format_exc())
    if reply is None:
        if proc.is_alive() and not eof:
            return  # spurious wakeup
        proc.join(2.0)  # a closed pipe means the rank is going away
        out.deaths[r] = proc.exitcode
        out.pending.discard(r)
        return
    if reply[0] == "blocked":  # in torch.distributed: pytest_linattn.ranks.blocked
        out.blocked[r] = reply[1]
        return
    out.pending.discard(r)
    if len(reply) > 2 and reply[2]:
        out.records[r] = reply[2]
    if len(reply) > 3 and reply[3] is not None:
        out.calls[r] = reply[3]
    if reply[0] == "error":
        out.errors[r] = reply[1]
    else:
        out.values[r] = reply
