"""Write docs/live-bugs.md from a run of the live bugs' repros.

    .venv/bin/python suites/live_bugs/write_live_bugs_md.py

For each entry of `suites/live_bugs/registry.py`: checks that the installed release is the entry's
pinned one (for vLLM and sglang, whose kernel files the repros load from .engines/, that the fetched
files are the pinned wheel's), runs its standalone repro (`python <repro>`, in a process of its own,
with the entry's timeout), keeps its output (stdout) and the seconds it took, and checks that the
output shows the bug (`LiveBug.shows`); where an entry names a GPU run (`LiveBug.gpu_evidence`: the
repro's on a GPU, or the test's where the demonstration needs one) the page quotes that
docs/results.md row. Then writes the table with the date, the git commit and the command.
Nothing in docs/live-bugs.md is typed by hand; the generator stops,
writing nothing, where a repro fails, times out or no longer shows its bug, or a release is not the
pinned one.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "suites"))

from live_bugs.registry import LIVE_BUGS, LiveBug  # noqa: E402

COMMAND = "python suites/live_bugs/write_live_bugs_md.py"
PAGE = ROOT / "docs" / "live-bugs.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return sha + (" (with uncommitted changes)" if dirty else "")


def installed(release: str) -> str:
    """The installed version of `release`'s distribution ("package==version" -> "version"). A serving
    engine (vLLM, sglang) is not installed: its repros load the kernel files `clients.engines.fetch`
    unpacked from the pinned wheel into .engines/, so its version is the fetched release's where those
    files are there as the wheel recorded them."""
    from clients.engines.fetch import RELEASES, is_fetched

    package = release.partition("==")[0]
    engine = next((r for r in RELEASES if r.engine == package), None)
    if engine is not None:
        return engine.version if is_fetched(engine) else "not fetched"
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_repro(bug: LiveBug) -> dict:
    """Run the repro with this interpreter; its stdout, the seconds it took, and the line shown in the table."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, bug.repro], cwd=ROOT, capture_output=True, text=True,
                              timeout=bug.timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{bug.key}: {bug.repro} ran past {bug.timeout} s: docs/live-bugs.md not written") from None
    seconds = time.monotonic() - started
    output = done.stdout.strip()
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{bug.key}: {bug.repro} exited {done.returncode}: docs/live-bugs.md not written")
    found = re.search(bug.shows, output)
    if not found:
        sys.stdout.write(output + "\n")
        raise SystemExit(f"{bug.key}: {bug.repro}'s output no longer shows the bug ({bug.shows!r}): update the entry")
    # the table's line: the one `bug.line` picks, else the output's line where the match ends
    if bug.line:
        line = next(text for text in output.splitlines() if re.search(bug.line, text))
    else:
        line = output[:found.end()].rsplit("\n", 1)[-1] + output[found.end():].split("\n", 1)[0]
    return dict(output=output, seconds=seconds, line=line.strip())


def gpu_row(bug: LiveBug) -> dict:
    """The docs/results.md row whose result cell holds `bug.gpu_evidence`: its sentence, date, machine,
    commit and command."""
    for line in (ROOT / "docs" / "results.md").read_text().splitlines():
        if bug.gpu_evidence in line:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            sentence = next(s for s in re.split(r"(?<=\))\. |(?<=[a-z])\. |(?<=\d)\. (?=[A-Z])", cells[1]) if bug.gpu_evidence in s)
            return dict(sentence=sentence.rstrip("."), date=cells[2], machine=cells[3], commit=cells[4],
                        command=cells[5])
    raise SystemExit(f"{bug.key}: no row of docs/results.md holds {bug.gpu_evidence!r}: docs/live-bugs.md not written")


def _report_name(url: str) -> str:
    """"owner/repo #N" of a GitHub issue or pull request URL."""
    owner_repo, _, number = re.fullmatch(r"https://github.com/([^/]+/[^/]+)/(issues|pull)/(\d+)", url).groups()
    return f"{owner_repo} #{number}"


def render(rows: dict[str, dict], date: str, commit: str, seconds: float) -> str:
    with_repro = [b for b in LIVE_BUGS if b.repro]
    lines = [
        "# Live bugs of the pinned releases",
        "",
        "What a check of the project flags in a pinned release is a live bug (DESIGN.md: \"Real code over",
        "look-alikes\"): the release's own code, run by the check against the float64 reference, computes",
        "something else. One row each, from `suites/live_bugs/registry.py`: the release, the kernel or layer",
        "(file:line in the release), what the project's check reports and the check, the standalone repro (a",
        "script run on its own, `python <path>`: torch and the release, no pytest; it prints the versions,",
        "what it compares and the error, and exits 0), its output as measured when this page was generated,",
        "the verdict the evidence supports, and the upstream report.",
        "",
        "The verdicts: *wrong result on a path callers use* (a caller of the release, or the report's own",
        "training, runs it), *wrong result outside the callers' contract* (an input the API does not",
        "promise to handle, accepted without an error), *latent (no caller)* (nothing in the pinned releases",
        "runs it; a client written the way a user would reaches it). The \"why\" column gives the evidence.",
        "A row without a repro needs a GPU: it says so, and quotes the run of the project's test that",
        "measured it (the results page's row). A repro also run on a GPU, fla's kernels compiled, quotes",
        "that run's row beside this page's.",
        "",
        f"**{len(LIVE_BUGS)} live bugs, {len(with_repro)} with a standalone repro run on this page's machine, "
        f"{len(LIVE_BUGS) - len(with_repro)} on a GPU only.**",
        "",
        f"Generated on {date} at commit {commit} by `{COMMAND}` (the repros' run took {seconds:.0f} s on this",
        "page's machine, a CPU; fla's and vLLM's kernels under Triton's interpreter). Nothing on this page is",
        "typed by hand; do not edit it.",
        "",
        "| # | release | kernel or layer | what the check reports | repro | measured | verdict | why | upstream |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, b in enumerate(LIVE_BUGS, 1):
        row = rows[b.key]
        check = f"{_cell(b.finding)} (`{_cell(b.found_by)}`)"
        if b.repro:
            note = f"; {_cell(b.repro_note)}" if b.repro_note else ""
            repro = f"`python {b.repro}` ({row['seconds']:.1f} s{note})"
            measured = f"`{_cell(row['line'])}` ([output](#{b.key}))"
        else:
            repro = f"GPU only: no standalone repro; the evidence is the strict xfail `{_cell(b.found_by)}`"
            measured = ""
        if b.gpu_evidence:
            g = row["gpu"]
            measured += ("; on a GPU: " if measured else "") + (
                f"{_cell(g['sentence'])} ({_cell(g['date'])}, {_cell(g['machine'])}, commit "
                f"{_cell(g['commit'])}, {_cell(g['command'])}; [results](results.md))")
        upstream = f"[{_report_name(b.upstream)}]({b.upstream}): {b.upstream_state}" if b.upstream else b.upstream_state
        lines.append(f"| {i} | **{b.key}**: `{b.release}` | {_cell(b.where)} | {check} "
                     f"| {repro} | {measured} | *{b.verdict}* | {_cell(b.verdict_why)} | {upstream} |")
    lines += ["", "## The repros' output", "",
              "Each repro's whole output (stdout) in this generation, with its command.", ""]
    for b in LIVE_BUGS:
        if not b.repro:
            continue
        lines += [f"### {b.key}", "", f"`python {b.repro}`", "", "```text", rows[b.key]["output"], "```", ""]
    return "\n".join(lines)


def main() -> None:
    rows = {}
    started = time.monotonic()
    for b in LIVE_BUGS:
        version = installed(b.release)
        if not b.repro and version == "not installed":  # a GPU-only row: the GPU kit's wheel, as measured there
            version = f"{b.release.partition('==')[2]} (the GPU kit's)"
        elif version != b.release.partition("==")[2]:
            raise SystemExit(f"{b.key}: {b.release} is pinned, {version} installed: docs/live-bugs.md not written")
        row = run_repro(b) if b.repro else {}
        if b.gpu_evidence:
            row["gpu"] = gpu_row(b)
        rows[b.key] = dict(row, installed=version)
        print(f"{b.key}: {row.get('line') or 'GPU only: ' + row['gpu']['sentence']}")
    seconds = time.monotonic() - started
    PAGE.write_text(render(rows, datetime.date.today().isoformat(), _commit(), seconds))
    shown = sum(bool(b.repro) for b in LIVE_BUGS)
    print(f"docs/live-bugs.md: {len(LIVE_BUGS)} live bugs, {shown} shown by their repro, "
          f"{len(LIVE_BUGS) - shown} GPU only, {seconds:.0f} s")


if __name__ == "__main__":
    main()
