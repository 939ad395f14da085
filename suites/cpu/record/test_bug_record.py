"""The public bug record, reproduced: every registry entry (suites/bug_record/registry.py) runs
its check on the project's layer (which must pass) and on the entry's plant (which must fail,
its report locating the bug: the tensor and the sequence, token, call or rank). Entries whose
class has no check yet are strict xfails: the closest check runs on the plant and cannot see it.

docs/bugs.md is written from a run of this file (suites/bug_record/write_bugs_md.py).
"""

import re
import time

import pytest

from bug_record import checks
from bug_record import plants_layer
from bug_record.registry import BUGS, Bug
from pytest_linattn.harness import Placement, assert_sharded_parity
from pytest_linattn.parity import capture_records

_CLEAN: set = set()  # the checks the project's layer passed in this process


def _entries():
    return list(_entry_params())


def _entry_params():
    for bug in BUGS:
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
    report = str(info.value)
    found = re.search(bug.located, report)
    assert found, f"{bug.key}: the report does not locate it as {bug.located!r}:\n{report}"
    lines = [re.sub(r"\s{2,}", "  ", line.strip()) for line in found.group(0).strip().splitlines()]
    record_property("located", lines[0] if len(lines) == 1 else f"{lines[0]} / {lines[-1]}")


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
    for b in BUGS:
        assert b.check in checks.CHECKS, b.key
        assert b.runs in ("sharded", "stateful", "trainer", "everywhere"), b.key
        assert b.reports and all(r.url.startswith("https://github.com/") for r in b.reports), b.key
        assert bool(b.located) != bool(b.missing), f"{b.key}: a located report or a missing check, not both"
        assert not b.missing or b.missing.startswith("the "), b.key
        # a plant the replicated layer runs too is for a check with its own reference (the oracle, document
        # isolation) or a missing check, never parity
        assert b.runs != "everywhere" or b.check in ("oracle", "isolation") or b.missing, b.key
        assert b.suite == "cpu" or b.missing, f"{b.key}: a GPU-only row is an xfail on the CPU"
