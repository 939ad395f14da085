"""Write docs/bugs.md (and the README's headline line) from a run of the bug record.

    .venv/bin/python suites/bug_record/write_bugs_md.py

runs `pytest suites/cpu/record/test_bug_record.py` with a JUnit XML report, reads each registry
entry's outcome (caught, strict xfail), the time its check took on the plant and the line of the
check's report that locates it, and writes the table with the command, the date and the git
commit it was made at. The GPU rows (fla's kernels) come from the latest GPU run's JUnit report
kept in docs/data (`bug-record-gpu1-<date>-<machine>-<commit>.xml`, from `.ci/gpu.sh
suites/gpu-1/test_bug_record_gpu1.py`). Nothing in docs/bugs.md is typed by hand.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "suites"))

from bug_record.checks import CHECKS  # noqa: E402
from bug_record.registry import BUGS  # noqa: E402

TEST = "suites/cpu/record/test_bug_record.py"
COMMAND = "python suites/bug_record/write_bugs_md.py"
README_START, README_END = "<!-- bug-record:start -->", "<!-- bug-record:end -->"


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


def gpu_outcomes() -> tuple[dict[str, dict], str]:
    """{GPU test name: {"outcome", "seconds"}} of the latest kept GPU run, and where it ran."""
    runs = sorted((ROOT / "docs" / "data").glob("bug-record-gpu1-*.xml"))
    if not runs:
        return {}, ""
    date, machine, commit = re.fullmatch(r"bug-record-gpu1-(\d{4}-\d\d-\d\d)-(.+)-(\w+)\.xml", runs[-1].name).groups()
    rows = {}
    for case in ET.parse(runs[-1]).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "failed" if failed else "skipped" if case.find("skipped") is not None else "caught"
        rows[case.get("name", "").split("@")[0]] = dict(outcome=outcome, seconds=case.get("time"))
    return rows, f"nvidia-{machine}, {date}, commit {commit}, `docs/data/{runs[-1].name}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return sha + (" (with uncommitted changes)" if dirty else "")


def render(rows: dict[str, dict], seconds: float, date: str, commit: str, gpu=({}, "")) -> str:
    gpu_rows, gpu_run = gpu
    caught = [b for b in BUGS if rows.get(b.key, {}).get("outcome") == "caught"]
    on_gpu = [b for b in BUGS if b.gpu_test and gpu_rows.get(b.gpu_test, {}).get("outcome") == "caught"]
    lines = [
        "# The bug record",
        "",
        "Every public report of a sharding or state bug in linear-attention and SSM layers that the project",
        "collected (fla, Megatron-LM, transformers, vLLM, sglang, accelerate, prime-rl, slime, miles, verl and",
        "others), planted where it lived and run against the check that must catch it. Each row is one entry",
        "of `suites/bug_record/registry.py` and one plant (`suites/bug_record/plants_layer.py`,",
        "`suites/bug_record/plants_state.py`); `suites/cpu/record/test_bug_record.py` runs the check on the",
        "project's layer (it must pass) and on the plant (it must fail, and its report must locate the bug).",
        "",
        headline(len(caught), len(on_gpu), len(BUGS), gpu_run),
        "",
        "An entry whose class has no check yet is a strict xfail: the closest check runs on its plant and",
        "is blind to it, so building the check turns the xfail into a failure to update. On the CPU the",
        "kernel bugs are such xfails (the layers hand fla's conv B = 1 and contiguous gradients).",
        "",
        "A plant that changes the replicated layer as much as the sharded one is invisible to",
        "sharded-vs-replicated parity; such plants are caught by the oracle (the layer against a composition",
        "written from the Hugging Face forwards) or the continuation check. The \"runs\" column says where",
        "each plant acts: *sharded* (a TP or CP shard only: parity sees it), *stateful* (calls from a carried",
        "state and decode steps: the continuation check), *trainer* (micro-batches and the trainer's",
        "reduction: the training step), *everywhere* (the replicated layer too).",
        "",
        f"Generated on {date} at commit {commit} by `{COMMAND}` (the record's run took {seconds:.0f} s, on",
        "this page's machine, every check and reference included). Do not edit by hand.",
        "",
        "| # | bug | upstream report | class | check | runs | caught | time to catch | located by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in BUGS:
        row = rows.get(b.key, {"outcome": "not run"})
        reports = ", ".join(f"[{_cell(str(r))}]({r.url})" for r in b.reports)
        if row["outcome"] == "caught":
            verdict, took, where = "yes", f"{float(row['seconds']):.2f} s", f"`{_cell(row['located'])}`"
        elif row["outcome"] == "xfail":
            verdict, took, where = "no", "", f"needs {_cell(b.missing)}"
        else:
            verdict, took, where = row["outcome"], "", ""
        if b.suite != "cpu":
            on, test = gpu_rows.get(b.gpu_test, {}), f"`suites/{b.suite}/test_bug_record_gpu1.py::{b.gpu_test}`"
            if on.get("outcome") == "caught":
                verdict, took = "on GPU", f"{float(on['seconds']):.2f} s (GPU)"
                where = f"{test} on fla's kernel, the tensor named (on the CPU a strict xfail: {_cell(b.missing)})"
            else:
                where += f" (GPU row: {test})"
        lines.append(f"| {b.row} | **{b.key}**: {_cell(b.mechanism)} | {reports} | {_cell(b.bug_class)} | "
                     f"{CHECKS[b.check]} | {b.runs} | {verdict} | {took} | {where} |")
    lines += ["", "Rows marked \"also\" come from the record's list of related reports outside its main table.", ""]
    return "\n".join(lines)


def headline(cpu: int, gpu: int, total: int, gpu_run: str = "") -> str:
    """The count people read first: caught on the CPU, and kernel bugs caught on a GPU."""
    text = f"**{cpu + gpu} of {total} reported bugs caught**, each with a report that locates it: {cpu} on the CPU"
    return text + (f", {gpu} kernel bugs on a GPU ({gpu_run})." if gpu else ".")


def update_readme(cpu: int, gpu: int, total: int) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    where = f"{cpu} on a CPU" + (f", {gpu} kernel bugs on a GPU" if gpu else "")
    line = (f"{README_START}\nThe public bug record is its benchmark: {cpu + gpu} of {total} reported sharding and "
            f"state bugs, planted where they lived, are caught with a report that locates them ({where}; "
            f"[docs/bugs.md](docs/bugs.md), generated from a run).\n{README_END}")
    if README_START in text:
        text = re.sub(re.escape(README_START) + r".*?" + re.escape(README_END), line, text, flags=re.S)
    else:
        anchor = "\nOn a CPU everything runs over gloo"
        if anchor not in text:
            raise SystemExit("README.md: the 'What it is' section's last paragraph was not found")
        text = text.replace(anchor, f"\n{line}\n{anchor}", 1)
    readme.write_text(text)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "record.xml"
        _, seconds = run_record(xml_path)
        rows = outcomes(xml_path)
    missing = [b.key for b in BUGS if b.key not in rows]
    if missing or any(r["outcome"] in ("failed", "skipped") for r in rows.values()):
        raise SystemExit(f"every entry must be caught or a strict xfail; not run: {missing}; rows: {rows}")
    date = datetime.date.today().isoformat()
    gpu = gpu_outcomes()
    (ROOT / "docs" / "bugs.md").write_text(render(rows, seconds, date, _commit(), gpu))
    caught = sum(r["outcome"] == "caught" for r in rows.values())
    on_gpu = sum(1 for b in BUGS if b.gpu_test and gpu[0].get(b.gpu_test, {}).get("outcome") == "caught")
    update_readme(caught, on_gpu, len(BUGS))
    print(f"docs/bugs.md: {caught} of {len(BUGS)} caught on the CPU, {on_gpu} on a GPU, "
          f"{len(BUGS) - caught} strict xfails on the CPU")


if __name__ == "__main__":
    main()
