"""Parsing of the plugin's option values; plain functions, no pytest.

Values arrive from the command line, ini files, or a conftest that sets ``config.option.tp``
itself, so every parser takes a string or an already-typed value.
"""
from __future__ import annotations

__all__ = ["DEFAULTS", "parse_autotune", "parse_device", "parse_sizes", "parse_switch", "parse_timeout"]

# Used when neither the command line, a conftest nor an ini key gives a value.
DEFAULTS = {"tp": "2", "cp": "2", "device": "auto", "timeout": "300", "fla_on_cpu": "off",
            "autotune": "shipped"}
DEVICES = ("cpu", "cuda", "auto")
# --linattn-autotune: what a run on CUDA does about Triton's config search (pytest_linattn.autotune)
AUTOTUNE_MODES = {
    "shipped": "the project's shipped fla configs, else the first config, never timed",
    "first": "the first config of every kernel, never timed",
    "search": "Triton's autotune: time every config",
}


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


SWITCH_VALUES = {"on": True, "true": True, "1": True, "yes": True,
                 "off": False, "false": False, "0": False, "no": False}


def parse_switch(value, name: str = "switch") -> bool:
    """'on' / 'off' (also true/false, 1/0, yes/no; a bool as is)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in SWITCH_VALUES:
        return SWITCH_VALUES[value.strip().lower()]
    raise ValueError(f"{name}: expected on or off, got {value!r}")


def parse_autotune(value, name: str = "autotune") -> str:
    """shipped | first | search (see AUTOTUNE_MODES)."""
    if isinstance(value, str) and value.strip().lower() in AUTOTUNE_MODES:
        return value.strip().lower()
    raise ValueError(f"{name}: expected one of {', '.join(AUTOTUNE_MODES)} "
                     f"({'; '.join(f'{k}: {v}' for k, v in AUTOTUNE_MODES.items())}), got {value!r}")
