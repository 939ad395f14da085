"""assert_parity: pass/fail, NaN/Inf, dicts, failure messages, records, summary and report files."""

import json
import math

import pytest
import torch

from tools.inner_pytest import runpytest_forked
from pytest_linattn import parity
from pytest_linattn.parity import RECORDS, assert_parity, capture_records, format_summary, set_current_test, write_report

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def recs():
    """These tests' records (many meant to fail) stay out of the run's parity summary."""
    before = len(RECORDS)
    with capture_records() as captured:
        yield captured
    assert len(RECORDS) == before


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_passes_within_tolerance_and_records_margin(recs):
    e = _x(2, 8, 3, 4)
    a = e + 1e-9 * _x(2, 8, 3, 4, seed=1)
    set_current_test("t::case")
    (rec,) = assert_parity(a, e, rtol=1e-6)
    err = float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))
    assert rec["passed"] and rec["error"] == pytest.approx(err)
    assert rec["margin"] == pytest.approx(1e-6 / err)
    assert rec["test"] == "t::case" and rec["tensor"] == "output" and rec["shape"] == [2, 8, 3, 4]
    assert recs == [rec]


def test_bf16_actual_against_float64_expected():
    e = _x(4, 16)
    assert_parity(e.to(torch.bfloat16), e, rtol=1e-2)
    with pytest.raises(AssertionError):
        assert_parity(e.to(torch.bfloat16), e, rtol=1e-5)


def test_fails_beyond_tolerance_and_names_everything(recs):
    e = _x(2, 8, 3, 4)
    a = e.clone()
    a[1, 5, 2, 3] += 0.5
    with pytest.raises(AssertionError) as info:
        assert_parity(a, e, rtol=1e-5, name="o")
    msg = str(info.value)
    err = 0.5 / float(torch.linalg.vector_norm(e))
    assert "o" in msg and f"{err:.2e}" in msg and "1.00e-05" in msg and "5.00e-01" in msg
    assert "batch 1 token 5, head 2" in msg and "(1, 5, 2, 3)" in msg
    assert not recs[-1]["passed"] and recs[-1]["worst"]["index"] == [1, 5, 2, 3]


def test_location_by_sequence_token_and_head(recs):
    cu = torch.tensor([0, 1, 7, 7, 20], dtype=torch.int32)  # an empty sequence is skipped
    e = _x(1, 20, 4, 8)
    a = e.clone()
    a[0, 9, 3, 1] -= 2.0
    with pytest.raises(AssertionError, match=r"seq 3 token 2 \(global 9\), head 3"):
        assert_parity(a, e, rtol=1e-3, cu_seqlens=cu)
    loc = recs[-1]["worst"]
    assert (loc["sequence"], loc["token_in_sequence"], loc["token"], loc["head"]) == (3, 2, 9, 3)


def test_plain_tensor_located_by_index():
    e = _x(5, 6)
    a = e.clone()
    a[3, 4] += 1.0
    with pytest.raises(AssertionError, match=r"index \(3, 4\)"):
        assert_parity(a, e, rtol=1e-3, cu_seqlens=torch.tensor([0, 6]))  # shape does not fit cu


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_fails_even_with_huge_tolerance(bad, recs):
    e = _x(1, 6, 2, 2)
    a = e.clone()
    a[0, 4, 1, 0] = bad
    with pytest.raises(AssertionError, match=r"non-finite.*token 4, head 1"):
        assert_parity(a, e, rtol=1e30)
    assert recs[-1]["margin"] == 0.0


def test_nonfinite_expected_fails_too():
    e = _x(3, 3)
    a = e.clone()
    e[0, 0] = math.nan
    with pytest.raises(AssertionError, match="first in expected"):
        assert_parity(a, e, rtol=1e30)


def test_dict_reports_only_failing_rows(recs):
    e = {"dq": _x(1, 8, 2, 4), "dk": _x(1, 8, 2, 4, seed=1), "dv": _x(1, 8, 2, 4, seed=2)}
    a = {k: v.clone() for k, v in e.items()}
    a["dk"][0, 3, 1, 2] += 1.0
    with pytest.raises(AssertionError) as info:
        assert_parity(a, e, rtol=1e-8, name="grads")
    lines = str(info.value).splitlines()
    assert "1 of 3" in lines[0] and "grads" in lines[0]
    assert [ln.split()[0] for ln in lines[2:]] == ["dk"]
    assert [r["tensor"] for r in recs] == ["dq", "dk", "dv"]
    assert [r["passed"] for r in recs] == [True, False, True]


def test_dict_key_mismatch_names_keys():
    e = {"dq": _x(2, 2), "dk": _x(2, 2)}
    a = {"dq": e["dq"].clone(), "dz": _x(2, 2)}
    with pytest.raises(AssertionError) as info:
        assert_parity(a, e, rtol=1e-5)
    msg = str(info.value)
    assert "dk" in msg and "missing from actual" in msg and "dz" in msg and "not in expected" in msg


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match=r"shape mismatch: actual \(2, 3\) vs expected \(3, 2\)"):
        assert_parity(_x(2, 3), _x(3, 2), rtol=1.0)


def test_zero_expected_uses_absolute_error():
    e = torch.zeros(4, 4, dtype=torch.float64)
    assert_parity(e + 1e-12, e, rtol=1e-10)
    with pytest.raises(AssertionError, match="expected is all zeros: absolute error"):
        assert_parity(e + 1e-3, e, rtol=1e-10)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="^rtol"):
        assert_parity(_x(2), _x(2), rtol=0)
    with pytest.raises(ValueError, match="^rtol"):
        assert_parity(_x(2), _x(2), rtol=math.nan)
    with pytest.raises(ValueError, match="^actual and expected"):
        assert_parity(_x(2), {"a": _x(2)}, rtol=1e-3)
    with pytest.raises(ValueError, match="^cu_seqlens"):
        assert_parity(_x(1, 4), _x(1, 4), rtol=1e-3, cu_seqlens=torch.tensor([0.0, 4.0]))


def test_summary_sorts_worst_margin_first_and_compacts(recs):
    e = _x(8)
    for i, scale in enumerate([1e-9, 1e-4, 1e-7]):
        set_current_test(f"t::case{i}")
        assert_parity(e + scale * _x(8, seed=1), e, rtol=1e-3)
    set_current_test("t::bad")
    with pytest.raises(AssertionError):
        assert_parity(e + 1.0, e, rtol=1e-3, name="y")
    text = format_summary(recs)
    rows = [ln.split()[0] for ln in text.splitlines()[2:]]
    assert rows == ["t::bad", "t::case1", "t::case2", "t::case0"]
    assert "1 failed" in text.splitlines()[0] and "FAIL" in text
    short = format_summary(recs, max_rows=2)
    assert len(short.splitlines()) == 2 + 2 + 1 and "2 more passing" in short
    assert format_summary([]) == ""


def test_write_report_json_and_heatmap(tmp_path, recs):
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    e = _x(1, 12, 3, 4)
    a = e.clone()
    a[0, 6, 1] += 1.0
    a[0, 2, 0, 0] = math.nan
    set_current_test("suites/cpu/test_x.py::test_cp[tp=2/cp=4]")
    assert_parity(e, e, rtol=1e-5, name="fine")
    with pytest.raises(AssertionError):
        assert_parity({"o": a}, {"o": e}, rtol=1e-5, cu_seqlens=cu)
    paths = write_report(recs, tmp_path / "rep")
    names = sorted(p.name for p in paths)
    assert names == ["parity.json", "suites_cpu_test_x.py_test_cp_tp_2_cp_4__o.png"]
    data = json.loads((tmp_path / "rep" / "parity.json").read_text())
    assert [r["passed"] for r in data] == [True, False]
    bad = data[1]
    assert bad["error"] == "nan" and bad["cu_seqlens"] == [0, 5, 12]
    assert len(bad["map"]) == 3 and len(bad["map"][0]) == 12  # head × token
    png = (tmp_path / "rep" / names[1]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_error_map_is_binned_for_long_tensors(recs):
    e = _x(1, 5000, 2, 2)
    a = e + 1.0
    with pytest.raises(AssertionError):
        assert_parity(a, e, rtol=1e-5)
    rec = recs[-1]
    assert len(rec["map"][0]) <= parity.MAP_MAX_TOKENS and rec["map_x_bin"] == 10
    # Cells add up in quadrature to the tensor's error.
    total = math.sqrt(sum(v * v for row in rec["map"] for v in row))
    assert total == pytest.approx(rec["error"])


def test_cu_seqlens_must_end_at_the_token_count():
    e = _x(1, 8, 3)
    with pytest.raises(ValueError, match=r"^cu_seqlens must end at the token count T .*"
                                         r"cu_seqlens\[-1\] = 6, tensors have T = 8"):
        assert_parity(e + 1.0, e, rtol=1e-3, cu_seqlens=torch.tensor([0, 2, 6]))
    # a dict may also hold tensors without tokens (a final state [1, H, K, V]): one [1, T, ...] fits
    o, state = _x(1, 8, 2, 4), _x(1, 2, 4, 4)
    assert_parity({"o": o, "S": state}, {"o": o, "S": state}, rtol=1e-3, cu_seqlens=torch.tensor([0, 3, 8]))


def test_last_dim_of_hidden_is_a_feature_and_heads_have_channels():
    cu = torch.tensor([0, 3, 8])
    e = _x(1, 8, 5)
    a = e.clone()
    a[0, 6, 4] += 1.0
    with pytest.raises(AssertionError) as info:
        assert_parity(a, e, rtol=1e-3, cu_seqlens=cu)
    assert "seq 1 token 3 (global 6), feature 4 at index (0, 6, 4)" in str(info.value)
    assert "head" not in str(info.value)
    e = _x(1, 8, 2, 4)
    a = e.clone()
    a[0, 6, 1, 3] += 1.0
    with pytest.raises(AssertionError, match=r"seq 1 token 3 \(global 6\), head 1, channel 3 at index \(0, 6, 1, 3\)"):
        assert_parity(a, e, rtol=1e-3, cu_seqlens=cu)


# CP rank of each token of two sequences of 8 in the zigzag layout at cp = 2 (chunks of 2 tokens:
# rank 0 holds chunks 0 and 3 of each sequence); token 14 is on rank 0, not 14 // 8 = 1
ZIGZAG_CP2 = [0, 0, 1, 1, 1, 1, 0, 0] * 2


def test_failure_names_the_rank_holding_the_worst_token(recs):
    e = _x(1, 16, 3)
    a = e.clone()
    a[0, 14, 1] += 1.0
    with pytest.raises(AssertionError, match=r"seq 1 token 6 \(global 14\) on CP rank 0, feature 1"):
        assert_parity(a, e, rtol=1e-5, cu_seqlens=torch.tensor([0, 8, 16]), token_ranks={"CP rank": ZIGZAG_CP2})
    assert recs[-1]["worst"]["ranks"] == {"CP rank": 0}
    assert recs[-1]["shard_edges"] == [2, 6, 10, 14]


@pytest.mark.parametrize("token_ranks, rule", [
    ([0] * 16, r"^token_ranks must be a non-empty dict"),
    ({"CP rank": [0.5] * 16}, r"^token_ranks must map a rank kind \(str\) to one int rank per token"),
    ({"CP rank": [0] * 15}, r"^token_ranks must give one rank per token: lengths \[15\], cu_seqlens\[-1\] = 16"),
])
def test_bad_token_ranks_raise_value_error(token_ranks, rule):
    with pytest.raises(ValueError, match=rule):
        assert_parity(_x(1, 16, 3), _x(1, 16, 3), rtol=1e-3, cu_seqlens=torch.tensor([0, 16]), token_ranks=token_ranks)


def test_heatmap_names_the_comparison_and_marks_shard_edges(tmp_path, recs, monkeypatch):
    from matplotlib.axes import Axes

    titles, lines = [], []
    set_title, axvline = Axes.set_title, Axes.axvline
    monkeypatch.setattr(Axes, "set_title", lambda ax, text, **kw: titles.append(text) or set_title(ax, text, **kw))
    monkeypatch.setattr(Axes, "axvline", lambda ax, x=0, **kw: lines.append(x) or axvline(ax, x, **kw))
    e = _x(1, 16, 3)
    set_current_test("t::case")
    with pytest.raises(AssertionError):
        assert_parity({"o": e + 1.0}, {"o": e}, rtol=1e-5, name="cp2-zigzag/dp1 grads",
                      cu_seqlens=torch.tensor([0, 8, 16]), token_ranks={"CP rank": ZIGZAG_CP2})
    paths = write_report(recs, tmp_path)
    assert sorted(p.name for p in paths) == ["parity.json", "t_case__cp2-zigzag_dp1_grads_o.png"]
    assert "cp2-zigzag/dp1 grads: o" in titles[0]
    assert sorted(lines) == [2, 6, 8, 10, 14]  # shard edges and the sequence start at 8


BROKEN_TEST = """
import torch
from pytest_linattn import assert_parity


def test_broken():
    x = torch.randn(1, 8, 3, dtype=torch.float64)
    y = x.clone()
    y[0, 5, 1] += 10.0
    assert_parity(y, x, rtol=1e-10, name="grad_q")
"""


def test_report_without_matplotlib_still_shows_the_failure(pytester):
    # a pytest process of its own whose conftest makes matplotlib unimportable before the report needs it
    pytester.makeconftest('import sys\nsys.modules["matplotlib"] = None\n')
    pytester.makepyfile(test_inner=BROKEN_TEST)
    report = pytester.path / "report"
    result = runpytest_forked(pytester, "--linattn-report", str(report), "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*parity failed for grad_q*", "*worst element*", "*linattn parity*",
                                 "*no PNG: matplotlib is not installed*"])
    assert [p.name for p in report.iterdir()] == ["parity.json"]


def test_parameters_are_located_by_index_not_as_tokens(recs):
    # a conv weight gradient [D, 1, W] is not a [B, T, hidden] activation
    e = _x(32, 1, 4)
    a = e.clone()
    a[29, 0, 2] += 1.0
    with pytest.raises(AssertionError) as info:
        assert_parity({"conv1d.weight": a}, {"conv1d.weight": e}, rtol=1e-3, name="grad", activations=False)
    assert "conv1d.weight" in str(info.value) and "index (29, 0, 2)" in str(info.value)
    assert "batch" not in str(info.value) and "token" not in str(info.value) and "feature" not in str(info.value)
    assert (recs[-1]["map_y"], recs[-1]["map_x"]) == ("dim 0", "dims 1.. flattened")
    assert len(recs[-1]["map"]) == 32 and len(recs[-1]["map"][0]) == 4
    m = _x(4, 2)
    with pytest.raises(AssertionError, match=r"row 3, col 1 at index \(3, 1\)"):  # a matrix keeps row / col
        assert_parity(m + torch.tensor([[0.0, 0.0]] * 3 + [[0.0, 1.0]], dtype=torch.float64), m, rtol=1e-3,
                      activations=False)
    with pytest.raises(ValueError, match=r"^activations=False \(parameters\) takes no cu_seqlens"):
        assert_parity(e, e, rtol=1e-3, cu_seqlens=torch.tensor([0, 1]), activations=False)
    with pytest.raises(ValueError, match=r"^activations must be a bool"):
        assert_parity(e, e, rtol=1e-3, activations="no")


XFAIL_TESTS = """
import pytest
import torch
from pytest_linattn import assert_parity


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a known bug")
def test_known_bug():
    x = torch.ones(4, dtype=torch.float64)
    assert_parity(x + 1, x, rtol=1e-10, name="known")


def test_fine():
    x = torch.ones(4, dtype=torch.float64)
    assert_parity(x, x, rtol=1e-10, name="fine")
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "1"]], ids=["one-process", "xdist"])
def test_checks_of_an_xfailed_test_are_marked_expected(pytester, xdist):
    pytester.makepyfile(test_inner=XFAIL_TESTS)
    report = pytester.path / "report"
    result = runpytest_forked(pytester, "--linattn-report", str(report), "-p", "no:cacheprovider", *xdist)
    result.assert_outcomes(passed=1, xfailed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["linattn parity: 2 check(s), 0 failed, 1 failed in tests marked xfail (expected); *",
                                 "*test_inner.py::test_known_bug*known*xfail",
                                 "*test_inner.py::test_fine*fine*ok"])
    assert "FAIL" not in out.split("linattn parity:", 1)[1]
    records = {r["tensor"]: r for r in json.loads((report / "parity.json").read_text())}
    assert records["known"].get("xfail") is True and not records["known"]["passed"]
    assert "xfail" not in records["fine"]
