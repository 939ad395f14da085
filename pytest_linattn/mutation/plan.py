"""In the test process: which run of a test is going on (the clean, recording run, or one
mutant's), what each spawn call tells its ranks, the calls the ranks saw, the mutants made from
them, and running them. Plain Python, no pytest, no torch.

A test's clean run records every rank's collectives, spawn call by spawn call. A mutant is one
recorded call (spawn call, site, op, occurrence) and one mutation that applies to it on every rank
that made that call. `run_mutants` reruns the test once per mutant (`run_test`, which raises when
the test fails) with that mutant active; `classify` names the outcome.
"""
from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable

from .mutations import MUTATIONS

__all__ = ["OUTCOMES", "Recording", "active_message", "calls_returned", "classify", "make_mutants",
           "recording", "run_mutants", "select"]

# killed: the test failed on an assertion (in the test process or on a rank). timeout: its ranks
# hung (counted as killed, shown apart). error: it failed otherwise (a rank raised a non-assertion
# exception or died, the call could not run): counted as killed, shown apart, as the test never
# reached its check; also a rerun that never made the mutant's call. survived: the test passed.
OUTCOMES = ("killed", "timeout", "error", "survived")

_ACTIVE = None  # the Recording of the run going on, or None


class Recording:
    """One run of a test: the spawn calls it made, the calls their ranks saw, the mutant applied.

    A spawn call is named by its function and how many calls of that function came before in
    the run (``module.function#1``), not by its place among all spawn calls: a test may cache
    one call's result (module state, a session fixture), so a rerun makes fewer calls."""

    def __init__(self, target: dict | None = None):
        self.target = target  # a mutant (make_mutants), applied in its spawn call
        self.seen: dict[str, int] = {}  # function -> its calls so far
        self.current = None
        self.calls: dict[str, dict[int, list]] = {}  # spawn call -> rank -> the rank's calls
        self.applied = False  # a rank applied the target

    def next_message(self, fn) -> dict | None:
        """What the next spawn call, of fn, tells its ranks (None: no interception)."""
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        self.seen[name] = self.seen.get(name, 0) + 1
        self.current = f"{name}#{self.seen[name]}"
        if self.target is None:
            return {"target": None, "interceptor": "both"}
        if self.target["call"] != self.current:
            return None
        return {"target": {k: self.target[k] for k in ("site", "op", "occurrence", "mutation")},
                "interceptor": self.target.get("interceptor", "mode")}

    def add(self, rank_calls: dict[int, list]) -> None:
        self.calls.setdefault(self.current, {}).update(rank_calls)
        self.applied = self.applied or any(rec.get("mutated") for calls in rank_calls.values() for rec in calls)


class recording:
    """``with recording(target) as run:`` every spawn call in the block is intercepted (or, for a
    mutant, the one it names)."""

    def __init__(self, target: dict | None = None):
        self.run = Recording(target)

    def __enter__(self) -> Recording:
        global _ACTIVE
        self.outer, _ACTIVE = _ACTIVE, self.run
        return self.run

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = self.outer


def active_message(fn) -> dict | None:
    """For spawn: the message its ranks get for the call of fn being made now (None: no run active)."""
    return None if _ACTIVE is None else _ACTIVE.next_message(fn)


def calls_returned(rank_calls: dict[int, list]) -> None:
    """For the pool: the ranks' recorded calls of the call just made (rank -> calls)."""
    if _ACTIVE is not None and rank_calls:
        _ACTIVE.add(rank_calls)


def make_mutants(calls: dict[int, dict[int, list]]) -> list[dict]:
    """Every mutant of a clean run: one per (spawn call, site, op, occurrence, mutation) applicable
    on every rank that made that call; ordered by site (first seen), spawn call, occurrence, mutation
    (so a bounded selection tries each mutation of a site's first call before its later calls)."""
    found: dict[tuple, dict] = {}
    made_by: dict[tuple, set] = {}
    for c in calls:
        for rank in sorted(calls[c]):
            for rec in calls[c][rank]:
                call_key = (c, rec["site"], rec["op"], rec["occurrence"])
                made_by.setdefault(call_key, set()).add(rank)
                for name in rec["mutations"]:
                    m = found.setdefault(call_key + (name,), {
                        "call": c, "site": rec["site"], "function": rec["function"], "caller": rec["caller"],
                        "op": rec["op"], "kind": rec["kind"], "occurrence": rec["occurrence"], "mutation": name,
                        "phase": rec["phase"], "group_size": rec["group_size"], "ranks": []})
                    m["ranks"].append(rank)
    site_order = {}
    for key in found:
        site_order.setdefault((key[1], key[2]), len(site_order))
    # the rank's library kernels alone, where in the clean run they saw every call its mode saw
    library = {c: all(rec.get("library_sees_all", False) for rank in calls[c] for rec in calls[c][rank])
               for c in calls}
    names = list(MUTATIONS)
    mutants = [m for key, m in found.items() if set(m["ranks"]) == made_by[key[:4]]]
    for m in mutants:
        m["interceptor"] = "library" if library[m["call"]] else "mode"
    call_order = {c: i for i, c in enumerate(calls)}
    mutants.sort(key=lambda m: (site_order[(m["site"], m["op"])], call_order[m["call"]], m["occurrence"],
                                names.index(m["mutation"])))
    return mutants


def select(mutants: list[dict], limit: int) -> list[dict]:
    """At most `limit` mutants, spread over the sites: each site's first before any site's second."""
    by_site: dict[tuple, list] = {}
    for m in mutants:
        by_site.setdefault((m["site"], m["op"]), []).append(m)
    chosen, depth = [], 0
    while len(chosen) < min(limit, len(mutants)):
        for queue in by_site.values():
            if depth < len(queue) and len(chosen) < limit:
                chosen.append(queue[depth])
        depth += 1
    return sorted(chosen, key=mutants.index)


_ASSERTION_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(?:AssertionError|Failed)\b", re.MULTILINE)


def classify(exc: BaseException | None) -> tuple[str, str]:
    """(outcome, a one-line detail) of a mutant run that raised `exc` (None: it passed)."""
    if exc is None:
        return "survived", ""
    name = type(exc).__name__
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    kinds = {k.__name__ for k in type(exc).__mro__}
    if "RankTimeout" in kinds:
        return "timeout", first
    if isinstance(exc, AssertionError) or name == "Failed":
        return "killed", f"{name}: {first}"
    if "RankFailure" in kinds:
        # A rank's traceback ending in an assertion: the test's own check failed there.
        return ("killed" if _ASSERTION_LINE.search(str(exc)) else "error"), f"{name}: {first}"
    return "error", f"{name}: {first}"


def run_mutants(run_test: Callable[[], None], mutants: list[dict], *,
                progress: Callable[[int, int, dict], None] | None = None) -> list[dict]:
    """Run the test once per mutant; each mutant's dict with its outcome, detail and seconds.
    Parity records a mutant run makes (wherever assert_parity ran) are dropped: they are not
    the test's."""
    parity = sys.modules.get("pytest_linattn.parity.check")
    keep = len(parity.RECORDS) if parity is not None else 0
    results = []
    for i, mutant in enumerate(mutants):
        start = time.monotonic()
        error = None
        with recording(mutant) as run:
            try:
                run_test()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - pytest's Failed/Skipped are BaseExceptions
                if type(exc).__name__ == "Exit":  # pytest.exit
                    raise
                error = exc
        parity = sys.modules.get("pytest_linattn.parity.check")
        if parity is not None:
            del parity.RECORDS[keep:]
        outcome, detail = classify(error)
        if not run.applied:  # the rerun never made the mutant's call: nothing was tested
            outcome, detail = "error", ("the mutant's call was not reached in the rerun (" +
                                        (f"the test failed before it: {detail}" if error else "the test passed") + ")")
        done = {**mutant, "bug_class": MUTATIONS[mutant["mutation"]].bug_class, "outcome": outcome,
                "detail": detail, "seconds": round(time.monotonic() - start, 3)}
        results.append(done)
        if progress is not None:
            progress(i + 1, len(mutants), done)
    return results
