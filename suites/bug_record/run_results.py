"""The bug record's runs and what they say: the record's test file, the kernel rows' and the engine
plants' tests, each run in a pytest process with a JUnit XML report, and the reports read into
rows ({bug key: {"outcome", "seconds", "located"}}); the GPU column from the latest GPU run's
report kept in docs/data; the fla the kernel tests ran. `render_bugs_md` turns the rows into the
page; `write_bugs_md.py` runs it all.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from bug_record.registry import BUGS

ROOT = Path(__file__).resolve().parents[2]
TEST = "suites/cpu/record/test_bug_record.py"


def run_record(xml_path: Path) -> tuple[list[str], float]:
    args = [sys.executable, "-m", "pytest", TEST, "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}"]
    started = datetime.datetime.now()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    seconds = (datetime.datetime.now() - started).total_seconds()
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-6000:] + done.stderr[-3000:])
        raise SystemExit(f"the record's run failed (exit {done.returncode}): docs/bugs.md not written")
    return args, seconds


def outcomes(xml_path: Path) -> dict[str, dict]:
    """{bug key: {"outcome", "seconds", "located"}} from the JUnit report."""
    rows = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        found = re.fullmatch(r"test_reported_bug_is_caught_and_located\[(.+)\]", case.get("name", ""))
        if not found:
            continue
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif skipped is not None and skipped.get("type") == "pytest.xfail":
            outcome = "xfail"
        elif skipped is not None:
            outcome = "skipped"
        else:
            outcome = "caught"
        rows[found.group(1)] = dict(outcome=outcome, seconds=props.get("seconds"), located=props.get("located"))
    return rows


def run_tests(tests, xml_path: Path, what: str) -> float:
    """The files of `tests` ("<file>::<function>") in one pytest process of their suite (its
    options: kernels interpreted), with a JUnit XML report; the seconds it took."""
    files = sorted({t.partition("::")[0] for t in tests})
    if not files:
        return 0.0
    args = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}"]
    started = datetime.datetime.now()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-6000:] + done.stderr[-3000:])
        raise SystemExit(f"the {what}' run failed (exit {done.returncode}): docs/bugs.md not written")
    return (datetime.datetime.now() - started).total_seconds()


def test_outcomes(xml_path: Path) -> dict[str, dict]:
    """{"<file>::<function>": {"outcome", "seconds", "located"}} from a JUnit report."""
    cases = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        test = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases[test] = dict(outcome=_case_outcome(case), seconds=props.get("seconds", case.get("time")),
                           located=props.get("located"))
    return cases


def _case_outcome(case) -> str:
    skipped = case.find("skipped")
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    if skipped is not None:
        return "xfail" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


def kernel_outcomes(xml_path: Path) -> dict[str, dict]:
    """{bug key: {"outcome", "seconds", "located"}} of the kernel rows from their tests' JUnit
    report: "caught" where the test passed (its plant caught, located), "live" where a live bug's
    test (a repro) is the strict xfail it must be; anything else as it came ("failed", ...)."""
    cases = test_outcomes(xml_path)
    rows = {}
    for b in BUGS:
        if b.suite != "fla-interpret":
            continue
        row = dict(cases.get(b.kernel_test, {"outcome": "not run"}))
        if row["outcome"] == "passed" and not b.repro:
            row["outcome"] = "caught"
        elif row["outcome"] == "xfail" and b.repro:
            row["outcome"] = "live"
        elif row["outcome"] in ("passed", "xfail"):
            row["outcome"] = "failed"  # a live bug's test passing, or another row's xfailing: fix the entry
        rows[b.key] = row
    return rows


def pinned_fla() -> str:
    """The fla the kernel tests ran (fla-core holds the kernels)."""
    try:
        return f"fla {importlib.metadata.version('fla-core')}"
    except importlib.metadata.PackageNotFoundError:
        return "the pinned fla"


def gpu_outcomes() -> tuple[dict[str, dict], str]:
    """{GPU test name: {"outcome", "seconds"}} of the latest kept GPU run, and where it ran."""
    runs = sorted((ROOT / "docs" / "data").glob("bug-record-gpu1-*.xml"))
    if not runs:
        return {}, ""
    date, machine, commit = re.fullmatch(r"bug-record-gpu1-(\d{4}-\d\d-\d\d)-(.+)-(\w+)\.xml", runs[-1].name).groups()
    rows = {}
    for case in ET.parse(runs[-1]).getroot().iter("testcase"):  # "name@xdist group": the function's name
        outcome = _case_outcome(case)
        rows[case.get("name", "").split("@")[0]] = dict(outcome="caught" if outcome == "passed" else outcome,
                                                        seconds=case.get("time"))
    return rows, f"nvidia-{machine}, {date}, commit {commit}, `docs/data/{runs[-1].name}`"


def gpu_only_outcomes(gpu) -> dict[str, dict]:
    """The rows whose catch runs on a GPU only (suite gpu-1): their kernel test's outcome in the
    last kept GPU run, "not run on a GPU" where that run has no such test."""
    gpu_rows, _ = gpu
    rows = {}
    for b in BUGS:
        if b.suite == "gpu-1":
            on = gpu_rows.get(b.kernel_test.partition("::")[2])
            outcome = "not run on a GPU" if on is None else on["outcome"]
            if outcome == "xfail" and b.repro:
                outcome = "live"
            rows[b.key] = dict(outcome=outcome, seconds=on and on["seconds"], located=None)
    return rows
