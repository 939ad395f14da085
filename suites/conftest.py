"""Home suites: a test's suite is the folder under suites/ it lives in (see suites/suites.toml).

Marks every collected item with suite(name) and, for GPU suites, gpus(n) so they skip on a
machine without enough GPUs; and gives a plain pytest run the suite's --tp/--cp/--linattn-*
defaults for options the user did not set, and a run of one whole suite (plain `pytest`, or
`pytest suites/<name>`) the xdist workers its pytest_args name (-n, --dist).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pytest_linattn.suites import OPTIONS, given_flags, home_suite, load_suites, split_addopts, targeted_suites

_HEADER = pytest.StashKey[tuple]()
_WORKERS = pytest.StashKey[list]()
ROOT = Path(__file__).resolve().parent.parent
SUITES = load_suites(ROOT)

# Helpers shared by the tests of several suites (cases/layer_parity.py) live here: importable by name
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


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns -n into workers
def pytest_cmdline_main(config):
    """A run of one whole suite takes the -n / --dist of the suite's pytest_args (cpu: -n 2, the
    cores of the 2-core machines it runs on), unless the user chose (-n, --dist, --tx, or -p
    no:xdist), runs under torchrun (WORLD_SIZE), or debugs (--pdb, --trace), or the machine has
    fewer GPUs than the suite needs (its tests skip). A run of some files
    or tests does not: two workers' start-up would cost it more than they save. Nor does an xdist
    worker, which calls this hook too, with -n reset: it would start workers of its own."""
    if (hasattr(config, "workerinput") or config.pluginmanager.get_plugin("xdist") is None
            or os.environ.get("WORLD_SIZE")
            or config.option.numprocesses is not None or config.option.dist != "no" or config.option.tx
            or config.getoption("usepdb", False) or config.getoption("trace", False)):
        return None
    base = config.rootpath if config.args_source == pytest.Config.ArgsSource.TESTPATHS else config.invocation_params.dir
    dirs = {(Path(base) / arg).resolve() for arg in config.args}
    names = [n for n in SUITES if (ROOT / "suites" / n).resolve() in dirs]
    if len(dirs) != 1 or len(names) != 1:
        return None
    if SUITES[names[0]].gpus:
        from pytest_linattn.ranks.gpus import gpu_count

        if gpu_count() < SUITES[names[0]].gpus:
            return None  # its tests skip: no worker needed
    args = list(SUITES[names[0]].pytest_args)
    applied = []
    for flag, dest in (("-n", "numprocesses"), ("--dist", "dist")):
        if flag in args[:-1]:
            value = args[args.index(flag) + 1]
            setattr(config.option, dest, int(value) if dest == "numprocesses" and value.isdigit() else value)
            applied.append(f"{flag} {value}")
    if not SUITES[names[0]].gpus and (config.option.numprocesses or 0) > 1 and _start_workers_warm():
        applied.append("workers forked from one server")
    config.stash[_WORKERS] = applied
    return None


# What every worker's collection imports and no pytest rewrites: imported once, in the server the
# workers are forked from (about 6 s of CPU each on the 2-core machine: torch, fla, transformers).
WORKER_PRELOAD = ("torch", "torch.distributed", "numpy", "einops", "transformers", "transformers.modeling_layers",
                  "transformers.models.auto.auto_factory")
WARM_WORKERS_ENV = "LINATTN_WARM_WORKERS"


def _start_workers_warm() -> bool:
    """xdist starts each worker as `sys.executable -c ...`, cold: point sys.executable at a warm
    python (tools/warm_python.py) whose programs are forks of one server that imported
    WORKER_PRELOAD (and fla, where a pool may preload it); each worker then sets its own
    sys.executable back to the real interpreter, so what its tests start is cold as before."""
    from pytest_linattn.ranks import servers
    from tools import warm_python

    if not servers.can_fork_from_servers("cpu"):
        return False
    stage = servers.FLA_ROOT_PRELOAD if servers.can_preload_fla("cpu") else servers.ROOT_PRELOAD
    server = servers.preloaded_server(stage + WORKER_PRELOAD[len(servers.ROOT_PRELOAD):])
    os.environ[WARM_WORKERS_ENV] = "1"
    sys.executable = warm_python.warm_python_command(os.environ, server._forkserver_address)
    return True


if os.environ.get(WARM_WORKERS_ENV) and os.environ.get("PYTEST_XDIST_WORKER"):
    # a worker forked by the warm python: its tests' processes start as they would without it
    from tools import warm_python as _warm

    sys.executable = os.environ[_warm.REAL_PYTHON_ENV]
    for _key in (WARM_WORKERS_ENV, _warm.ADDRESS_ENV):
        os.environ.pop(_key, None)
    from pytest_linattn.ranks import servers as _servers

    _servers.fla_stage_from_parent_server()  # its fla pools' ranks: forks of the workers' server too


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
    config.stash[_HEADER] = (sorted(names), applied + config.stash.get(_WORKERS, []), conflicts)


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
