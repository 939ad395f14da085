"""Collective-mutant results: which mutants a test declares equivalent, the per-test score, the
session table, and `collective-mutants.json`. Plain Python, no pytest, no torch."""
from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path

from .mutations import MUTATIONS

__all__ = ["JSON_NAME", "equivalence_rule", "equivalent_reason", "format_summary", "score", "survivors",
           "write_json"]

JSON_NAME = "collective-mutants.json"
KILLED = ("killed", "timeout", "error")  # each counts as the test noticing the mutant


def equivalence_rule(args: tuple, kwargs: dict) -> tuple[str, str, str]:
    """``equivalent_mutant(site_or_function, mutation="*", reason=...)`` -> (match, mutation, reason);
    ValueError naming the rule that is broken."""
    where = "@pytest.mark.equivalent_mutant"
    kwargs = dict(kwargs)
    args = list(args)
    match = args.pop(0) if args else kwargs.pop("match", None)
    mutation = args.pop(0) if args else kwargs.pop("mutation", "*")
    reason = args.pop(0) if args else kwargs.pop("reason", None)
    if args or kwargs:
        raise ValueError(f"{where}: takes (site_or_function, mutation='*', reason=...); got extra "
                         f"{args or ''}{kwargs or ''}")
    if not isinstance(match, str) or not match:
        raise ValueError(f"{where}: the first argument is a site ('path:line', glob allowed) or a function "
                         f"name to match, got {match!r}")
    if not isinstance(mutation, str) or not (mutation in MUTATIONS or any(fnmatch(m, mutation) for m in MUTATIONS)):
        raise ValueError(f"{where}: mutation must name one of {', '.join(MUTATIONS)} (a glob allowed), "
                         f"got {mutation!r}")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"{where}: reason= is required: say why the mutant cannot change the result")
    return match, mutation, reason


def equivalent_reason(mutant: dict, rules) -> str | None:
    """The reason of the first rule matching the mutant's site (or its path, its function, or its
    caller ``path:line function``) and mutation; None when none does."""
    path = mutant["site"].rsplit(":", 1)[0]
    for match, mutation, reason in rules:
        where = any(fnmatch(s, match) for s in (mutant["site"], path, mutant["function"], mutant.get("caller", "")))
        if where and fnmatch(mutant["mutation"], mutation):
            return reason
    return None


def score(results: list[dict]) -> tuple[int, int]:
    """(killed, counted): mutants declared equivalent are not counted."""
    counted = [r for r in results if not r.get("equivalent")]
    return sum(r["outcome"] in KILLED for r in counted), len(counted)


def survivors(results: list[dict]) -> list[dict]:
    return [r for r in results if r["outcome"] == "survived" and not r.get("equivalent")]


def describe(r: dict) -> str:
    """One mutant in words: site, function, op, mutation, which call, phase."""
    return (f"{r['site']} ({r['function']}) {r['op']} {r['mutation']} [{r['phase']}, in spawn call "
            f"{r['call'].rsplit('.', 1)[-1]}, call {r['occurrence'] + 1} there]")


def score_line(test: str, summary: dict, results: list[dict]) -> str:
    killed, counted = score(results)
    counts = {o: sum(r["outcome"] == o for r in results if not r.get("equivalent")) for o in
              ("killed", "timeout", "error", "survived")}
    equivalent = sum(bool(r.get("equivalent")) for r in results)
    bound = "" if summary["mutants_run"] == summary["mutants_total"] else f" of {summary['mutants_total']}"
    return (f"{test}: {killed}/{counted} killed ({counts['killed']} failed, {counts['timeout']} timeout, "
            f"{counts['error']} error), {counts['survived']} survived, {equivalent} equivalent; "
            f"{summary['mutants_run']}{bound} mutants of {summary['calls']} collective calls on the ranks")


def format_summary(tests: list[dict]) -> str:
    """The session table (one line per test) and every survivor and equivalent mutant.
    `tests`: {"test", "summary", "results"} per test."""
    lines = []
    all_results = [r for t in tests for r in t["results"]]
    killed, counted = score(all_results)
    for t in tests:
        lines.append(score_line(t["test"], t["summary"], t["results"]))
    for t in tests:
        for r in t["results"]:
            if r["outcome"] == "survived" and not r.get("equivalent"):
                lines.append(f"SURVIVED {t['test']}: {describe(r)}\n    bug class: {r['bug_class']}")
            elif r.get("equivalent"):
                lines.append(f"EQUIVALENT ({r['outcome']}) {t['test']}: {describe(r)}\n    reason: {r['equivalent']}")
            elif r["outcome"] in ("timeout", "error"):
                lines.append(f"{r['outcome'].upper()} {t['test']}: {describe(r)}: {r['detail']}")
    left = len(survivors(all_results))
    lines.append(f"total: {killed}/{counted} mutants killed in {len(tests)} test(s); {left} survived"
                 + ("; the session fails" if left else ""))
    return "\n".join(lines)


def write_json(tests: list[dict], directory) -> Path:
    """`collective-mutants.json`: one object per mutant run, the test's node id in each."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / JSON_NAME
    rows = [{"test": t["test"], **r} for t in tests for r in t["results"]]
    path.write_text(json.dumps(rows, indent=1))
    return path
