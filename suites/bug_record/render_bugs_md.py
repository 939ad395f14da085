"""docs/bugs.md and the README's headline line, written from the rows of a run of the bug record
(`run_results`): the registry's entries with their outcome, time and locating line, the kernel
rows' GPU column, the engine plants, the headline counts and the reports not planted yet.
"""

from __future__ import annotations

import re
from pathlib import Path

from bug_record.checks import CHECKS
from bug_record.registry import BUGS, FIDELITIES, NOT_YET
from clients.engines.fetch import RELEASES

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FILE = "suites/engines/test_record_on_engines.py"
ENGINE_VERSIONS = {r.engine: r.version for r in RELEASES}
COMMAND = "python suites/bug_record/write_bugs_md.py"
README_START, README_END = "<!-- bug-record:start -->", "<!-- bug-record:end -->"


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
