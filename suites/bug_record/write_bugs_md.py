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
Nothing in docs/bugs.md is typed by hand.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "suites"))

from bug_record.checks import CHECKS  # noqa: E402
from bug_record.registry import BUGS, FIDELITIES, NOT_YET  # noqa: E402
from clients.engines.fetch import RELEASES  # noqa: E402

TEST = "suites/cpu/record/test_bug_record.py"
ENGINE_FILE = "suites/engines/test_record_on_engines.py"
ENGINE_VERSIONS = {r.engine: r.version for r in RELEASES}
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


def _gpu_cell(b, gpu_rows: dict, gpu_run: str) -> str:
    """A kernel row's GPU column: its gpu_test's outcome in the last kept GPU run, or that the run
    did not have the test."""
    if not b.gpu_test:
        return ""
    on = gpu_rows.get(b.gpu_test.partition("::")[2], {})
    expected = "xfail" if b.repro else "caught"
    if not on:
        last = f" (the last kept GPU run, {gpu_run}, predates it)" if gpu_run else ""
        return f"GPU: not yet run on the new test `{b.gpu_test}`{last}"
    what = {"caught": "caught", "xfail": "strict xfail"}.get(on["outcome"], on["outcome"])
    flag = "" if on["outcome"] == expected else f" (expected: {expected})"
    return f"GPU: {what}{flag} in {float(on['seconds']):.2f} s, `{b.gpu_test}` ({gpu_run})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return sha + (" (with uncommitted changes)" if dirty else "")


def _engine_cell(b, engine_cases: dict) -> str:
    """An entry's plants around the engines' own kernels: each test's outcome ("caught" where it passed:
    the check failed on the plant and its report located it) and time."""
    said = []
    for test in b.engine_tests:
        case = engine_cases.get(test, {"outcome": "not run"})
        outcome = "caught" if case["outcome"] == "passed" else case["outcome"]
        took = f" in {float(case['seconds']):.2f} s" if case.get("seconds") and outcome == "caught" else ""
        said.append(f"`{test.partition('::')[2]}` {outcome}{took}")
    return f"; on the engines' own kernels ({ENGINE_FILE}): " + ", ".join(said) if said else ""


def engines_caught(engine_cases: dict) -> list:
    """The entries every one of whose engine plants was caught."""
    return [b for b in BUGS if b.engine_tests and all(engine_cases.get(t, {}).get("outcome") == "passed"
                                                      for t in b.engine_tests)]


def render(rows: dict[str, dict], seconds: float, date: str, commit: str, gpu=({}, ""), kernel_seconds: float = 0.0,
           fla: str = "the pinned fla", engines=({}, 0.0)) -> str:
    gpu_rows, gpu_run = gpu
    engine_cases, engine_seconds = engines
    on_engines = engines_caught(engine_cases)
    caught = [b for b in BUGS if b.suite == "cpu" and rows.get(b.key, {}).get("outcome") == "caught"]
    kernel = [b for b in BUGS if b.suite != "cpu" and rows.get(b.key, {}).get("outcome") == "caught"]
    live = [b for b in BUGS if rows.get(b.key, {}).get("outcome") == "live"]
    on_gpu = [b for b in BUGS if b.gpu_test and b.key not in {k.key for k in caught + kernel + live}
              and gpu_rows.get(b.gpu_test.partition("::")[2], {}).get("outcome") == ("xfail" if b.repro else "caught")]
    lines = [
        "# The bug record",
        "",
        "Every public report of a sharding or state bug in linear-attention and SSM layers that the project",
        "collected (fla, Megatron-LM, transformers, vLLM, sglang, accelerate, prime-rl, slime, miles, verl and",
        "others), and the bugs the project found itself, each planted (a bug the pinned release still has:",
        "run in the release's own code) and run against the check that must catch it. Each row is one entry",
        "of `suites/bug_record/registry.py` and, but for a live bug, one plant (`suites/bug_record/plants_layer.py`,",
        "`suites/bug_record/plants_state.py`, or a kernel row's test); `suites/cpu/record/test_bug_record.py`",
        "runs the check on the project's layer (it must pass) and on the plant (it must fail, and its report",
        "must locate the bug: the pattern in the last column, which no other plant's report of the same check",
        "matches). The kernel rows' tests are described below.",
        "",
        headline(len(caught), len(on_gpu), len(BUGS), gpu_run, kernel=len(kernel), live=[b.key for b in live], fla=fla),
        "",
        f"{len(on_engines)} serving entries are also planted in the engine-side code they lived in, around the",
        f"engines' own unchanged kernels (vLLM {ENGINE_VERSIONS['vllm']}, sglang {ENGINE_VERSIONS['sglang']}, pinned, "
        "under Triton's interpreter in float32;",
        "`suites/bug_record/plants_engines.py`): the metadata builder, the CUDA-graph padding, the prefix-cache",
        f"copies, the accept step; each caught and located by `{ENGINE_FILE}` ({engine_seconds:.0f} s), named in",
        "the check column.",
        "",
        "The fidelity column says how close each plant is to its upstream report, as the registry states it:",
        "*faithful* (the upstream mechanism where it lived; where that was an engine or a trainer, in the",
        "project's client of the same kind, as the note says), *moved* (the mechanism planted elsewhere: the",
        "note says where it lived and where it is planted), *partial* (one part of the report planted: the note",
        "says which), *project finding* (no upstream report: the project found it in the code).",
        "",
        "A strict xfail is a check not built yet: the closest check runs on the entry's plant and is blind to",
        "it; building the check turns the xfail into a failure, and the entry then names what its report",
        "locates.",
        "",
        "The *kernel* rows are bugs in fla's kernels, which the layers cannot reach (they hand fla's conv",
        "B = 1 and contiguous gradients): a kernel test runs fla's own kernel against the float64",
        "reference, under Triton's interpreter on a CPU (suite `fla-interpret`, run when this page is",
        "generated) and compiled on a GPU (suite `gpu-1`, from its last kept run). A bug the pinned fla",
        "still has is *live*: no plant, fla itself is the subject; its test is a strict xfail naming the",
        "report, and its standalone repro is named (a row of [the live-bug page](live-bugs.md)). A fixed one",
        "keeps its check, with the old behaviour",
        "planted in the test.",
        "",
        "A plant that changes the replicated layer as much as the sharded one is invisible to",
        "sharded-vs-replicated parity; such plants are caught by the oracle (the layer against a composition",
        "written from the Hugging Face forwards) or the continuation check. The \"runs\" column says where",
        "each plant acts: *sharded* (a TP or CP shard only: parity sees it), *stateful* (calls from a carried",
        "state and decode steps: the continuation check), *trainer* (micro-batches and the trainer's",
        "reduction: the training step), *everywhere* (the replicated layer too), *kernel* (fla's kernel",
        "itself: its kernel test).",
        "",
        f"Generated on {date} at commit {commit} by `{COMMAND}` (the record's run took {seconds:.0f} s, the",
        f"kernel tests' {kernel_seconds:.0f} s, the engine plants' {engine_seconds:.0f} s, on this page's machine, every check and reference included).",
        "Do not edit by hand.",
        "",
        "| # | bug | upstream report | class | check | runs | fidelity | caught | time to catch | located by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in BUGS:
        row = rows.get(b.key, {"outcome": "not run"})
        reports = ", ".join(f"[{_cell(str(r))}]({r.url})" for r in b.reports)
        if row["outcome"] == "caught":
            verdict, took, where = "yes", f"{float(row['seconds']):.2f} s", f"`{_cell(row['located'])}`"
        elif row["outcome"] == "xfail":
            verdict, took, where = "no", "", f"needs {_cell(b.missing)}"
        elif row["outcome"] == "live":
            verdict, took = f"live in {fla}", f"{float(row['seconds']):.2f} s"
            where = f"`{_cell(row['located'])}`"
        else:
            verdict, took, where = row["outcome"], "", ""
        check = CHECKS[b.check]
        if b.suite != "cpu":
            on = {"fla-interpret": " (fla's kernels under Triton's interpreter, float32, CPU)",
                  "gpu-1": " (fla's compiled kernels on a GPU)"}.get(b.suite, "")
            check += f": `{b.kernel_test}`{on}"
            if b.repro:
                where = (f"strict xfail naming the report, the report's row: {where}; repro: `{b.repro}` "
                         f"([live bugs](live-bugs.md))")
            elif row["outcome"] == "caught":
                where += " (the plant applied in the test; the unplanted kernel passes)"
            where += f"; {_cell(_gpu_cell(b, gpu_rows, gpu_run))}"
        elif b.gpu_test:  # a CPU row whose check also runs on fla's compiled kernels
            where += f"; {_cell(_gpu_cell(b, gpu_rows, gpu_run))}"
        check += _cell(_engine_cell(b, engine_cases))
        fidelity = f"*{b.fidelity}*" + (f": {_cell(b.fidelity_note)}" if b.fidelity_note else "")
        lines.append(f"| {b.row} | **{b.key}**: {_cell(b.mechanism)} | {reports} | {_cell(b.bug_class)} | "
                     f"{_cell(check)} | {b.runs} | {fidelity} | {verdict} | {took} | {where} |")
    lines += ["", "Rows marked \"also\" come from the record's list of related reports outside its main table; rows "
              "N1-N33 from its second half (a search of December 2026).", "",
              "## Not in the record yet", "",
              f"{len(NOT_YET)} reports of the second half are not planted yet; each needs what the last column says.",
              "", "| # | upstream report | mechanism | needs |", "|---|---|---|---|"]
    for n in NOT_YET:
        reports = ", ".join(f"[{_cell(str(r))}]({r.url})" for r in n.reports)
        lines.append(f"| {n.row} | {reports} | {_cell(n.mechanism)} | {_cell(n.needs)} |")
    lines.append("")
    return "\n".join(lines)


def fidelity_counts() -> dict[str, int]:
    """How many entries the registry states at each fidelity."""
    return {f: sum(b.fidelity == f for b in BUGS) for f in FIDELITIES}


def entries_words(total: int) -> str:
    """'31 reported bugs and 2 project findings': the entries, reports and findings apart."""
    findings = fidelity_counts()["project finding"]
    return f"{total - findings} reported bugs and {findings} project finding{'' if findings == 1 else 's'}"


def fidelity_words() -> str:
    """'20 faithful, 4 moved, 7 partial': the reported bugs by fidelity to their report."""
    counts = fidelity_counts()
    return ", ".join(f"{counts[f]} {f}" for f in FIDELITIES if f != "project finding")


def headline(cpu: int, gpu: int, total: int, gpu_run: str = "", kernel: int = 0, live=(),
             fla: str = "the pinned fla") -> str:
    """The count people read first: the entries (reported bugs and project findings apart) caught
    on the CPU (the record's checks; fla's kernels under Triton's interpreter), live bugs of the
    pinned fla, kernel bugs caught on a GPU only; then the reported bugs by fidelity."""
    found = cpu + kernel + len(live) + gpu
    text = (f"**{found} of {total} caught ({entries_words(total)})**, each with a report that locates it: "
            f"{cpu} on the CPU")
    if kernel:
        text += f", {kernel} in fla's own kernels under Triton's interpreter on a CPU"
    if live:
        text += (f", {len(live)} live in {fla} ({', '.join(live)}: found in fla's own kernel, a strict xfail with a "
                 f"standalone repro)")
    text += f", {gpu} kernel bugs on a GPU only ({gpu_run})." if gpu else "."
    return text + (f" The reported bugs by fidelity to their report: {fidelity_words()} (the fidelity column says "
                   f"how). {len(NOT_YET)} more reports of the record's second half are not planted yet (the last "
                   f"table says what each needs).")


def update_readme(cpu: int, gpu: int, total: int, live: int = 0, fla: str = "the pinned fla") -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    where = (f"{cpu + live} on a CPU" + (f", {gpu} kernel bugs on a GPU" if gpu else "")
             + (f"; {live} of them live in {fla}, found in its own kernel" if live else ""))
    line = (f"{README_START}\nThe public bug record is its benchmark: {cpu + gpu + live} of {total} sharding and state "
            f"bugs ({entries_words(total)}) are caught with a report that locates them ({where}); the reported bugs "
            f"by fidelity to their report: {fidelity_words()}; {len(NOT_YET)} more reports not planted yet "
            f"([docs/bugs.md](docs/bugs.md), generated from a run, says how for each and what each missing one "
            f"needs).\n{README_END}")
    if README_START in text:
        text = re.sub(re.escape(README_START) + r".*?" + re.escape(README_END), line, text, flags=re.S)
    else:
        anchor = "\nOn a CPU everything runs over gloo"
        if anchor not in text:
            raise SystemExit("README.md: the 'What it is' section's last paragraph was not found")
        text = text.replace(anchor, f"\n{line}\n{anchor}", 1)
    readme.write_text(text)


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
