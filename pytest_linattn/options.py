"""Parsing of the plugin's option values; plain functions, no pytest.

Values arrive from the command line, ini files, or a conftest that sets ``config.option.tp``
itself, so every parser takes a string or an already-typed value.
"""
from __future__ import annotations

__all__ = ["DEFAULTS", "parse_device", "parse_sizes", "parse_timeout"]

# Used when neither the command line, a conftest nor an ini key gives a value.
DEFAULTS = {"tp": "2", "cp": "2", "device": "auto", "timeout": "300"}
DEVICES = ("cpu", "cuda", "auto")


def parse_sizes(value, name: str = "sizes") -> list[int]:
    """'4' -> [4]; '2,4' -> [2, 4]; also an int or a list of ints. Sizes are positive; repeats
    are dropped, order kept."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size or a comma list of sizes, got {value!r}")
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if not value.strip() or any(not p for p in parts):
            raise ValueError(f"{name}: expected a size or a comma list of sizes like '2,4', "
                             f"got {value!r}")
        items = []
        for p in parts:
            try:
                items.append(int(p))
            except ValueError:
                raise ValueError(f"{name}: {p!r} in {value!r} is not an integer") from None
    elif isinstance(value, (list, tuple)) and value:
        items = list(value)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
            raise ValueError(f"{name}: sizes must be ints, got {value!r}")
    else:
        raise ValueError(f"{name}: expected a size or a comma list of sizes, got {value!r}")
    if any(v < 1 for v in items):
        raise ValueError(f"{name}: sizes must be >= 1, got {value!r}")
    return list(dict.fromkeys(items))


def parse_device(value, name: str = "device") -> str:
    if not isinstance(value, str) or value.strip() not in DEVICES:
        raise ValueError(f"{name}: expected one of {', '.join(DEVICES)}, got {value!r}")
    return value.strip()


def parse_timeout(value, name: str = "timeout") -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{name}: expected a positive finite number of seconds, got {value!r}")
    return seconds
