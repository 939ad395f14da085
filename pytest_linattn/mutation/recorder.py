"""The plugin object of ``--linattn-mutate-collectives``: after a test that ran ranks passes, it
reruns the test once per mutant (`plan`), writes a progress line, and at the end prints the
session table, writes ``collective-mutants.json`` into ``--linattn-report DIR`` and makes the
session fail when a mutant survived. Under xdist a worker sends its results with the test's
report and the controller reports them (as `pytest_linattn.parity.records` does)."""
from __future__ import annotations

import contextlib

import pytest

from .. import options
from . import plan
from . import report as mutants_report
from .reruns import keep_references

__all__ = ["MutationRecorder", "MARKER"]

MARKER = ("equivalent_mutant(site_or_function, mutation='*', reason=...): a collective mutant this test "
          "cannot notice by design (shown in the mutation report, not counted)")


class MutationRecorder:
    name = "linattn-collective-mutants"

    def __init__(self, config):
        self.config = config
        self.is_worker = hasattr(config, "workerinput")
        self.tests: list[dict] = []  # {"test", "summary", "results"}, on the reporting process
        self.pending: dict[str, dict] = {}  # node id -> its entry, until its call report is made
        self.notes: list[str] = []

    def _limit(self) -> int:
        return options.read_value(self.config, "mutants_per_test")

    def _rules(self, item) -> list:
        rules = []
        for marker in item.iter_markers("equivalent_mutant"):
            try:
                rules.append(mutants_report.equivalence_rule(marker.args, marker.kwargs))
            except ValueError as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
        return rules

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        rules = self._rules(item)  # a bad marker fails before the test runs
        with keep_references():  # the test process's references, the same in every rerun
            result = yield from self._run_with_mutants(item, rules)
        return result

    def _run_with_mutants(self, item, rules):
        with plan.recording() as clean:
            result = yield  # the test failed: nothing to mutate
        if not clean.calls:
            return result  # no ranks, or ranks without collectives
        mutants = plan.make_mutants(clean.calls)
        chosen = plan.select(mutants, self._limit())
        for m in chosen:
            m["equivalent"] = mutants_report.equivalent_reason(m, rules)
        calls = sum(len(per_rank) for ranks in clean.calls.values() for per_rank in ranks.values())
        with self._progress_line(item) as progress:
            results = plan.run_mutants(item.runtest, chosen, progress=progress)
        summary = {"calls": calls, "mutants_total": len(mutants), "mutants_run": len(chosen)}
        self.pending[item.nodeid] = {"test": item.nodeid, "summary": summary, "results": results}
        return result

    @contextlib.contextmanager
    def _progress_line(self, item):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if self.is_worker or reporter is None:
            yield None
            return
        counts = dict.fromkeys(plan.OUTCOMES, 0)
        state = {"text": ""}

        def show(done, total, result):
            counts[result["outcome"]] += 1
            state["text"] = (f"linattn mutants {item.nodeid}: {done}/{total} run, " +
                             ", ".join(f"{n} {o}" for o, n in counts.items()))
            if reporter.isatty:
                with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                    reporter.write("\r" + state["text"], flush=True)

        if capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.ensure_newline()
        yield show
        if state["text"]:
            with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                reporter.write(("\r" if reporter.isatty else "") + state["text"] + "\n", flush=True)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = yield
        if call.when == "call" and item.nodeid in self.pending:
            from ..parity.records import to_plain_data

            rep.linattn_mutants = to_plain_data(self.pending.pop(item.nodeid))
        return rep

    def pytest_runtest_logreport(self, report):
        entry = getattr(report, "linattn_mutants", None)
        if entry and not self.is_worker:
            self.tests.append(entry)

    def pytest_sessionfinish(self, session):
        if self.is_worker:
            return
        directory = options.read_value(self.config, "report")
        if directory:
            try:
                path = mutants_report.write_json(self.tests, directory)
                self.notes.append(f"linattn collective mutants: {path}")
            except OSError as exc:
                self.notes.append(f"linattn collective mutants: {mutants_report.JSON_NAME} not written: {exc!r}")
        if mutants_report.survivors([r for t in self.tests for r in t["results"]]) and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.is_worker:
            return
        terminalreporter.write_sep("=", "linattn collective mutants")
        if not self.tests:
            terminalreporter.write_line("no test that passed ran collectives on ranks: nothing mutated")
        else:
            terminalreporter.write_line(mutants_report.format_summary(self.tests))
        for note in self.notes:
            terminalreporter.write_line(note)
