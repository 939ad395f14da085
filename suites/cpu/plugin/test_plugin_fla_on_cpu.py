"""The fla_on_cpu fixture and the --linattn-fla-on-cpu option / ini key, in fresh pytest runs:
the emulation is on in the test process and in every rank spawn runs while (and only while) a
test asks for it, and fla's originals are back afterwards."""
from __future__ import annotations

pytest_plugins = ["pytester"]

INNER = r'''
import torch


def emulation_state():
    from linattn.emulation import active_compute_dtype
    import fla.ops.kda as kda

    return str(active_compute_dtype()), kda.chunk_kda.__module__


def test_fixture(spawn, fla_on_cpu):
    assert fla_on_cpu == torch.float64
    local = emulation_state()
    assert local == ("torch.float64", "linattn.emulation.delta_rules")
    assert spawn(emulation_state, 2) == [local, local]


def test_plain(spawn):
    off = ("None", "fla.ops.kda.chunk")
    assert emulation_state() == off
    assert spawn(emulation_state, 2) == [off, off]
'''


def test_fixture_on_in_test_and_ranks_only_where_asked(pytester):
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "pytest_linattn", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


# A test that asks for nothing; with the option (or ini key) on it runs emulated. No spawn here:
# the ranks' side is the first test's.
EMULATED_WITHOUT_ASKING = r'''
def test_emulated_without_asking():
    from linattn.emulation import active_compute_dtype
    import fla.ops.kda as kda

    assert str(active_compute_dtype()) == "torch.float64"
    assert kda.chunk_kda.__module__ == "linattn.emulation.delta_rules"
'''


def test_option_and_ini_turn_it_on_for_every_test(pytester):
    pytester.makepyfile(test_inner=EMULATED_WITHOUT_ASKING)
    result = pytester.runpytest_subprocess("-p", "pytest_linattn", "-q", "--linattn-fla-on-cpu")
    result.assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nlinattn_fla_on_cpu = on\n")
    result = pytester.runpytest_subprocess("-p", "pytest_linattn", "-q")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "pytest_linattn", "-q", "--linattn-fla-on-cpu=off")
    result.assert_outcomes(failed=1)  # the command line wins over the ini key


def test_bad_value_names_the_option(pytester):
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "pytest_linattn", "--linattn-fla-on-cpu=maybe")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--linattn-fla-on-cpu*expected on or off*maybe*"])
