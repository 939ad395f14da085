"""pytest-linattn: options, markers and fixtures for multi-rank parity tests.

Loading (any one; they do not clash): the installed pytest11 entry point, ``pytest -p
pytest_linattn``, or ``pytest_plugins = ["pytest_linattn"]`` in a conftest. ``-p no:pytest_linattn``
turns it off.

Options: one table, ``pytest_linattn.options.OPTIONS`` (``pytest --help`` shows it): ``--tp``,
``--cp``, ``--linattn-device``, ``--linattn-timeout``, ``--linattn-report``, ``--linattn-fla-on-cpu``,
``--linattn-fla-interpreted``, ``--linattn-autotune``, ``--linattn-mutate-collectives``,
``--linattn-mutants-per-test``, each also an ini key (``linattn_tp``, ...).
A value is the command line's, else one a conftest put in ``config.option.<dest>`` (None unless
given on the command line, so a conftest's pytest_configure may set suite defaults), else the ini
key's, else the default; it is read where it is used (collection, spawn), not at configure.

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
    fla_interpreted     fla's own kernels under Triton's interpreter, likewise (float32, slow)
    packed_seqlens      pytest_linattn.seqlens.packed_seqlens
    fragment_seqlens    pytest_linattn.seqlens.fragment_seqlens (the named fragment tables)
    float64_reference   pytest_linattn.float64.float64_reference

Markers: ``world_size(n)`` (the ranks a test needs: skipped on cuda without n GPUs),
``gpus(n)`` (skipped when the machine, or the run's device choice, has fewer than n GPUs; with
``--linattn-ranks-per-gpu N`` both need ceil(n / N) GPUs),
``suite(name)`` (the test's home suite), ``tp_sizes(*sizes)``, ``cp_sizes(*sizes)``,
``equivalent_mutant(site_or_function, mutation, reason=...)`` (pytest_linattn.mutation).

The logic lives in plain modules (options, markers, resources, size_selection, ranks, parity, seqlens, float64)
and the parity records in one plugin object, ``parity.records.ParityRecorder``; this module only
wires them into pytest.
"""
from __future__ import annotations

import os

import pytest

from . import compile_log
from . import options as _opts
from . import quiet_exit  # noqa: F401  importing it registers its exit handler (Triton dropped by pytester)
from . import size_selection
from .fla_hint import FlaOnCpuReport
from .markers import MARKERS, skip_reason
from .parity.records import ParityRecorder
from .resources import SessionResources
from .size_selection import SIZE_FIXTURES
from .spawn import LauncherStops

_STATE = pytest.StashKey["SessionResources"]()


def pytest_addoption(parser):
    group = parser.getgroup("linattn", "linear-attention distributed tests (pytest-linattn)")
    for option in _opts.OPTIONS.values():
        group.addoption(option.flag, **option.flag_arguments())
        parser.addini(option.ini, option.description, default="")


def option_value(config, key):
    """The option's parsed value, read now (a conftest may have changed it since configure)."""
    try:
        return _opts.read_value(config, key)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


# what Triton kernels run interpreted on a CPU say every time: fla's (and the engines' copies of its)
# platform note, numpy's overflow in the interpreter's masked-out lanes (what a GPU would never load)
INTERPRETED_QUIET = ("ignore:Triton is not supported on current platform:UserWarning",
                     "ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if option_value(config, "fla_interpreted"):
        for line in INTERPRETED_QUIET:
            config.addinivalue_line("filterwarnings", line)
    from .mutation.recorder import MARKER, MutationRecorder

    config.addinivalue_line("markers", MARKER)
    compile_log.install()
    state = config.stash[_STATE] = SessionResources(config, option_value)
    config.pluginmanager.register(ParityRecorder(config), "linattn-parity-recorder")
    config.pluginmanager.register(FlaOnCpuReport(), "linattn-fla-on-cpu-report")  # header line; Triton's CPU error
    if state.is_worker and "OMP_NUM_THREADS" not in os.environ:
        # xdist's workers share the cores, as a pool's ranks do
        import torch

        from .ranks.pool import xdist_thread_share

        torch.set_num_threads(xdist_thread_share(1))
    from .ranks.launcher import launcher_world_size

    world_size = launcher_world_size()
    if option_value(config, "mutate_collectives"):
        if world_size is not None:
            raise pytest.UsageError("--linattn-mutate-collectives does not run under torchrun (a mutant's broken "
                                    "process group cannot be replaced there): run without torchrun")
        config.pluginmanager.register(MutationRecorder(config), MutationRecorder.name)
    if world_size is not None and not state.is_worker:
        _start_launcher_mode(config, state, world_size)


def _start_launcher_mode(config, state, world_size):
    # Under torchrun every rank runs this session; only rank 0 reports.
    from .ranks.launcher import LauncherSession, launcher_rank

    rank = launcher_rank()
    # A copy of the terminal, for a report written while pytest's capture holds fd 1.
    state.launcher = LauncherSession(rank, world_size, terminal_fd=os.dup(1))
    state.launcher.install_signal_handlers()
    config.pluginmanager.register(LauncherStops(), LauncherStops.name)
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
    for key in _opts.OPTIONS:
        option_value(session.config, key)
    if option_value(session.config, "fla_interpreted"):  # before collection imports fla
        from linattn.emulation import interpreted

        try:
            interpreted.prepare_process()
        except RuntimeError as exc:
            raise pytest.UsageError(str(exc)) from None
    session.config.stash[_STATE].apply_autotune()


def pytest_report_header(config):
    # Called at session start, before the hook above: apply here too, so the header can say it.
    state = config.stash[_STATE]
    plan = state.apply_autotune()
    lines = [] if plan is None else [plan.describe()]
    per_gpu = option_value(config, "ranks_per_gpu")
    if per_gpu > 1 and state.runs_on_cuda():
        from .ranks.gpus import gpus_for, sharing_note

        sizes = {option_value(config, "tp")[-1], option_value(config, "cp")[-1], per_gpu}
        notes = [sharing_note(w, gpus_for(w, per_gpu)) for w in sorted(sizes) if w > 1]
        lines.append(f"linattn: up to {per_gpu} ranks share a GPU (--linattn-ranks-per-gpu): "
                     + "; ".join(notes) + ". A test transport: the kernels are the real ones, the communication is not")
    return lines or None


def pytest_unconfigure(config):
    state = config.stash.get(_STATE, None)
    if state is not None:
        state.close()


# ----------------------------------------------------------------------------------------------
# tp_size / cp_size parametrization


def _is_ours(metafunc, argname) -> bool:
    # A project may define its own tp_size fixture: then it decides, not us.
    defs = getattr(metafunc, "_arg2fixturedefs", {}).get(argname)
    if not defs:
        return False
    func = getattr(defs[-1], "func", None)
    return getattr(func, "__module__", None) == __name__


def pytest_generate_tests(metafunc):
    for argname, (key, marker_name) in SIZE_FIXTURES.items():
        if argname not in metafunc.fixturenames or not _is_ours(metafunc, argname):
            continue
        if size_selection.parametrized_by_marker(metafunc.definition, argname):
            continue  # the test's own list; sizes not asked for are deselected later
        marker = metafunc.definition.get_closest_marker(marker_name)
        sizes = size_selection.marker_sizes(marker) if marker else option_value(metafunc.config, key)
        metafunc.parametrize(argname, sizes, indirect=True, ids=[f"{key}{n}" for n in sizes])


def pytest_collection_modifyitems(config, items):
    wanted = {argname: option_value(config, key) for argname, (key, _) in SIZE_FIXTURES.items()}
    state = config.stash[_STATE]
    launched = state.launcher.world_size if state.launcher is not None else None
    kept, deselected, state.size_notes = size_selection.select(items, wanted, launched)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def _size_fixture(request, key):
    if hasattr(request, "param"):
        return request.param
    return option_value(request.config, key)[0]


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


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpus") is None and item.get_closest_marker("world_size") is None:
        return
    reason = skip_reason(item, option_value(item.config, "device"), option_value(item.config, "ranks_per_gpu"))
    if reason is not None:
        __tracebackhide__ = True
        # Reported at the test's location, as a skip mark would be, not at this line.
        raise pytest.skip.Exception(reason, _use_item_location=True)


# ----------------------------------------------------------------------------------------------
# spawn


@pytest.fixture
def spawn(request):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks with torch.distributed initialised;
    returns the ranks' return values in rank order, tensors moved to CPU.

    ``spawn(fn, world_size, *args, **kwargs)``: fn must be module-level (it is pickled by
    reference). The ranks come from pools that persist per (world size, device) for the session:
    gloo on a CPU, NCCL on GPUs with one GPU per rank (``--linattn-device``). A raising, dying or
    hanging rank (``--linattn-timeout``; ``spawn.timeout = 5`` for this test) fails the test with
    every rank's traceback or stack. Under torchrun (WORLD_SIZE set) fn runs on the launcher's
    process group instead, world_size must be WORLD_SIZE, and every rank gets the gathered list.
    Groups fn makes (``new_group``) are destroyed as the next call starts: make them in fn."""
    from .spawn import Spawn

    state = request.config.stash[_STATE]
    return Spawn(state.launcher, state.pools, option_value(request.config, "device"),
                 option_value(request.config, "timeout"), request.node,
                 ranks_per_gpu=option_value(request.config, "ranks_per_gpu"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # A failed test whose ranks shared GPUs says so, whatever failed (a rank, or a check here).
    spawn = getattr(item, "funcargs", {}).get("spawn")
    if report.failed and getattr(spawn, "transport_notes", None):
        report.sections.append(("linattn transport", "; ".join(spawn.transport_notes)))
    return report


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


@pytest.fixture
def fla_interpreted():
    """fla's own Triton kernels under Triton's interpreter (float32 CPU tensors), in the test and in
    every rank spawn runs during it (``linattn.emulation.fla_interpreted``). Needs fla not yet
    imported in the process, as ``--linattn-fla-interpreted`` arranges; then on for every test."""
    from linattn.emulation import fla_interpreted as interpreted

    with interpreted():
        yield


@pytest.fixture(autouse=True)
def _fla_modes_for_the_run(request):
    for key in ("fla_interpreted", "fla_on_cpu"):  # kernels interpreted; ops emulated, inside
        if option_value(request.config, key):
            request.getfixturevalue(key)
    yield


# ----------------------------------------------------------------------------------------------
# packed sequences, float64 references


@pytest.fixture
def packed_seqlens():
    """``packed_seqlens(total_tokens, num_seqs=None, *, seed=None, min_len=1, cp_size=1,
    layout="contiguous")``: random cu_seqlens for a packed batch."""
    from .seqlens import packed_seqlens as fn

    return fn


@pytest.fixture
def fragment_seqlens():
    """``fragment_seqlens(name, cp_size, *, layout="contiguous", piece_tokens=8)``: the cu_seqlens of
    a named fragment table (``pytest_linattn.seqlens.FRAGMENTS``: "uneven-pieces", "empty-document",
    "document-per-rank")."""
    from .seqlens import fragment_seqlens as fn

    return fn


@pytest.fixture
def float64_reference():
    """``float64_reference(module, *inputs, grad_output=None)``: the module re-run in float64."""
    from .float64 import float64_reference as fn

    return fn


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    state = item.config.stash.get(_STATE, None)
    if state is not None:
        state.write_autotune_records()


def pytest_terminal_summary(terminalreporter, config):
    state = config.stash.get(_STATE, None)
    if state is None or state.is_worker:
        return
    # Not with --collect-only, whose output lists node ids (one per line) for tools to read.
    if state.size_notes and not config.option.collectonly:
        terminalreporter.write_sep("=", "linattn sizes not run")
        for line in state.size_notes:
            terminalreporter.write_line(line)
    # The parity table and the report's lines follow: ParityRecorder's summary.


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # where the test runs (an xdist worker, not the controller that only reports it); no-op
    # without LINATTN_COMPILE_LOG
    compile_log.test_started(item.nodeid)
    try:
        return (yield)
    finally:
        compile_log.test_finished(item.nodeid)
