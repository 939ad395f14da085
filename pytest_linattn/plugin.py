"""pytest-linattn: options, markers and fixtures for multi-rank parity tests.

Loading (any one; they do not clash): the installed pytest11 entry point, ``pytest -p
pytest_linattn``, or ``pytest_plugins = ["pytest_linattn"]`` in a conftest. ``-p no:pytest_linattn``
turns it off.

Options (each also an ini key; the command line wins, then a value a conftest put in
``config.option.<dest>``, then the ini key, then the default):

    --tp SIZES              linattn_tp       one size or a comma list (``--tp 4``, ``--tp 2,4``); default 2
    --cp SIZES              linattn_cp       same for context parallel; default 2
    --linattn-device D      linattn_device   cpu | cuda | auto (cuda when a GPU is visible); default auto
    --linattn-timeout S     linattn_timeout  seconds per distributed call; default 300
    --linattn-report DIR    linattn_report   write the parity report (JSON + heatmaps) there
    --linattn-fla-on-cpu    linattn_fla_on_cpu   on | off: the fla_on_cpu fixture in every test; default off
    --linattn-autotune M    linattn_autotune shipped | first | search: Triton's config search on CUDA
                            (pytest_linattn.autotune); default shipped, i.e. no search

``config.option.tp`` / ``cp`` / ``linattn_device`` / ``linattn_timeout`` are None unless given on
the command line, so a conftest's pytest_configure may set suite defaults; they are read at
collection, not at configure.

Fixtures:

    tp_size, cp_size    a test that uses one runs once per requested size (ids ``tp2``, ``cp4``).
                        A test declares the sizes it supports with ``@pytest.mark.tp_sizes(2, 4)``
                        (``cp_sizes``) or ``@pytest.mark.parametrize("tp_size", [2, 4], indirect=True)``;
                        its sizes the run did not ask for are deselected, not failed.
    spawn               ``spawn(fn, world_size, *args, **kwargs)`` runs fn on every rank with
                        torch.distributed initialised and returns the ranks' values in rank order,
                        tensors on CPU. fn must be module-level (pickled by reference). Rank pools
                        persist per (world size, device) for the session. ``spawn.timeout = 5``
                        changes this test's timeout. Under torchrun (WORLD_SIZE set) fn runs on the
                        launcher's process group and every rank gets the gathered list; only
                        rank 0 reports, tests run where tp_size x cp_size = WORLD_SIZE, and a
                        failure that breaks the group stops the session (pytest_linattn.launcher).
    fla_on_cpu          fla's public ops emulated on linattn's float64 references, in the test
                        and in every rank spawn runs (linattn.emulation.fla_on_cpu)
    packed_seqlens      pytest_linattn.seqlens.packed_seqlens
    float64_reference   pytest_linattn.float64.float64_reference

Markers: ``world_size(n)`` (the ranks a test needs: skipped on cuda without n GPUs),
``gpus(n)`` (skipped when the machine, or the run's device choice, has fewer than n GPUs),
``suite(name)`` (the test's home suite), ``tp_sizes(*sizes)``, ``cp_sizes(*sizes)``.

The logic lives in plain modules (pool, gpus, options, parity, seqlens, float64); this module
only wires them into pytest.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import pytest

from . import options as _opts

_STATE = pytest.StashKey["_State"]()

# name -> (flag, config.option dest, ini key, parser)
_OPTIONS = {
    "tp": ("--tp", "tp", "linattn_tp", _opts.parse_sizes),
    "cp": ("--cp", "cp", "linattn_cp", _opts.parse_sizes),
    "device": ("--linattn-device", "linattn_device", "linattn_device", _opts.parse_device),
    "timeout": ("--linattn-timeout", "linattn_timeout", "linattn_timeout", _opts.parse_timeout),
    "fla_on_cpu": ("--linattn-fla-on-cpu", "linattn_fla_on_cpu", "linattn_fla_on_cpu", _opts.parse_switch),
    "autotune": ("--linattn-autotune", "linattn_autotune", "linattn_autotune", _opts.parse_autotune),
}
_SIZE_FIXTURES = {"tp_size": ("tp", "tp_sizes"), "cp_size": ("cp", "cp_sizes")}


def _argtype(parse, flag):
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


def pytest_addoption(parser):
    group = parser.getgroup("linattn", "linear-attention distributed tests (pytest-linattn)")
    group.addoption("--tp", dest="tp", default=None, metavar="SIZES",
                    type=_argtype(_opts.parse_sizes, "--tp"),
                    help="tensor-parallel sizes to run tp_size tests at: one size or a comma "
                         "list, e.g. 4 or 2,4 (ini: linattn_tp; default 2)")
    group.addoption("--cp", dest="cp", default=None, metavar="SIZES",
                    type=_argtype(_opts.parse_sizes, "--cp"),
                    help="context-parallel sizes to run cp_size tests at (ini: linattn_cp; default 2)")
    group.addoption("--linattn-device", dest="linattn_device", default=None,
                    choices=list(_opts.DEVICES),
                    help="where spawn's ranks run: cpu (gloo), cuda (NCCL) or auto "
                         "(ini: linattn_device; default auto)")
    group.addoption("--linattn-timeout", dest="linattn_timeout", default=None, metavar="SECONDS",
                    type=_argtype(_opts.parse_timeout, "--linattn-timeout"),
                    help="timeout of one distributed call, in seconds (ini: linattn_timeout; "
                         "default 300)")
    group.addoption("--linattn-fla-on-cpu", dest="linattn_fla_on_cpu", default=None,
                    type=_argtype(_opts.parse_switch, "--linattn-fla-on-cpu"), metavar="on|off",
                    nargs="?", const="on",
                    help="run fla's linear-attention ops on linattn's float64 references in every "
                         "test and rank, so fla-based layers run on a CPU (ini: "
                         "linattn_fla_on_cpu; default off)")
    group.addoption("--linattn-autotune", dest="linattn_autotune", default=None, metavar="MODE",
                    type=_argtype(_opts.parse_autotune, "--linattn-autotune"),
                    help="Triton's config search on CUDA runs (test process and ranks): shipped "
                         "(the project's fla configs for this GPU, else each kernel's first config, "
                         "nothing timed), first (first config only) or search (Triton's autotune) "
                         "(ini: linattn_autotune; default shipped)")
    group.addoption("--linattn-report", dest="linattn_report", default=None, metavar="DIR",
                    help="write the parity report (JSON and error heatmaps) to DIR "
                         "(ini: linattn_report)")
    parser.addini("linattn_tp", "default for --tp", default="")
    parser.addini("linattn_cp", "default for --cp", default="")
    parser.addini("linattn_device", "default for --linattn-device", default="")
    parser.addini("linattn_timeout", "default for --linattn-timeout", default="")
    parser.addini("linattn_report", "default for --linattn-report", default="")
    parser.addini("linattn_fla_on_cpu", "default for --linattn-fla-on-cpu (on/off)", default="")
    parser.addini("linattn_autotune", "default for --linattn-autotune (shipped/first/search)", default="")


def _raw(config, key):
    flag, dest, ini, _ = _OPTIONS[key]
    value = getattr(config.option, dest, None)
    if value is not None:
        return value, flag
    value = config.getini(ini)
    if value not in (None, ""):
        return value, ini
    return _opts.DEFAULTS[key], flag


def _value(config, key):
    """The option's parsed value, read now (a conftest may have changed it since configure)."""
    value, source = _raw(config, key)
    try:
        return _OPTIONS[key][3](value, source)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


class _State:
    def __init__(self, config):
        self.config = config
        self.manager = None
        self.report_paths = []
        self.report_notes = []  # lines about the report (a PNG not drawn), printed in the summary
        self.is_worker = hasattr(config, "workerinput")
        # Where this session's records begin: an in-process nested run (pytester) shares the
        # module-level lists with the outer one, and each must summarise only its own checks.
        parity = _parity_module()
        self.records_start = len(parity.RECORDS) if parity is not None else 0
        self.sent = self.records_start
        self.controller_start = len(_CONTROLLER_RECORDS)
        self.autotune = None  # the applied pytest_linattn.autotune plan; None until session start
        self.launcher = None  # pytest_linattn.launcher.LauncherSession under torchrun
        self.size_notes = []  # lines for the terminal summary: sizes asked for but not run

    def pools(self):
        if self.manager is None:
            from .pool import PoolManager

            self.manager = PoolManager(_value(self.config, "device"))
        return self.manager

    def close(self):
        if self.launcher is not None:
            self.launcher.finish()
            if self.launcher.terminal_fd is not None:
                os.close(self.launcher.terminal_fd)
            self.launcher = None
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        if self.autotune is not None:
            from . import autotune

            autotune.restore()
            self.autotune = None

    def apply_autotune(self):
        """On CUDA, before any kernel and any pool: the autotune mode, in this process and (through
        the environment) in every rank. Once per session; None on a CPU run."""
        if self.autotune is None and self.runs_on_cuda():
            from . import autotune

            self.autotune = autotune.apply(_value(self.config, "autotune"))
        return self.autotune

    def runs_on_cuda(self):
        from .pool import resolve_device  # auto: cuda when a GPU is visible

        return resolve_device(_value(self.config, "device")) == "cuda"


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    for line in (
        "world_size(n): the test runs n ranks; skipped on cuda with fewer than n GPUs",
        "gpus(n): skipped when the machine (or --linattn-device) has fewer than n GPUs",
        "suite(name): the test's home suite (suites/<name>), used by linattn-rerun",
        "tp_sizes(*sizes): the tensor-parallel sizes the test supports; others are deselected",
        "cp_sizes(*sizes): the context-parallel sizes the test supports; others are deselected",
    ):
        config.addinivalue_line("markers", line)
    state = config.stash[_STATE] = _State(config)
    from .launcher import launcher_world_size

    world_size = launcher_world_size()
    if world_size is not None and not state.is_worker:
        _start_launcher_mode(config, state, world_size)


def _start_launcher_mode(config, state, world_size):
    # Under torchrun every rank runs this session; only rank 0 reports.
    from .launcher import LauncherSession, launcher_rank

    rank = launcher_rank()
    # A copy of the terminal, for a report written while pytest's capture holds fd 1.
    state.launcher = LauncherSession(rank, world_size, terminal_fd=os.dup(1))
    state.launcher.install_signal_handlers()
    if rank != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
        # Nor a JUnit file: every rank would write the same path.
        from _pytest.junitxml import xml_key

        xml = config.stash.get(xml_key, None)
        if xml is not None:
            config.pluginmanager.unregister(xml)
            del config.stash[xml_key]


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    # Fail early on bad ini values too (command-line values were checked by argparse).
    for key in _OPTIONS:
        _value(session.config, key)
    session.config.stash[_STATE].apply_autotune()


def pytest_report_header(config):
    # Called at session start, before the hook above: apply here too, so the header can say it.
    plan = config.stash[_STATE].apply_autotune()
    return None if plan is None else plan.describe()


def pytest_unconfigure(config):
    state = config.stash.get(_STATE, None)
    if state is not None:
        state.close()


# ----------------------------------------------------------------------------------------------
# tp_size / cp_size parametrization


def _marker_sizes(marker, name):
    sizes = marker.args[0] if len(marker.args) == 1 and isinstance(marker.args[0], (list, tuple)) \
        else marker.args
    return _opts.parse_sizes(list(sizes), f"@pytest.mark.{name}")


def _parametrized_by_marker(metafunc, argname) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if argname in names:
            return True
    return False


def _is_ours(metafunc, argname) -> bool:
    # A project may define its own tp_size fixture: then it decides, not us.
    defs = getattr(metafunc, "_arg2fixturedefs", {}).get(argname)
    if not defs:
        return False
    func = getattr(defs[-1], "func", None)
    return getattr(func, "__module__", None) == __name__


def pytest_generate_tests(metafunc):
    for argname, (key, marker_name) in _SIZE_FIXTURES.items():
        if argname not in metafunc.fixturenames or not _is_ours(metafunc, argname):
            continue
        if _parametrized_by_marker(metafunc, argname):
            continue  # the test's own list; sizes not asked for are deselected later
        marker = metafunc.definition.get_closest_marker(marker_name)
        sizes = _marker_sizes(marker, marker_name) if marker else _value(metafunc.config, key)
        metafunc.parametrize(argname, sizes, indirect=True, ids=[f"{key}{n}" for n in sizes])


def pytest_collection_modifyitems(config, items):
    wanted = {argname: _value(config, key) for argname, (key, _) in _SIZE_FIXTURES.items()}
    state = config.stash[_STATE]
    state.size_notes = _unsupported_sizes(items, wanted)
    launched = state.launcher.world_size if state.launcher is not None else None
    kept, deselected, unfit = [], [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        sizes = [params[argname] for argname in _SIZE_FIXTURES if argname in params]
        if any(argname in params and params[argname] not in asked
               for argname, asked in wanted.items()):
            deselected.append(item)
        elif launched is not None and sizes and math.prod(sizes) != launched:
            # Under torchrun the ranks are the launcher's: a test runs at tp x cp = WORLD_SIZE.
            unfit.append(item.nodeid)
            deselected.append(item)
        else:
            kept.append(item)
    if unfit:
        state.size_notes.append(
            f"{len(unfit)} test(s) deselected: under torchrun a test runs only where "
            f"tp_size x cp_size = WORLD_SIZE={launched}: " + ", ".join(unfit))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def _unsupported_sizes(items, wanted) -> list[str]:
    """One line per test that does not support a size the run asked for (its marker or
    parametrize list lacks it), so a size asked for is never dropped without a word."""
    supported: dict[str, dict[str, set]] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        test = item.nodeid.split("[", 1)[0]
        for argname in _SIZE_FIXTURES:
            if argname in params:
                supported.setdefault(test, {}).setdefault(argname, set()).add(params[argname])
    notes = []
    for test, by_arg in supported.items():
        parts = []
        for argname, sizes in by_arg.items():
            key = _SIZE_FIXTURES[argname][0]
            missing = [n for n in wanted[argname] if n not in sizes]
            if missing:
                parts.append(f"{key} {', '.join(map(str, missing))} asked for; the test supports "
                             f"{key} {', '.join(map(str, sorted(sizes)))}")
        if parts:
            notes.append(f"{test}: not run at " + "; ".join(parts))
    return notes


def _size_fixture(request, key):
    if hasattr(request, "param"):
        return request.param
    return _value(request.config, key)[0]


@pytest.fixture
def tp_size(request) -> int:
    """The tensor-parallel size of this run of the test (one per --tp size)."""
    return _size_fixture(request, "tp")


@pytest.fixture
def cp_size(request) -> int:
    """The context-parallel size of this run of the test (one per --cp size)."""
    return _size_fixture(request, "cp")


# ----------------------------------------------------------------------------------------------
# markers that skip


def _marker_int(marker) -> int:
    value = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"@pytest.mark.{marker.name}: n must be a non-negative int, got {value!r}")
    return value


def _skip(reason):
    __tracebackhide__ = True
    try:
        # Reported at the test's location, as a skip mark would be, not at this line.
        raise pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:  # pragma: no cover - older pytest
        pytest.skip(reason)


def pytest_runtest_setup(item):
    gpus = item.get_closest_marker("gpus")
    world = item.get_closest_marker("world_size")
    if gpus is not None or world is not None:
        device = _value(item.config, "device")
        if gpus is not None and device == "cpu":
            _skip(f"needs {_marker_int(gpus)} GPU(s); this run uses --linattn-device cpu")
        if device != "cpu":
            from .gpus import gpu_count

            have = gpu_count()
            if gpus is not None and have < _marker_int(gpus):
                _skip(f"needs {_marker_int(gpus)} GPU(s) (gpus({_marker_int(gpus)})); "
                      f"this machine has {have}")
            # world_size(n) needs n GPUs only when the ranks run on GPUs (auto with none: CPU).
            if world is not None and (device == "cuda" or have > 0) and have < _marker_int(world):
                _skip(f"needs {_marker_int(world)} GPU(s) (world_size({_marker_int(world)})); "
                      f"this machine has {have}")
    _set_parity_test(item.nodeid)


# ----------------------------------------------------------------------------------------------
# spawn


class Spawn:
    """``spawn(fn, world_size, *args, **kwargs)``: fn on every rank; values in rank order."""

    def __init__(self, state: _State, timeout: float, item=None):
        self._state = state
        self.timeout = timeout
        self._item = item

    def __call__(self, fn, world_size, *args, **kwargs):
        __tracebackhide__ = True
        from . import pool

        device = _value(self._state.config, "device")
        try:
            if self._state.launcher is not None:
                return self._in_launcher(fn, world_size, args, kwargs, pool.resolve_device(device))
            if pool.launcher_world_size() is not None:  # WORLD_SIZE set in an xdist worker
                return pool.run_in_launcher(fn, world_size, args, kwargs,
                                            device=pool.resolve_device(device),
                                            timeout=self.timeout)
            return self._state.pools().run(fn, world_size, args, kwargs, timeout=self.timeout,
                                           fla_on_cpu=_active_fla_emulation())
        except pool.NotEnoughGpus as exc:
            pytest.skip(f"spawn(world_size={world_size}): {exc}")
        except pool.RankFailure as exc:
            # Re-raised here so the report ends at the test's call, not inside the pool.
            raise type(exc)(str(exc)) from None


    def _in_launcher(self, fn, world_size, args, kwargs, device):
        __tracebackhide__ = True
        from .launcher import BrokenGroup

        try:
            return self._state.launcher.run(fn, world_size, args, kwargs, device=device,
                                            timeout=self.timeout,
                                            test=getattr(self._item, "nodeid", ""))
        except BrokenGroup:
            if self._item is not None:
                # A collective was left half done: every later distributed test would fail or
                # hang on this group, so the session stops after this test, on every rank.
                self._item.session.shouldfail = (
                    f"linattn: the process group is broken after a failure in "
                    f"{self._item.nodeid}; the session stops (see that test's report)")
            raise


def _active_fla_emulation():
    # The ranks run fla's ops emulated whenever the test process does (fixture, option or a
    # `with fla_on_cpu():` around spawn); sys.modules, so a run that never emulates imports nothing.
    emulation = sys.modules.get("linattn.emulation.patching")
    return None if emulation is None else emulation.active_compute_dtype()


@pytest.fixture
def spawn(request) -> Spawn:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks with torch.distributed initialised;
    returns the ranks' return values in rank order, tensors moved to CPU."""
    return Spawn(request.config.stash[_STATE], _value(request.config, "timeout"), request.node)


# ----------------------------------------------------------------------------------------------
# fla on the CPU


@pytest.fixture
def fla_on_cpu():
    """fla's public linear-attention ops computed with linattn's float64 references, in the
    test and in every rank spawn runs during it (``linattn.emulation.fla_on_cpu``); yields the
    compute dtype. ``--linattn-fla-on-cpu`` turns it on for every test of a run."""
    import torch

    from linattn.emulation import fla_on_cpu as emulation

    with emulation(torch.float64):
        yield torch.float64


@pytest.fixture(autouse=True)
def _fla_on_cpu_for_the_run(request):
    if not _value(request.config, "fla_on_cpu"):
        yield
        return
    request.getfixturevalue("fla_on_cpu")
    yield


# ----------------------------------------------------------------------------------------------
# parity, packed sequences, float64 references


@pytest.fixture
def packed_seqlens():
    """``packed_seqlens(total_tokens, num_seqs=None, *, seed=None, min_len=1, cp_size=1,
    layout="contiguous")``: random cu_seqlens for a packed batch."""
    from .seqlens import packed_seqlens as fn

    return fn


@pytest.fixture
def float64_reference():
    """``float64_reference(module, *inputs, grad_output=None)``: the module re-run in float64."""
    from .float64 import float64_reference as fn

    return fn


def _parity_module():
    # Only when a test imported it: the plugin stays cheap for runs that never compare tensors.
    return sys.modules.get("pytest_linattn.parity")


def _set_parity_test(nodeid):
    parity = _parity_module()
    if parity is not None:
        parity.set_current_test(nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _set_parity_test(item.nodeid)
    return (yield)


def _plain(obj):
    # Records cross to the xdist controller through execnet: plain data only.
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return _plain(tolist())
    return str(obj)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    state = item.config.stash.get(_STATE, None)
    parity = _parity_module()
    if state is not None and state.is_worker and parity is not None:
        new = parity.RECORDS[state.sent:]
        state.sent = len(parity.RECORDS)
        if new:
            report.linattn_parity = _plain(new)
    if call.when == "teardown" and parity is not None:
        parity.set_current_test(None)
    return report


def pytest_runtest_logreport(report):
    records = getattr(report, "linattn_parity", None)
    if records:
        # Only xdist workers attach records, so only the controller gets here.
        _CONTROLLER_RECORDS.extend(records)


# Records sent by xdist workers (the logreport hook gets no config to hang them on).
_CONTROLLER_RECORDS: list[dict] = []


def _all_records(config) -> list[dict]:
    state = config.stash.get(_STATE, None)
    if state is not None and state.is_worker:
        return []
    parity = _parity_module()
    local = parity.RECORDS[state.records_start:] if parity is not None else []
    # In a worker-less run the logreport hook never sees linattn_parity (only workers set it).
    return _CONTROLLER_RECORDS[state.controller_start:] + local


def _report_dir(config):
    value = config.option.linattn_report or config.getini("linattn_report")
    return value or None


def pytest_sessionfinish(session):
    config = session.config
    state = config.stash.get(_STATE, None)
    directory = _report_dir(config)
    if state is None or state.is_worker or not directory:
        return
    records = _all_records(config)
    from . import parity  # needed for the writer even when no test compared anything

    try:
        state.report_paths = parity.write_report(records, directory, notes=state.report_notes)
    except Exception as exc:  # noqa: BLE001 - a report file must never hide the test failures
        state.report_notes.append(f"linattn report not written: {exc!r}")


def pytest_terminal_summary(terminalreporter, config):
    state = config.stash.get(_STATE, None)
    if state is None or state.is_worker:
        return
    # Not with --collect-only, whose output lists node ids (one per line) for tools to read.
    if state.size_notes and not config.option.collectonly:
        terminalreporter.write_sep("=", "linattn sizes not run")
        for line in state.size_notes:
            terminalreporter.write_line(line)
    records = _all_records(config)
    if records:
        from . import parity

        text = parity.format_summary(records)
        if text:
            terminalreporter.write_sep("=", "linattn parity")
            terminalreporter.write_line(text)
    if state.report_paths:
        terminalreporter.write_line(f"linattn report: {len(state.report_paths)} file(s) in "
                                    f"{os.path.dirname(str(state.report_paths[0]))}")
    for note in state.report_notes:
        terminalreporter.write_line(note)
