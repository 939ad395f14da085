"""The `spawn` fixture's callable: a call on several ranks (pytest_linattn.ranks.dispatch) with
pytest's outcomes: too few GPUs skips the test, a rank's failure fails it with every rank's
report, and under torchrun a failure after which a rank is gone stops the session (the summary
then lists the tests that did not run)."""

from __future__ import annotations

import sys

import pytest

from .ranks import dispatch, pool
from .ranks.gpus import gpus_for, sharing_note
from .ranks.reports import BrokenGroup


class Spawn:
    """``spawn(fn, world_size, *args, **kwargs)``: fn on every rank; values in rank order."""

    def __init__(self, launcher, pools, device: str, timeout: float, item=None, ranks_per_gpu: int = 1):
        self._launcher, self._pools, self._device = launcher, pools, device
        self.timeout = timeout
        self._item = item
        self.ranks_per_gpu = ranks_per_gpu
        self.transport_notes: list[str] = []  # ranks sharing GPUs this test ran on (its failure report says so)

    def __call__(self, fn, world_size, *args, **kwargs):
        __tracebackhide__ = True
        note = self._sharing_note(world_size)
        if note and note not in self.transport_notes:
            self.transport_notes.append(note)
        try:
            return dispatch.run_on_ranks(fn, world_size, args, kwargs, device=self._device, timeout=self.timeout,
                                         pools=self._pools, launcher=self._launcher,
                                         fla_on_cpu=_active_fla_emulation(), test=getattr(self._item, "nodeid", ""),
                                         ranks_per_gpu=self.ranks_per_gpu,
                                         collectives=_active_collective_plan(fn))
        except pool.NotEnoughGpus as exc:
            pytest.skip(f"spawn(world_size={world_size}): {exc}")
        except pool.RankFailure as exc:
            if isinstance(exc, BrokenGroup) and self._launcher is not None and self._item is not None:
                _stop_session(self._item)
            # Re-raised here so the report ends at the test's call, not inside the pool.
            raise type(exc)(str(exc)) from None


    def _sharing_note(self, world_size) -> str | None:
        if self.ranks_per_gpu == 1 or isinstance(world_size, bool) or not isinstance(world_size, int):
            return None
        if pool.resolve_device(self._device) != "cuda":
            return None
        return sharing_note(world_size, gpus_for(world_size, self.ranks_per_gpu))


def _stop_session(item) -> None:
    # A rank is gone, so no process group can be made: every later distributed test would fail
    # or hang, so the session stops after this test, on every rank, and says what did not run.
    session = item.session
    session.shouldfail = (f"linattn: a rank is gone after a failure in {item.nodeid}; the session "
                          f"stops (see that test's report)")
    _list_not_run(item, f"a rank was gone after {item.nodeid}", with_item=False)


def _list_not_run(item, why: str, *, with_item: bool) -> None:
    """The summary's list of the tests after `item` (`item` too, when it was cut short), once."""
    manager = item.config.pluginmanager
    if manager.has_plugin(_NotRun.name):
        return
    items = list(getattr(item.session, "items", []))
    if item not in items:
        items = [item]
    rest = items[items.index(item) + (0 if with_item else 1):]
    manager.register(_NotRun(why, [i.nodeid for i in rest]), _NotRun.name)


class _NotRun:
    """The terminal summary's list of the tests a stopped session did not run, and why."""

    name = "linattn-not-run"

    def __init__(self, why: str, nodeids: list[str]):
        self.why, self.nodeids = why, nodeids

    def pytest_terminal_summary(self, terminalreporter):
        if not self.nodeids:
            return
        terminalreporter.write_sep("=", f"linattn: {len(self.nodeids)} test(s) not run: {self.why}")
        for nodeid in self.nodeids:
            terminalreporter.write_line(f"NOT RUN {nodeid}")


class LauncherStops:
    """Under torchrun: when the launcher's SIGTERM interrupts the session outside a distributed
    call (a rank on this node exited between calls), the summary names the test it came in and
    lists that test (unless its call had been reported: then it came in the teardown) and the
    ones after it as not run."""

    name = "linattn-launcher-stops"

    def __init__(self):
        self.current = None
        self.current_ran = False

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current, self.current_ran = item, False
        result = yield
        self.current = None  # not reached when the test is interrupted
        return result

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and self.current is not None and report.nodeid == self.current.nodeid:
            self.current_ran = True

    def pytest_keyboard_interrupt(self, excinfo):
        from .ranks.launcher import LauncherStopped

        if not isinstance(excinfo.value, LauncherStopped) or self.current is None:
            return
        item, when = self.current, ("after" if self.current_ran else "during")
        _list_not_run(item, f"the launcher stopped this session {when} {item.nodeid} (a rank on its node exited)",
                      with_item=not self.current_ran)


def _active_collective_plan(fn):
    # --linattn-mutate-collectives: what this call's ranks record or mutate (pytest_linattn.mutation.plan)
    plan = sys.modules.get("pytest_linattn.mutation.plan")
    return None if plan is None else plan.active_message(fn)


def _active_fla_emulation():
    # The ranks run fla's ops emulated, or fla's kernels interpreted, whenever the test process
    # does (fixture, option or a `with fla_on_cpu():` around spawn): linattn.emulation.active_modes().
    # sys.modules, so a run that never uses either imports nothing.
    modes = sys.modules.get("linattn.emulation.modes")
    return None if modes is None else modes.active_modes()
