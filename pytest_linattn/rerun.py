"""linattn-rerun: rerun test files in their home suites, from a `/rerun-test` PR comment or a file list.

    linattn-rerun "/rerun-test suites/gpu-2/test_tp.py suites/cpu/test_ref.py"
    linattn-rerun suites/cpu/test_ref.py suites/gpu-2/test_tp.py
    linattn-rerun --dry-run --out reports/rerun -- "$COMMENT_BODY"

The comment is untrusted: every token must name an existing test_*.py inside a collectable suite
folder, and nothing goes through a shell. Runs `python -m pytest` once per suite with that suite's
options, writes <out>/<suite>.xml (JUnit) and <out>/summary.md (for the pull request).
Exit status: 0 all passed, 1 a test failed, 2 bad request or missing resources.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pytest_linattn import compile_log
from pytest_linattn.ranks.gpus import gpu_count as visible_gpu_count
from pytest_linattn.ranks.gpus import gpus_for, sharing_note
from pytest_linattn.ranks.worker import set_parent_death_signal
from pytest_linattn.suites import Suite, SuiteConfigError, find_root, load_suites

COMMAND = "/rerun-test"
MAX_FILES = 20
INTERRUPT_GRACE_S = 120  # how long an interrupted pytest gets to stop its ranks and write its report
OK, FAILED, BAD_REQUEST = 0, 1, 2
# Only characters that a test path needs: no quotes, $, `, ;, |, &, spaces, globs or node ids.
_SAFE = re.compile(r"^[A-Za-z0-9_./-]+$")
_TEST_FILE = re.compile(r"^test_[A-Za-z0-9_]*\.py$")
GPU_COUNT_ENV = "LINATTN_GPU_COUNT"  # tests (and dry runs elsewhere) pretend a GPU count


class BadRequest(Exception):
    """The request cannot run; the message lines say why, one per offending token or suite."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


# --- parsing and checking the request ---

def request_tokens(items: list[str]) -> list[str]:
    """The file tokens of a request: after /rerun-test on its first line, or the items themselves."""
    text = " ".join(items)
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == COMMAND:
            return words[1:]  # later lines are prose, ignored
    if re.search(rf"(?<!\S){COMMAND}(?!\S)", text):
        raise BadRequest([f"{COMMAND} must start its line, followed by test files"])
    return text.split()


def check_token(token: str, root: Path, suites: dict[str, Suite]) -> tuple[str, str]:
    """(suite, normalised relative path) for a good token; raises ValueError naming the rule broken."""
    if not _SAFE.match(token):
        raise ValueError("only letters, digits, '_', '-', '.' and '/' are allowed in a test path")
    if token.startswith("-"):
        raise ValueError("options are not accepted, only test files")
    if token.startswith("/"):
        raise ValueError("absolute paths are not accepted: give the path from the repository root")
    path = PurePosixPath(token)
    if ".." in path.parts:
        raise ValueError("'..' is not allowed in a test path")
    parts = path.parts  # PurePosixPath already drops '.' and empty parts
    if len(parts) < 3 or parts[0] != "suites":
        raise ValueError("not inside a suite folder: test files live in suites/<suite>/")
    name = parts[1]
    if name not in suites:
        raise ValueError(f"unknown suite {name!r} (suites: {', '.join(suites)})")
    if not suites[name].collect:
        raise ValueError(f"suite {name!r} is not a test suite: its scripts are run directly with python")
    if not _TEST_FILE.match(parts[-1]):
        raise ValueError("not a test file: the name must be test_*.py")
    full = root / Path(*parts)
    if not full.is_file():
        raise ValueError("no such test file")
    try:  # a symlink must not lead out of its suite
        full.resolve().relative_to((root / "suites" / name).resolve())
    except ValueError:
        raise ValueError("resolves outside its suite folder") from None
    return name, path.as_posix()


def group_request(tokens: list[str], root: Path, suites: dict[str, Suite]) -> dict[str, list[str]]:
    """Files by home suite, in suites.toml order; BadRequest lists every offending token."""
    if not tokens:
        raise BadRequest([f"no test files given: {COMMAND} suites/<suite>/test_<name>.py ..."])
    if len(tokens) > MAX_FILES:
        raise BadRequest([f"{len(tokens)} files requested: at most {MAX_FILES} per request"])
    errors, groups = [], {}
    for token in tokens:
        try:
            name, rel = check_token(token, root, suites)
        except ValueError as e:
            errors.append(f"{_quote(token)}: {e}")
            continue
        if rel not in groups.setdefault(name, []):
            groups[name].append(rel)
    if errors:
        raise BadRequest(errors)
    return {n: groups[n] for n in suites if n in groups}


def _quote(token: str) -> str:
    # Untrusted text goes into Markdown: keep it short and unable to close the code span.
    t = token if len(token) <= 80 else token[:77] + "..."
    return "`" + t.replace("`", "'") + "`"


# --- resources ---

def gpu_count() -> int:
    """GPUs this process can use; LINATTN_GPU_COUNT overrides it (tests, dry runs)."""
    env = os.environ.get(GPU_COUNT_ENV)
    if env is not None:
        return int(env)
    # The plugin's count (CUDA_VISIBLE_DEVICES-aware), so the rerun and gpus(n) agree; it creates
    # no CUDA context here: only the pytest children use the GPUs.
    return visible_gpu_count()


def parse_ranks_per_gpu(value: str) -> str:
    """--ranks-per-gpu: a positive count, or auto."""
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {value!r}")
    return value


def ranks_per_gpu(suite: Suite, asked: str, gpus: int) -> int:
    """The ranks that share a GPU in `suite` on a machine with `gpus` GPUs: `asked` (a count), or
    auto: as few as fit (1, NCCL, where the machine has the suite's GPUs; else ceil(needed / gpus))."""
    if asked != "auto":
        return int(asked)
    return 1 if not suite.gpus or gpus >= suite.gpus else -(-suite.gpus // max(gpus, 1))


def check_resources(groups: dict[str, list[str]], suites: dict[str, Suite], gpus: int | None = None,
                    per_gpu: str = "1") -> list[str]:
    """One line per suite this machine cannot run (empty when all can); per_gpu as --ranks-per-gpu."""
    needed = [n for n in groups if suites[n].gpus]
    if not needed:
        return []
    have = gpu_count() if gpus is None else gpus
    lines = []
    for n in needed:
        shared = ranks_per_gpu(suites[n], per_gpu, have)
        need = gpus_for(suites[n].gpus, shared)
        if need > have:
            how = f" at {shared} ranks per GPU" if shared > 1 else ""
            lines.append(f"suite {n} needs {need} GPU{'s' * (need > 1)}{how}, this machine has {have}: "
                         f"refusing {', '.join(groups[n])}")
    return lines


# --- running ---

def pytest_command(suite: Suite, files: list[str], out: Path, per_gpu: int = 1) -> list[str]:
    shared = ["--linattn-ranks-per-gpu", str(per_gpu)] if per_gpu > 1 else []
    return [sys.executable, "-m", "pytest", *files, *suite.pytest_options(), *shared,
            f"--junitxml={out / (suite.name + '.xml')}", "-o", f"junit_suite_name={suite.name}"]


@dataclass
class SuiteResult:
    suite: str
    files: list[str]
    returncode: int
    seconds: float
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (test, first error line)
    has_report: bool = False
    interrupted: bool = False
    transport: str | None = None  # ranks sharing GPUs: what the summary says of them

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.failed and not self.errors and not self.interrupted


def read_junit(xml_path: Path, result: SuiteResult) -> SuiteResult:
    """Fill counts and failing tests from a pytest JUnit XML file."""
    try:
        tree = ET.parse(xml_path)
    except (OSError, ET.ParseError):
        return result
    result.has_report = True
    # an interrupted pytest writes the test it was stopped in as a nameless testcase: not a result
    cases = [case for case in tree.iter("testcase") if case.get("name")]
    for case in cases:
        test = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        bad = case.find("failure")
        kind = "failed"
        if bad is None:
            bad, kind = case.find("error"), "error"
        if bad is not None:
            if kind == "failed":
                result.failed += 1
            else:
                result.errors += 1
            result.failures.append((test, first_error_line(bad)))
        elif case.find("skipped") is not None:
            result.skipped += 1
        else:
            result.passed += 1
    return result


def first_error_line(element) -> str:
    """The first line of a failure's message, or else its first `E   ` traceback line."""
    for line in (element.get("message") or "").splitlines():
        if line.strip():
            return line.strip()
    text = element.text or ""
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def run_suite(suite: Suite, files: list[str], root: Path, out: Path, per_gpu: int = 1) -> SuiteResult:
    xml = out / f"{suite.name}.xml"
    xml.unlink(missing_ok=True)  # never report a previous run's results
    start = time.monotonic()
    # a list: no shell; its own process group, so a signal to ours (Ctrl-C, `timeout`) reaches
    # pytest only as the SIGINT forwarded below
    proc = subprocess.Popen(pytest_command(suite, files, out, per_gpu), cwd=root, process_group=0,
                            preexec_fn=_child_signals)
    interrupted = False
    try:
        proc.wait()
    except KeyboardInterrupt:
        # Cancelled (Ctrl-C, or SIGTERM from a CI timeout): pytest stops at the running test on
        # SIGINT and still writes its JUnit report, so the summary keeps what finished.
        interrupted = True
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    transport = sharing_note(suite.gpus, gpus_for(suite.gpus, per_gpu)) if suite.gpus else None
    result = SuiteResult(suite.name, files, proc.returncode, time.monotonic() - start, interrupted=interrupted,
                         transport=transport)
    return read_junit(xml, result)


def _child_signals() -> None:
    # SIGINT may be ignored where we run (a background job of a script): pytest needs it to stop
    # cleanly. PR_SET_PDEATHSIG: pytest (and through theirs its ranks) die if we are killed.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    set_parent_death_signal(signal.SIGTERM)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# --- the summary posted on the pull request ---

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'").replace("\n", " ")


def summary_markdown(results: list[SuiteResult]) -> str:
    passed = sum(r.passed for r in results)
    failed = sum(r.failed + r.errors for r in results)
    total_s = sum(r.seconds for r in results)
    verdict = ("interrupted" if any(r.interrupted for r in results)
               else "passed" if all(r.ok for r in results) else "failed")
    lines = [f"### {COMMAND} {verdict}: {passed} passed, {failed} failed in {total_s:.1f} s", "",
             "| suite | files | passed | failed | errors | skipped | time |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        files = "<br>".join(f"`{_cell(f)}`" for f in r.files)
        failed_cell = str(r.failed) if r.has_report else f"no report (pytest exit {r.returncode})"
        lines.append(f"| {r.suite} | {files} | {r.passed} | {failed_cell} | {r.errors} | {r.skipped} "
                     f"| {r.seconds:.1f} s{' (interrupted)' * r.interrupted} |")
    bad = [(r.suite, t, e) for r in results for t, e in r.failures]
    if bad:
        lines += ["", "**Failing tests**", ""]
        lines += [f"- `{_cell(t)}` ({s}): `{_cell(e)[:200]}`" for s, t, e in bad]
    for r in results:
        if r.transport:
            lines += ["", f"Suite {r.suite}: {r.transport} (--linattn-ranks-per-gpu)."]
    for r in results:
        if r.interrupted:
            lines += ["", f"Suite {r.suite} was interrupted: the test running then is not counted, "
                          "later tests and suites did not run."]
    return "\n".join(lines) + "\n"


def per_file_markdown(folder: str | None) -> str:
    """Per test file, slowest first: its tests' time and the Triton compiles while they ran
    (pytest_linattn.compile_log; empty without its folder)."""
    rows = compile_log.per_file_seconds(folder) if folder and Path(folder).is_dir() else {}
    if not rows:
        return ""
    lines = ["", "| file | tests | compiling | kernels compiled |", "|---|---:|---:|---:|"]
    for file, row in sorted(rows.items(), key=lambda kv: -kv[1]["tests"]):
        lines.append(f"| `{_cell(file)}` | {row['tests']:.1f} s | {row['compile']:.1f} s | {row['kernels']:.0f} |")
    return "\n".join(lines) + "\n"


def refusal_markdown(lines: list[str]) -> str:
    return f"### {COMMAND} refused\n\n" + "".join(f"- {line}\n" for line in lines)


# --- the command ---

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="linattn-rerun", allow_abbrev=False,
        description="Rerun test files in their home suites (from a /rerun-test comment or a file list).")
    p.add_argument("items", nargs="*", help='"/rerun-test FILE..." comment text, or test files')
    p.add_argument("--dry-run", action="store_true", help="print the pytest commands; skip the GPU check")
    p.add_argument("--out", default="reports/rerun", help="folder for <suite>.xml and summary.md (default reports/rerun)")
    p.add_argument("--root", help="repository root (default: nearest folder above with suites/suites.toml)")
    p.add_argument("--ranks-per-gpu", default="1", type=parse_ranks_per_gpu, metavar="N|auto",
                   help="up to N ranks of a GPU suite share a GPU (--linattn-ranks-per-gpu, the staged transport); "
                        "auto: only where this machine has fewer GPUs than the suite needs (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args, extra = parser.parse_known_intermixed_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse has already printed
        return OK if not e.code else BAD_REQUEST
    root = Path(args.root).resolve() if args.root else find_root()
    if root is None or not (root / "suites" / "suites.toml").is_file():
        print("linattn-rerun: no suites/suites.toml here or above; pass --root", file=sys.stderr)
        return BAD_REQUEST
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.md"
    try:
        suites = load_suites(root)
        # Unknown options land in extra: they are checked like any other token (and refused).
        groups = group_request(request_tokens(args.items + extra), root, suites)
        if not args.dry_run:
            missing = check_resources(groups, suites, per_gpu=args.ranks_per_gpu)
            if missing:
                raise BadRequest(missing)
    except SuiteConfigError as e:
        print(f"linattn-rerun: {e}", file=sys.stderr)
        return BAD_REQUEST
    except BadRequest as e:
        text = refusal_markdown(e.lines)
        summary.write_text(text, encoding="utf-8")
        print(text, end="", file=sys.stderr)
        return BAD_REQUEST

    results = []
    # a cancelled job (SIGTERM) is handled like Ctrl-C: summarise what ran
    previous_handler = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        for name, files in groups.items():
            n = len(files)
            print(f"Running {n} file{'s' * (n != 1)} whose home suite is {name}", flush=True)
            per_gpu = ranks_per_gpu(suites[name], args.ranks_per_gpu, gpu_count())
            cmd = pytest_command(suites[name], files, out, per_gpu)
            if args.dry_run:
                print(f"  (in {root}) {shlex.join(cmd)}", flush=True)
                continue
            results.append(run_suite(suites[name], files, root, out, per_gpu))
            if results[-1].interrupted:
                break  # the remaining suites are not run; the summary lists what did
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    if args.dry_run:
        return OK
    text = summary_markdown(results) + per_file_markdown(os.environ.get(compile_log.ENV))
    summary.write_text(text, encoding="utf-8")
    print("\n" + text, end="", flush=True)
    return OK if all(r.ok for r in results) else FAILED


if __name__ == "__main__":
    sys.exit(main())
