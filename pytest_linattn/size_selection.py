"""Which tp_size / cp_size values each test runs at; plain functions over pytest's items.

A test that uses the tp_size fixture runs at every size the run asks for (``--tp``), or at the
sizes it declares itself (``@pytest.mark.tp_sizes(2, 4)`` or a parametrize list); of those, the
sizes the run did not ask for are deselected, not failed, and a line of the summary names them.
Under torchrun the ranks are the launcher's, so a test runs only where tp x cp = WORLD_SIZE.
This module imports no pytest.
"""
from __future__ import annotations

import math

from .options import parse_sizes

__all__ = ["SIZE_FIXTURES", "marker_sizes", "parametrized_by_marker", "select", "unsupported_sizes"]

# fixture name -> (option key, the marker that declares a test's sizes)
SIZE_FIXTURES = {"tp_size": ("tp", "tp_sizes"), "cp_size": ("cp", "cp_sizes")}


def marker_sizes(marker) -> list[int]:
    """The sizes of ``tp_sizes(2, 4)`` or ``tp_sizes([2, 4])``; ValueError naming the marker."""
    args = marker.args
    sizes = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return parse_sizes(list(sizes), f"@pytest.mark.{marker.name}")


def parametrized_by_marker(definition, argname) -> bool:
    """Whether one of the test's own parametrize markers lists `argname`."""
    for marker in definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if argname in names:
            return True
    return False


def _params(item) -> dict:
    return getattr(getattr(item, "callspec", None), "params", {})


def select(items, wanted: dict[str, list[int]], launched: int | None = None):
    """(kept, deselected, notes) of the collected items. wanted: fixture name -> the sizes the
    run asked for; launched: torchrun's WORLD_SIZE, or None. notes: lines for the summary."""
    notes = unsupported_sizes(items, wanted)
    kept, deselected, unfit = [], [], []
    for item in items:
        params = _params(item)
        sizes = [params[argname] for argname in SIZE_FIXTURES if argname in params]
        if any(argname in params and params[argname] not in asked for argname, asked in wanted.items()):
            deselected.append(item)
        elif launched is not None and sizes and math.prod(sizes) != launched:
            unfit.append(item.nodeid)
            deselected.append(item)
        else:
            kept.append(item)
    if unfit:
        notes.append(f"{len(unfit)} test(s) deselected: under torchrun a test runs only where "
                     f"tp_size x cp_size = WORLD_SIZE={launched}: " + ", ".join(unfit))
    return kept, deselected, notes


def unsupported_sizes(items, wanted: dict[str, list[int]]) -> list[str]:
    """One line per test that does not support a size the run asked for (its marker or
    parametrize list lacks it), so a size asked for is never dropped without a word."""
    supported: dict[str, dict[str, set]] = {}
    for item in items:
        params = _params(item)
        test = item.nodeid.split("[", 1)[0]
        for argname in SIZE_FIXTURES:
            if argname in params:
                supported.setdefault(test, {}).setdefault(argname, set()).add(params[argname])
    notes = []
    for test, by_arg in supported.items():
        parts = []
        for argname, sizes in by_arg.items():
            key = SIZE_FIXTURES[argname][0]
            missing = [n for n in wanted[argname] if n not in sizes]
            if missing:
                parts.append(f"{key} {', '.join(map(str, missing))} asked for; the test supports "
                             f"{key} {', '.join(map(str, sorted(sizes)))}")
        if parts:
            notes.append(f"{test}: not run at " + "; ".join(parts))
    return notes
