"""Collective mutants (`--linattn-mutate-collectives`) on test_megatron_gdn.py's `test_tp2_sp`:
the same TP 2 + SP case checked as Megatron's own GDN parity test checks it (the output and the
input gradient) and as the harness does (every gradient too), read from `collective-mutants.json`.

The first lets mutants survive: among them, finalize_model_grads' all-reduce of the SP-tagged
gradients (out_norm's) skipped, the bug Megatron-LM #7452 reports with SP off; and the weight
gradients' all-gather of the input in the linears' backward. The harness's check kills every one.
One mutant per call site (`--linattn-mutants-per-test 6`: the case has 6 sites) keeps it to 12 reruns.
"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FINALIZE = ("megatron/core/distributed/finalize_model_grads.py", "_allreduce_non_tensor_model_parallel_grads")


def test_megatron_style_check_lets_the_out_norm_reduction_mutant_survive_and_the_harness_kills_all(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "test_megatron_gdn.py"), "-k", "test_tp2_sp", "-p", "no:xdist",
         "-p", "no:cacheprovider", "--linattn-device", "cpu", "--linattn-mutate-collectives",
         "--linattn-mutants-per-test", "6", "--linattn-report", str(tmp_path)],
        cwd=HERE.parent, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text  # both tests pass; a mutant survived: the session fails
    assert "2 passed" in text, text
    rows = json.loads((tmp_path / "collective-mutants.json").read_text())
    megatron_style = [r for r in rows if r["test"].endswith("[output-and-input-grad]")]
    harness = [r for r in rows if r["test"].endswith("[every-grad]")]
    assert len(megatron_style) == len(harness) == 6, text
    survived = {(r["site"].rsplit(":", 1)[0], r["function"], r["mutation"]) for r in megatron_style
                if r["outcome"] == "survived"}
    assert (*FINALIZE, "all_reduce.skip") in survived, text
    assert any(f.endswith(".backward") and m.startswith("all_gather") for _, f, m in survived), text
    assert [r for r in harness if r["outcome"] != "killed"] == [], text
