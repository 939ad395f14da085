"""The benchmark scripts on a CPU: the interleaved timer's rules, and each script end to end on the
tiny shapes (rows, checks and JSON; no timing is asserted)."""

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import _timing

    return _timing


def test_rounds_rotate_the_order(bench):
    seen = []
    calls = {name: (lambda name=name: seen.append(name), None, None) for name in "abc"}
    bench.measure_interleaved(calls, iters=2, warmup=1, device="cpu")
    assert seen == list("abc" "bca" "cab")


def test_refused_backward_keeps_the_forward_and_failures_stay_rows(bench):
    def refuse(out):
        raise RuntimeError("backward refused here")

    def broken():
        raise ValueError("no forward")

    calls = {"good": (lambda: 1, lambda out: None, None), "fwd-only": (lambda: 1, refuse, None),
             "broken": (broken, None, None)}
    out = bench.measure_interleaved(calls, iters=3, warmup=1, device="cpu")
    assert out["good"]["ms"] is not None and out["good"]["bwd_error"] is None
    assert out["fwd-only"]["ms"] is None and out["fwd-only"]["fwd_ms"] is not None
    assert "backward refused here" in out["fwd-only"]["bwd_error"]
    assert isinstance(out["broken"], ValueError)
    with pytest.raises(ValueError, match="no forward"):
        bench.measure(broken, iters=1, warmup=0, device="cpu")


def test_a_backward_failing_later_is_an_error_not_a_row(bench):
    count = []

    def flaky(out):
        count.append(1)
        if len(count) > 1:
            raise RuntimeError("second backward fails")

    with pytest.raises(RuntimeError, match="second backward"):
        bench.measure(lambda: 1, flaky, iters=2, warmup=0, device="cpu")


def _run(script, args, tmp_path):
    module = importlib.import_module(script)  # the bench fixture put suites/bench on sys.path
    out = tmp_path / f"{script}.json"
    module.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "256", "--iters", "2", "--warmup", "1",
                 "--json", str(out), *args])
    payload = json.loads(out.read_text())
    assert payload["complete"] is True
    return payload


def test_kernel_table_times_every_backend_and_judges_auto(bench, tmp_path):
    payload = _run("bench_kernels", [], tmp_path)
    rows = payload["rows"]
    assert {(r["shape"], r["op"], r["backend"]) for r in rows} >= {
        ("tiny-kda", "short_conv", "auto"), ("tiny-kda", "kda", "auto"), ("tiny-gdn", "gated_delta_rule", "auto")}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows)
    assert len(payload["auto_check"]) == 4 and all(v["ok"] is not None for v in payload["auto_check"])


def test_layer_table_checks_tp_and_cp_against_the_replicated_layer(bench, tmp_path):
    payload = _run("bench_layers", ["--tp", "1,2", "--cp", "1,2", "--world", "2"], tmp_path)
    rows = {(r["shape"], r["tp"], r["cp"]): r for r in payload["rows"]}
    for shape in ("tiny-kda", "tiny-gdn"):
        assert rows[(shape, 2, 2)]["status"] == "skipped: needs 4 ranks"
        assert rows[(shape, 1, 1)]["status"] == "ok" and rows[(shape, 1, 1)]["err_y"] is None
        for placement in ((2, 1), (1, 2)):
            row = rows[(shape, *placement)]
            assert row["status"] == "ok" and row["check"] == "ok", row
            # float32 on both sides: sharding changes only the order of the sums
            assert row["err_y"] < 1e-4 and row["err_dx"] < 1e-4, row


def test_breakdown_sums_its_parts(bench, tmp_path):
    payload = _run("bench_breakdown", [], tmp_path)
    for row in payload["rows"]:
        assert row["status"] == "ok", row
        parts = sum(row[p] for p in payload["parts"])
        assert row["glue"] == pytest.approx(row["ms"] - parts)
        assert all(row[p] >= 0 for p in payload["parts"])


@pytest.mark.parametrize("extra", [[], ["--forward-only"]], ids=["fwd+bwd", "fwd only"])
def test_fla_comparison_times_two_layers_computing_the_same_function(bench, tmp_path, extra):
    # on a CPU fla's layers run under the emulation: the weight maps make them the project's layer
    payload = _run("bench_vs_fla", extra, tmp_path)
    rows = {r["shape"]: r for r in payload["rows"]}
    assert set(rows) == {"tiny-kda", "tiny-gdn"}
    for row in rows.values():
        assert row["step"] == ("fwd only" if extra else "fwd+bwd")
        assert row["ms"] > 0 and row["fla_ms"] > 0 and row["time_ratio"] == pytest.approx(row["ms"] / row["fla_ms"])
        assert row["out_err"] < 1e-5, row  # float32 on both sides
        # no memory figures without CUDA's allocator statistics, rather than made-up ones
        assert row["gib"] is None and row["mib_over"] is None and row["tensor_mib_over"] is None, row


def test_suite_bench_times_each_emulated_op_against_its_reference(bench, tmp_path):
    # bench_suite's cheapest part: the single-process op rows (no pool, no fla), one round each
    module = importlib.import_module("bench_suite")
    out = tmp_path / "bench_suite.json"
    payload = module.main(["--parts", "ops", "--shapes", "test", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(payload["rows"]))
    ops = {r["op"] for r in payload["rows"]}
    assert {"chunk_gated_delta_rule", "chunk_kda", "causal_conv1d", "l2norm"} <= ops
    for row in payload["rows"]:
        assert row["emulated_ms"] > 0 and row["reference_ms"] > 0, row
        assert row["ratio"] == pytest.approx(row["emulated_ms"] / row["reference_ms"])
    assert [s["target"] for s in payload["summary"]] == ["<= 2x"]


def test_long_decode_writes_the_errors_the_figure_and_the_table(bench, tmp_path, capsys):
    module = importlib.import_module("bench_long_decode")
    out = tmp_path / "long-decode"
    module.main(["--device", "cpu", "--families", "qwen3_5", "--steps", "8", "--prefill", "3", "--sequences", "1",
                 "--plant", "bf16-state", "--out", str(out)])
    payload = json.loads((out / "long_decode.json").read_text())
    assert payload["complete"] is True and payload["failures"] == []
    assert payload["bound"] == {"rtol": 1e-5, "growth": 0.5, "warmup": 16}  # float32 on a CPU
    series = {(s["variant"], s["field"]): s for s in payload["series"]}
    assert set(series) == {(v, f) for v in ("layer", "bf16-state plant")
                           for f in ("output", "state conv", "state recurrent")}
    assert all(len(s["errors"]) == 8 for s in series.values())
    # the layer keeps its state in float32; the plant's bf16 state is three orders worse
    assert series[("layer", "state recurrent")]["state_dtype"] == "float32"
    assert series[("bf16-state plant", "state recurrent")]["state_dtype"] == "bfloat16"
    assert max(series[("layer", "state recurrent")]["errors"]) < 1e-5
    assert min(series[("bf16-state plant", "state recurrent")]["errors"]) > 1e-4
    assert (out / "long_decode.png").stat().st_size > 0
    table = capsys.readouterr().out.rsplit("\n\n", 1)[-1].splitlines()  # printed last, after a blank line
    assert table[1].split() == ["family", "variant", "field", "state", "dtype", "t=1", "growth"]  # t=16 on: past --steps
    rows = [line.split()[:2] for line in table[2:]]
    assert rows == [["qwen3_5", "layer"]] * 3 + [["qwen3_5", "bf16-state"]] * 3
