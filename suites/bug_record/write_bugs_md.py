"""Write docs/bugs.md (and the README's headline line) from a run of the bug record.

    .venv/bin/python suites/bug_record/write_bugs_md.py

runs `pytest suites/cpu/record/test_bug_record.py` with a JUnit XML report, reads each registry
entry's outcome (caught, strict xfail), the time its check took on the plant and the line of the
check's report that locates it, and writes the table with the command, the date and the git
commit it was made at. The kernel rows (`Bug.kernel_test`: fla's kernels under Triton's
interpreter, suite fla-interpret) come from a run of their test files in the same generation
(a process of their own: the suite sets TRITON_INTERPRET=1 before fla is imported); a live bug's
test is a strict xfail. Their GPU column (`Bug.gpu_test`, fla's compiled kernels) comes from the
latest GPU run's JUnit report kept in docs/data (`bug-record-gpu1-<date>-<machine>-<commit>.xml`,
from `.ci/gpu.sh suites/gpu-1/test_bug_record_gpu1.py`), or says that no kept run has the test.
`run_results` runs the tests and reads their reports, `render_bugs_md` writes the page and the
README line. Nothing in docs/bugs.md is typed by hand.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "suites"))

from bug_record.registry import BUGS  # noqa: E402
from bug_record.render_bugs_md import render, update_readme  # noqa: E402
from bug_record.run_results import (gpu_only_outcomes, gpu_outcomes, kernel_outcomes, outcomes,  # noqa: E402
                                    pinned_fla, run_record, run_tests, test_outcomes)


def _commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return sha + (" (with uncommitted changes)" if dirty else "")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        xml_path, kernel_xml = Path(tmp) / "record.xml", Path(tmp) / "kernel.xml"
        _, seconds = run_record(xml_path)
        rows = outcomes(xml_path)
        kernel_seconds = run_tests([b.kernel_test for b in BUGS if b.suite == "fla-interpret"], kernel_xml,
                                   "kernel tests")
        if kernel_seconds:
            rows.update(kernel_outcomes(kernel_xml))
        engine_xml = Path(tmp) / "engines.xml"
        engine_seconds = run_tests([t for b in BUGS for t in b.engine_tests], engine_xml, "engine plants")
        engine_cases = test_outcomes(engine_xml) if engine_seconds else {}
    gpu = gpu_outcomes()
    rows.update(gpu_only_outcomes(gpu))
    missing = [b.key for b in BUGS if b.key not in rows]
    unnamed = [t for b in BUGS for t in b.engine_tests if engine_cases.get(t, {}).get("outcome") != "passed"]
    if unnamed:
        raise SystemExit(f"every engine plant must be caught (its test passing); not: {unnamed}")
    if missing or any(r["outcome"] in ("failed", "skipped", "not run") for r in rows.values()):
        raise SystemExit(f"every entry must be caught, a strict xfail or live; not run: {missing}; rows: {rows}")
    date, fla = datetime.date.today().isoformat(), pinned_fla()
    (ROOT / "docs" / "bugs.md").write_text(render(rows, seconds, date, _commit(), gpu, kernel_seconds, fla,
                                                         (engine_cases, engine_seconds)))
    caught = sum(r["outcome"] == "caught" for r in rows.values())
    live = sum(r["outcome"] == "live" for r in rows.values())
    counted = {k for k, r in rows.items() if r["outcome"] in ("caught", "live")}
    on_gpu = sum(1 for b in BUGS if b.gpu_test and b.key not in counted
                 and gpu[0].get(b.gpu_test.partition("::")[2], {}).get("outcome") == "caught")
    update_readme(caught, on_gpu, len(BUGS), live, fla)
    xfails = sum(r["outcome"] == "xfail" for r in rows.values())
    print(f"docs/bugs.md: {caught} of {len(BUGS)} caught on the CPU, {live} live in {fla}, {on_gpu} on a GPU only, "
          f"{xfails} strict xfails")


if __name__ == "__main__":
    main()
