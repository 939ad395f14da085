"""fla on a CPU, as the run reports it: the pytest header's line on the emulation's state, and one
line instead of Triton's "0 active drivers" when a test reaches fla's Triton kernels on a CPU.

fla's kernels fail on a CPU inside Triton (`RuntimeError: 0 active drivers ([]). There should only
be one.`), which names neither fla nor the fix. A failing test whose error (raised in the test
process, or on a rank of `spawn`, whose report holds the rank's traceback) is that one, with an
fla frame on the way to it, is reported as one line naming the fla call it came through and
`fla_on_cpu` / `--linattn-fla-on-cpu`; or, when the emulation was on, saying that call is not
emulated. The text is matched, not the exception, so a rank's error reads the same as a local one.

`FlaOnCpuReport` is the plugin object (registered by the plugin at configure); the rest is plain.
"""
from __future__ import annotations

import os
import re
import sys
import traceback

import pytest

from . import options

__all__ = ["FlaOnCpuReport", "header_line", "triton_on_cpu_line"]

_NO_DRIVER = re.compile(r"RuntimeError: 0 active drivers \(\[\]\)\. There should only be one\.")
_FLA_FRAME = re.compile(r'File "[^"\n]*?[/\\]fla[/\\]([\w/\\]+)\.py", line \d+, in (\w+)')


def triton_on_cpu_line(text: str, emulated: bool) -> str | None:
    """The one line for a failure whose traceback `text` ends in Triton's missing-driver error
    after passing through fla; None for any other failure."""
    # the first fla frame past fla's dispatch wrappers: the call the test's code made
    frames = [(re.sub(r"[/\\]", ".", m.group(1)), m.group(2)) for m in _FLA_FRAME.finditer(text)]
    calls = [f for f in frames if f[0] != "backends" and not f[0].startswith(("backends.", "utils."))] or frames
    if not calls or not _NO_DRIVER.search(text):
        return None
    where = f"fla.{calls[0][0]}.{calls[0][1]}"
    if emulated:
        return (f"fla's Triton kernels cannot run on a CPU (Triton finds no GPU driver), and {where} reached one "
                f"while fla_on_cpu was on: the emulation does not cover that call (docs/fla-on-cpu.md lists what "
                f"it covers)")
    return (f"fla's Triton kernels cannot run on a CPU (Triton finds no GPU driver), reached through {where}: "
            f"run fla's ops emulated on linattn's float64 references with the fla_on_cpu fixture, or "
            f"--linattn-fla-on-cpu (ini linattn_fla_on_cpu = on) for every test (docs/fla-on-cpu.md)")


def header_line(config) -> str | None:
    """`linattn fla-on-cpu: on ...` / `off ...`; None when the value is bad (session start says so)."""
    emulated = _source_if_on(config, "fla_on_cpu")
    if emulated is None:
        return None
    if emulated:
        line = f"linattn fla-on-cpu: on, in every test and rank ({emulated}): fla's ops run on linattn's references"
    else:
        line = ("linattn fla-on-cpu: off (fla's ops are emulated only in tests using the fla_on_cpu fixture; "
                "--linattn-fla-on-cpu for every test)")
    interpreted = _source_if_on(config, "fla_interpreted")
    if interpreted:
        line += (f"\nlinattn fla-interpreted: on, in every test and rank ({interpreted}): fla's own Triton kernels "
                 f"under Triton's interpreter, float32")
    return line


def _source_if_on(config, name: str) -> str | None:
    """Where an on/off option was set on ("--linattn-fla-on-cpu", the ini key), "" when it is off,
    None when its value is bad (session start reports that)."""
    try:
        on = options.read_value(config, name)
    except ValueError:
        return None
    return options.unparsed_value(config, name)[1] if on else ""


def _emulated() -> bool:
    patching = sys.modules.get("linattn.emulation.patching")  # not imported: never turned on
    return patching is not None and patching.active_compute_dtype() is not None


class _Crash:
    """What pytest's summaries read of a failure (`-ra`'s line, junitxml's message)."""

    def __init__(self, message: str):
        self.message = message

    def __str__(self) -> str:
        return self.message


class OneLine:
    """A failure's whole report: one line."""

    def __init__(self, text: str):
        self.text, self.reprcrash = text, _Crash(text)

    def toterminal(self, tw) -> None:
        tw.line(self.text)

    def __str__(self) -> str:
        return self.text


class FlaOnCpuReport:
    """The header's line and the failure's line (module docstring)."""

    def pytest_report_header(self, config):
        return header_line(config)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if report.failed and call.excinfo is not None:
            exc = call.excinfo.value
            line = triton_on_cpu_line("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                                      _emulated())
            # under fla_interpreted the driver error means the interpreter's setup missed a process:
            # its traceback says more than a pointer to the emulation
            if line is not None and os.environ.get("TRITON_INTERPRET") != "1":
                report.longrepr = OneLine(line)
        return report
