"""The public bug record, reproduced: every registry entry (suites/bug_record/registry.py) runs
its check on the project's layer (which must pass) and on the entry's plant (which must fail,
its report locating the bug: the tensor and the sequence, token, call or rank). Entries whose
class has no check yet are strict xfails: the closest check runs on the plant and cannot see it.
Kernel rows (a bug in fla's kernels, which the layers cannot reach) are caught by their kernel
test in another suite (`Bug.kernel_test`); here only their registry entry is checked.

docs/bugs.md is written from a run of this file (suites/bug_record/write_bugs_md.py).
"""

import ast
import re
import time
from pathlib import Path

import pytest

from bug_record import checks
from bug_record import plants_layer
from bug_record.registry import BUGS, FIDELITIES, NOT_YET, Bug
from clients.per_token_loss import per_token_training_step
from pytest_linattn.harness import Placement, assert_sharded_parity
from pytest_linattn.parity import capture_records

_CLEAN: set = set()  # the checks the project's layer passed in this process
_REPORTS: dict = {}  # each caught entry's report in this process: its plant's failure, as the check wrote it
ROOT = Path(__file__).resolve().parents[3]


def _entries():
    return list(_entry_params())


def _entry_params():
    for bug in BUGS:
        if bug.suite != "cpu":  # a kernel row: its kernel test runs in its own suite
            continue
        marks = () if bug.caught else (pytest.mark.xfail(strict=True, raises=pytest.fail.Exception,
                                                         reason=f"needs {bug.missing}"),)
        yield pytest.param(bug, id=bug.key, marks=marks)


@pytest.mark.parametrize("bug", _entries())
def test_reported_bug_is_caught_and_located(spawn, bug: Bug, record_property):
    record_property("check", bug.check)
    if bug.check not in _CLEAN:  # the unplanted layer passes the check the plant must fail
        checks.run(spawn, bug.check)
        _CLEAN.add(bug.check)
    subject = bug.plant()
    start = time.perf_counter()
    with capture_records(), pytest.raises(AssertionError) as info:
        checks.run(spawn, bug.check, subject)
    record_property("seconds", f"{time.perf_counter() - start:.2f}")
    report = _REPORTS[bug.key] = str(info.value)
    found = re.search(bug.located, report)
    assert found, f"{bug.key}: the report does not locate it as {bug.located!r}:\n{report}"
    lines = [re.sub(r"\s{2,}", "  ", line.strip()) for line in found.group(0).strip().splitlines()]
    record_property("located", lines[0] if len(lines) == 1 else f"{lines[0]} / {lines[-1]}")


def _sharing_a_check() -> dict[str, list[Bug]]:
    """The caught CPU entries of every check that catches more than one."""
    rows: dict[str, list[Bug]] = {}
    for bug in BUGS:
        if bug.suite == "cpu" and bug.caught:
            rows.setdefault(bug.check, []).append(bug)
    return {check: bugs for check, bugs in rows.items() if len(bugs) > 1}


def test_each_located_pattern_matches_its_own_plant_only(spawn):
    # a located line names what only its plant breaks: of the entries caught by one check, each one's
    # pattern misses every other one's report (a pattern any failure of the check matches fails here).
    # The reports are the test above's, kept in this process; one it did not make here (xdist sent that
    # entry to another worker, or -k left it out) is made again
    for check, bugs in _sharing_a_check().items():
        for bug in bugs:
            if bug.key not in _REPORTS:
                with capture_records(), pytest.raises(AssertionError) as info:
                    checks.run(spawn, check, bug.plant())
                _REPORTS[bug.key] = str(info.value)
        for bug in bugs:
            others = [other.key for other in bugs if other is not bug and re.search(bug.located, _REPORTS[other.key])]
            assert not others, f"{bug.key}'s located pattern also matches the report of {others} ({check})"


def test_a_plant_in_the_replicated_layer_is_invisible_to_parity(spawn):
    # the planting rule: slime #1686's plant changes every placement alike, so TP parity against a
    # replicated layer carrying it passes; the oracle (test above) is what catches it
    plant = plants_layer.DeltaRuleWithoutBoundaries
    with capture_records():
        assert_sharded_parity(spawn, plants_layer.planted_layer(checks.CONFIG, plant), checks.reference(plant),
                              [Placement(tp=2)], checks.CU, hidden_size=checks.CONFIG.hidden_size, seed=checks.SEED,
                              rtol=checks.RTOL, name="record")


def test_registry_entries_are_complete():
    keys = [b.key for b in BUGS]
    assert len(keys) == len(set(keys)), keys
    # a report not planted yet is not also an entry, and says what it needs
    planted = {b.row for b in BUGS}
    for n in NOT_YET:
        assert n.row not in planted and n.needs and n.reports, n.row
        assert all(r.url.startswith("https://github.com/") for r in n.reports), n.row
    for b in BUGS:
        # fidelity is stated, never implied: how the plant stands to the report, and how when not simply faithful
        assert b.fidelity in FIDELITIES, f"{b.key}: fidelity {b.fidelity!r}, not one of {FIDELITIES}"
        assert b.fidelity == "faithful" or len(b.fidelity_note) > 20, f"{b.key}: a {b.fidelity} entry says how"
        assert b.fidelity != "project finding" or b.fidelity_note.startswith("no upstream report"), b.key
        assert b.check in checks.CHECKS, b.key
        assert b.runs in ("sharded", "stateful", "trainer", "everywhere", "kernel"), b.key
        assert b.reports and all(r.url.startswith("https://github.com/") for r in b.reports), b.key
        _assert_engine_tests(b)
        if b.suite != "cpu":  # a kernel row: caught and located by its kernel test
            _assert_kernel_row(b)
            continue
        assert b.plant is not None and b.check != "kernel" and b.runs != "kernel" and not b.kernel_test, b.key
        assert bool(b.located) != bool(b.missing), f"{b.key}: a located report or a missing check, not both"
        assert not b.missing or b.missing.startswith("the "), b.key
        # a plant the replicated layer runs too is for a check with its own reference (the oracle, document
        # isolation, the fresh init's finiteness, the gate gradients' float64 op) or a missing check, never parity
        assert b.runs != "everywhere" or b.check in ("oracle", "isolation", "fresh-init", "gate-gradients", "delta-rule-at-scale", "rows-at-scale") \
            or b.missing, b.key


def _test_functions(path: Path) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def _strict_xfail_reason(function: ast.FunctionDef) -> str | None:
    """The reason of a `@pytest.mark.xfail(strict=True, reason=...)` on the function, else None."""
    for mark in function.decorator_list:
        if isinstance(mark, ast.Call) and ast.unparse(mark.func) == "pytest.mark.xfail":
            options = {k.arg: k.value for k in mark.keywords}
            strict, reason = options.get("strict"), options.get("reason")
            if isinstance(strict, ast.Constant) and strict.value is True and isinstance(reason, ast.Constant):
                return str(reason.value)
    return None


ENGINE_PLANTS = ROOT / "suites/engines/test_record_on_engines.py"


def _assert_engine_tests(b: Bug) -> None:
    """An entry's engine plants are test functions of the engines suite's record file, none an xfail
    (a plant on the engines' kernels is caught there, or the entry does not name it)."""
    functions = _test_functions(ENGINE_PLANTS)
    for test in b.engine_tests:
        file, _, function = test.partition("::")
        assert ROOT / file == ENGINE_PLANTS, f"{b.key}: engine test {test!r} is not in {ENGINE_PLANTS.relative_to(ROOT)}"
        assert function in functions, f"{b.key}: {file} has no test function {function!r}"
        assert _strict_xfail_reason(functions[function]) is None, f"{b.key}: {test} is an xfail"


def test_every_engine_plant_is_an_entry_s():
    # a plant on the engines' kernels counts only as a registry entry's catch: none is left unnamed
    named = {t.partition("::")[2] for b in BUGS for t in b.engine_tests}
    assert set(_test_functions(ENGINE_PLANTS)) == named


def _assert_kernel_row(b: Bug) -> None:
    """A kernel row names existing test functions in existing files of its suite (and gpu-1), no
    plant and nothing run here; a live bug (a repro) has its script under suites/live_bugs/ and its tests are
    strict xfails whose reason names the report."""
    assert b.check == "kernel" and b.runs == "kernel" and b.plant is None, f"{b.key}: a kernel row's check is its test"
    assert not b.located and not b.missing, f"{b.key}: its kernel test locates it, nothing runs here"
    for test, suite in ((b.kernel_test, b.suite), (b.gpu_test, "gpu-1")):
        if not test and suite == "gpu-1":
            continue
        file, _, function = test.partition("::")
        assert file.startswith(f"suites/{suite}/") and (ROOT / file).is_file(), f"{b.key}: no test file {file!r}"
        functions = _test_functions(ROOT / file)
        assert function in functions, f"{b.key}: {file} has no test function {function!r}"
        reason = _strict_xfail_reason(functions[function])
        if b.repro:
            assert reason and any(r.ref in reason for r in b.reports), f"{b.key}: {test} is no strict xfail naming it"
        else:
            assert reason is None, f"{b.key}: {test} is an xfail, but the entry names no repro (a live bug has one)"
    assert not b.repro or (b.repro.startswith("suites/live_bugs/") and (ROOT / b.repro).is_file()), f"{b.key}: repro {b.repro!r}"


def test_a_trainer_plant_s_client_passes_unplanted(spawn):
    # verl #6609's plant is a loss function inside a client trainer (suites/clients/per_token_loss.py):
    # the same trainer with the client's own loss function passes the check the plant fails
    layer = plants_layer.planted_layer(checks.CONFIG)
    with capture_records():
        checks.run(spawn, "training-cp", (layer, per_token_training_step(steps=2, max_norm=checks.MAX_NORM)))
