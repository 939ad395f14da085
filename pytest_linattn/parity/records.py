"""The session's parity records, wherever `assert_parity` ran, and the summary and report of them.

A check records in the process that makes it: the test process (`pytest_linattn.parity.check.RECORDS`)
or a rank of spawn's pool, whose records the pool adds to its caller's RECORDS. Under xdist
that caller is a worker: it sends its new records with each test report and the controller
collects them. `ParityRecorder` holds that state as one plugin object (as xdist's DSession
does), registered by the plugin at configure; at the end it prints the parity table and
writes ``--linattn-report``.
"""
from __future__ import annotations

import os
import sys

import pytest

from .. import options

__all__ = ["ParityRecorder", "to_plain_data"]


def _loaded_parity():
    # Only when a test imported it: runs that never compare tensors never import torch for it.
    return sys.modules.get("pytest_linattn.parity.check")


def to_plain_data(obj):
    """Records cross to the xdist controller through execnet, which carries plain data only."""
    if isinstance(obj, dict):
        return {str(k): to_plain_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain_data(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return to_plain_data(tolist())
    return str(obj)


class ParityRecorder:
    """The records of one pytest session, on an xdist worker or on the process that reports."""

    def __init__(self, config):
        self.config = config
        self.is_worker = hasattr(config, "workerinput")
        # An in-process nested run (pytester) shares the parity module's list with the outer
        # run, and each must summarise only its own checks: this session's start in it.
        parity = _loaded_parity()
        self.local_start = len(parity.RECORDS) if parity is not None else 0
        self.forwarded_upto = self.local_start  # a worker: RECORDS before this index went to the controller
        self.from_workers: list[dict] = []  # the controller: records the workers sent
        self.report_paths: list = []
        self.report_notes: list[str] = []  # lines about the report (a PNG not drawn), printed at the end
        self.xfailed: set[str] = set()  # tests that failed as their xfail mark expects

    def records(self) -> list[dict]:
        """Every record of the session, those of xfailed tests marked `"xfail": True`; none on a
        worker, which forwards its own."""
        if self.is_worker:
            return []
        parity = _loaded_parity()
        local = parity.RECORDS[self.local_start:] if parity is not None else []
        return [dict(r, xfail=True) if r.get("test") in self.xfailed else r for r in self.from_workers + local]

    # -- naming the test that records belong to

    @staticmethod
    def _set_test(nodeid):
        parity = _loaded_parity()
        if parity is not None:
            parity.set_current_test(nodeid)

    @pytest.hookimpl(tryfirst=True)  # before the fixtures are set up: their checks count for the test
    def pytest_runtest_setup(self, item):
        self._set_test(item.nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        self._set_test(item.nodeid)
        return (yield)

    # -- from the workers to the controller

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        parity = _loaded_parity()
        if self.is_worker and parity is not None:
            new = parity.RECORDS[self.forwarded_upto:]
            self.forwarded_upto = len(parity.RECORDS)
            if new:
                report.linattn_parity = to_plain_data(new)
        if call.when == "teardown":
            self._set_test(None)
        return report

    def pytest_runtest_logreport(self, report):
        # Only workers attach records, so only the controller finds any.
        self.from_workers.extend(getattr(report, "linattn_parity", None) or [])
        if report.skipped and hasattr(report, "wasxfail"):  # failed, as its xfail mark says it would
            self.xfailed.add(report.nodeid)

    # -- the summary and the report

    def pytest_sessionfinish(self, session):
        directory = options.read_value(self.config, "report")
        if self.is_worker or not directory:
            return
        from . import report  # the writer is needed even when no test compared anything

        try:
            self.report_paths = report.write_report(self.records(), directory, notes=self.report_notes)
        except Exception as exc:  # noqa: BLE001 - a report file must never hide the test failures
            self.report_notes.append(f"linattn report not written: {exc!r}")

    @pytest.hookimpl(trylast=True)  # after the plugin's own lines (sizes not run)
    def pytest_terminal_summary(self, terminalreporter):
        if self.is_worker:
            return
        records = self.records()
        if records:
            from .report import format_summary

            text = format_summary(records)
            if text:
                terminalreporter.write_sep("=", "linattn parity")
                terminalreporter.write_line(text)
        if self.report_paths:
            terminalreporter.write_line(f"linattn report: {len(self.report_paths)} file(s) in "
                                        f"{os.path.dirname(str(self.report_paths[0]))}")
        for note in self.report_notes:
            terminalreporter.write_line(note)
