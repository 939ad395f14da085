"""The live-bug registry (suites/live_bugs/registry.py) is complete: every entry names a pinned
release, a repro file that exists and that pytest never collects (no test_ name, its folder in the
root conftest's collect_ignore), or, without a repro, a GPU-measured row of docs/results.md and a
test that is a strict xfail; a verdict of the three; a check that exists; an upstream state. No
repro runs here (suites/live_bugs/write_live_bugs_md.py runs them when it writes the page).
"""

import ast
import re
from pathlib import Path

import pytest

from live_bugs.registry import LIVE_BUGS, UPSTREAM_STATES, VERDICTS

ROOT = Path(__file__).resolve().parents[3]


def test_keys_are_unique():
    keys = [b.key for b in LIVE_BUGS]
    assert len(keys) == len(set(keys)), keys


def test_the_repros_folder_is_never_collected():
    collect_ignore = re.search(r"collect_ignore = \[(.*?)\]", (ROOT / "conftest.py").read_text()).group(1)
    assert '"suites/live_bugs"' in collect_ignore
    for path in (ROOT / "suites" / "live_bugs").glob("*.py"):
        assert not path.name.startswith("test_") and not path.name.endswith("_test.py"), path.name


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("bug", LIVE_BUGS, ids=[b.key for b in LIVE_BUGS])
def test_entry_is_complete(bug):
    assert bug.verdict in VERDICTS, f"{bug.key}: verdict {bug.verdict!r}"
    assert bug.verdict_why and bug.finding and bug.where, bug.key
    assert re.fullmatch(r"[A-Za-z0-9_.-]+==\d[\w.+]*", bug.release), f"{bug.key}: release {bug.release!r}"
    assert bug.upstream_state in UPSTREAM_STATES, bug.key
    assert (bug.upstream_state == "open") == bool(bug.upstream), f"{bug.key}: an upstream report has a state"
    assert not bug.upstream or re.fullmatch(r"https://github.com/[^/]+/[^/]+/(issues|pull)/\d+", bug.upstream)
    file, _, function = bug.found_by.partition("::")
    assert (ROOT / file).is_file(), f"{bug.key}: no test file {file!r}"
    assert function.split("[")[0] in _functions(ROOT / file), f"{bug.key}: {file} has no {function!r}"
    if bug.repro:
        path = ROOT / bug.repro
        assert bug.repro.startswith("suites/live_bugs/") and path.is_file(), f"{bug.key}: repro {bug.repro!r}"
        assert not path.name.startswith("test_") and "def test_" not in path.read_text(), f"{bug.key}: test_ name"
        assert len(path.read_text().splitlines()) < 80, f"{bug.key}: a repro is minimal (< 80 lines)"
        assert bug.shows, bug.key
    else:  # the demonstration needs a GPU: the measured row and the test, a strict xfail
        assert bug.gpu_evidence, f"{bug.key}: neither a repro nor a GPU run"
        assert "strict=True" in (ROOT / file).read_text(), f"{bug.key}: {file} has no strict xfail"
    # a GPU run (the repro's, or the test's where there is no repro): a row of the results page
    assert bug.gpu_evidence in (ROOT / "docs" / "results.md").read_text(), f"{bug.key}: no results row"


def test_the_bug_records_live_rows_are_on_the_page():
    from bug_record.registry import BUGS

    repros = {b.repro for b in LIVE_BUGS}
    assert {b.repro for b in BUGS if b.repro} <= repros
