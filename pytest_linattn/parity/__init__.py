"""Parity assertions, their records, and the reports made of them.

    check      `assert_parity`: one tensor (or a dict) against its reference by relative error,
               a failure located as (sequence, token, head); every comparison is a record
    report     the summary table printed at the end of a run, the JSON report and heatmaps
    records    the session's records from the test process, spawn's ranks and xdist workers,
               as one pytest plugin object

Names are imported on first use, so loading the plugin (which needs `records`) imports no torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "check": ("RECORDS", "MAP_MAX_HEADS", "MAP_MAX_TOKENS", "assert_parity", "capture_records", "check_rtol",
              "current_test", "set_current_test"),
    "report": ("format_number", "format_summary", "format_table", "write_report"),
    "records": ("ParityRecorder", "to_plain_data"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))
