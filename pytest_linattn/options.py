"""The plugin's options, one table, and the parsing of their values; plain Python, no pytest.

`OPTIONS` is the one place an option is known: its flag, `config.option` attribute, ini key,
default, parser and help text. The plugin registers the flags and ini keys from it and reads
every value through it; `pytest_linattn.suites` and suites/conftest.py look up the flags there.

Values arrive from the command line, ini files, or a conftest that sets ``config.option.tp``
itself, so every parser takes a string or an already-typed value.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULTS", "DEFAULT_TIMEOUT", "DEVICES", "OPTIONS", "Option", "parse_autotune", "parse_count",
           "parse_device", "parse_directory", "parse_sizes", "parse_switch", "parse_timeout", "read_value",
           "unparsed_value"]

DEVICES = ("cpu", "cuda", "auto")
DEFAULT_TIMEOUT = 300.0  # seconds one distributed call may take
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


def parse_count(value, name: str = "count") -> int:
    """A positive int, e.g. '2' or 2."""
    count = int(value.strip()) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return count


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


def parse_directory(value, name: str = "directory") -> str | None:
    """A directory path as given; None or '' for none."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a directory path, got {value!r}")
    return value


@dataclass(frozen=True)
class Option:
    """One plugin option. A value is looked up in this order: the command line, a value a
    conftest put in ``config.option.<dest>``, the ini key, `default`."""

    key: str  # the name the plugin (and suites/suites.toml) reads it by
    flag: str
    dest: str  # the config.option attribute
    ini: str
    default: str | None  # as an ini file would give it; None: unset
    parse: Callable[[Any, str], Any]  # (value, where it came from) -> the typed value
    help: str  # shared by the flag and the ini key
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # argparse checks these instead of `parse`
    bare_value: str | None = None  # what the flag means given without a value

    @property
    def description(self) -> str:
        """The help text of the flag and of the ini key."""
        return self.help if self.default is None else f"{self.help}; default {self.default}"

    def flag_arguments(self) -> dict:
        """argparse's arguments for the flag (pytest's ``addoption``). The default is None, so a
        flag not given stays unset: a conftest's value, the ini key or `default` fill it later."""
        how = dict(dest=self.dest, default=None, metavar=self.metavar, help=self.description)
        if self.choices:
            how["choices"] = list(self.choices)
        else:
            how["type"] = _argparse_type(self.parse, self.flag)
        if self.bare_value is not None:
            how.update(nargs="?", const=self.bare_value)
        return how


def _argparse_type(parse, flag):
    # Validates at parse time (a bad value is a usage error) but keeps the string as given.
    def check(value):
        try:
            parse(value, flag)
        except ValueError as exc:
            # argparse already names the option.
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None
        return value

    check.__name__ = flag.lstrip("-")
    return check


OPTIONS: dict[str, Option] = {o.key: o for o in (
    Option("tp", "--tp", "tp", "linattn_tp", "2", parse_sizes, metavar="SIZES",
           help="tensor-parallel sizes to run tp_size tests at: one size or a comma list, e.g. 4 or 2,4"),
    Option("cp", "--cp", "cp", "linattn_cp", "2", parse_sizes, metavar="SIZES",
           help="context-parallel sizes to run cp_size tests at: one size or a comma list"),
    Option("device", "--linattn-device", "linattn_device", "linattn_device", "auto", parse_device,
           choices=DEVICES,
           help="where spawn's ranks run: cpu (gloo), cuda (NCCL) or auto (cuda when a GPU is visible)"),
    Option("timeout", "--linattn-timeout", "linattn_timeout", "linattn_timeout", f"{DEFAULT_TIMEOUT:g}",
           parse_timeout, metavar="SECONDS", help="timeout of one distributed call, in seconds"),
    Option("fla_on_cpu", "--linattn-fla-on-cpu", "linattn_fla_on_cpu", "linattn_fla_on_cpu", "off",
           parse_switch, metavar="on|off", bare_value="on",
           help="run fla's linear-attention ops on linattn's float64 references in every test and rank, "
                "so fla-based layers run on a CPU"),
    Option("fla_interpreted", "--linattn-fla-interpreted", "linattn_fla_interpreted", "linattn_fla_interpreted",
           "off", parse_switch, metavar="on|off", bare_value="on",
           help="run fla's own Triton kernels under Triton's interpreter in every test and rank (float32 CPU "
                "tensors, slow: the fidelity mode); the process is set up at session start, before fla is imported"),
    Option("autotune", "--linattn-autotune", "linattn_autotune", "linattn_autotune", "shipped",
           parse_autotune, metavar="MODE",
           help="Triton's config search on CUDA runs (test process and ranks): shipped (the project's fla "
                "configs for this GPU, else each kernel's first config, nothing timed), first (first "
                "config only) or search (Triton's autotune)"),
    Option("ranks_per_gpu", "--linattn-ranks-per-gpu", "linattn_ranks_per_gpu", "linattn_ranks_per_gpu", "1",
           parse_count, metavar="N",
           help="on cuda, up to N ranks share a GPU: a test of W ranks runs on ceil(W / N) GPUs, its process "
                "groups on the staged transport (collectives staged through host memory over gloo, not NCCL; "
                "the kernels are the real ones) wherever ranks share one"),
    Option("report", "--linattn-report", "linattn_report", "linattn_report", None, parse_directory,
           metavar="DIR", help="write the parity report (JSON and error heatmaps) to this directory"),
    # collective mutation testing: pytest_linattn.mutation, docs/mutation.md
    Option("mutate_collectives", "--linattn-mutate-collectives", "linattn_mutate_collectives",
           "linattn_mutate_collectives", "off", parse_switch, metavar="on|off", bare_value="on",
           help="after each passing test that runs ranks, rerun it once per collective mutant (a collective "
                "skipped, doubled, reordered...) and report the mutants it did not notice; they fail the session"),
    Option("mutants_per_test", "--linattn-mutants-per-test", "linattn_mutants_per_test", "linattn_mutants_per_test",
           "32", parse_count, metavar="N", help="the most collective mutants run per test, spread over its call sites"),
)}
# Used when neither the command line, a conftest nor an ini key gives a value.
DEFAULTS = {key: o.default for key, o in OPTIONS.items() if o.default is not None}


def unparsed_value(config, key: str) -> tuple[Any, str]:
    """(the option's value as given, where it came from: its flag or ini key) from a pytest
    config, in `Option`'s order; the default is reported as coming from the flag."""
    option = OPTIONS[key]
    value = getattr(config.option, option.dest, None)
    if value is not None:
        return value, option.flag
    value = config.getini(option.ini)
    if value not in (None, ""):
        return value, option.ini
    return option.default, option.flag


def read_value(config, key: str):
    """The option's parsed value from a pytest config; ValueError naming the flag or ini key."""
    value, source = unparsed_value(config, key)
    return OPTIONS[key].parse(value, source)
