"""Home suites: a test's suite is the folder under suites/ it lives in (see suites/suites.toml).

Marks every collected item with suite(name) and, for GPU suites, gpus(n) so they skip on a
machine without enough GPUs; and gives a plain pytest run the suite's --tp/--cp/--linattn-*
defaults for options the user did not set.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pytest_linattn.suites import OPTIONS, given_flags, home_suite, load_suites, split_addopts, targeted_suites

_HEADER = pytest.StashKey[tuple]()
ROOT = Path(__file__).resolve().parent.parent
SUITES = load_suites(ROOT)

# Helpers shared by the tests of several suites (layer_parity.py) live here: importable by name
# under any --import-mode (prepend puts this folder on sys.path by itself, importlib does not).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def _user_flags(config) -> set[str]:
    # Everything that can carry an option: the command line, PYTEST_ADDOPTS and ini addopts.
    tokens = list(config.invocation_params.args)
    tokens += split_addopts(os.environ.get("PYTEST_ADDOPTS", ""))
    tokens += list(config.getini("addopts"))
    flags = given_flags(tokens)
    # The option's ini key (linattn_tp = "2" in [tool.pytest.ini_options]) counts as given too.
    for option in OPTIONS.values():
        try:
            if config.getini(option.ini):
                flags.add(option.flag)
        except ValueError:
            pass  # no such ini key registered
    return flags


def pytest_configure(config):
    # The plugin registers these markers; say what they are also when it is not loaded.
    known = {line.split("(")[0].split(":")[0].strip() for line in config.getini("markers")}
    for marker in ("suite(name): the test's home suite, the folder under suites/ it lives in",
                   "gpus(n): needs n GPUs, skipped on a machine with fewer"):
        if marker.split("(")[0] not in known:
            config.addinivalue_line("markers", marker)
    names = targeted_suites(config.args, config.invocation_params.dir, ROOT, SUITES)
    given = _user_flags(config)
    applied, conflicts = [], []
    for key, option in OPTIONS.items():
        if option.flag in given or not hasattr(config.option, option.dest):
            continue  # the user's value wins; no attribute means the plugin is not loaded
        values = {SUITES[n].option_values().get(key) for n in names}
        values.discard(None)
        if len(values) == 1:
            value = values.pop()
            setattr(config.option, option.dest, value)
            applied.append(f"{option.flag} {value}")
        elif len(values) > 1:
            # One pytest process has one value per option: run one suite at a time instead.
            conflicts.append(option.flag)
    config.stash[_HEADER] = (sorted(names), applied, conflicts)


def pytest_report_header(config):
    names, applied, conflicts = config.stash.get(_HEADER, ([], [], []))
    if not names:
        return None
    lines = [f"home suites: {', '.join(names)}" + (f"; defaults {', '.join(applied)}" if applied else "")]
    if conflicts:
        lines.append(f"suites disagree on {', '.join(conflicts)}: not defaulted; run one suite at a time "
                     "or use linattn-rerun")
    return lines


@pytest.hookimpl(tryfirst=True)  # before the plugin turns gpus(n) into skips
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = home_suite(item.path, ROOT, SUITES)
        if name is None:
            continue
        item.add_marker(pytest.mark.suite(name))
        if SUITES[name].gpus and item.get_closest_marker("gpus") is None:
            item.add_marker(pytest.mark.gpus(SUITES[name].gpus))
