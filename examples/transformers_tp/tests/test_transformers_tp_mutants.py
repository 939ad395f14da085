"""Collective mutants (`--linattn-mutate-collectives`) on qwen3_5's first training step, checked as
Megatron's own parity test checks (`test_output_and_input_grad`: the logits and the input
gradient) and by the training-step check (`test_one_training_step[qwen3_5]`), read from
`collective-mutants.json`.

The first lets the q_norm / k_norm gradient all-reduce (transformers' ReplicatedWithGradAllReduce,
the site of the accumulation bug test_transformers_tp.py finds) be skipped or doubled; the
training-step check kills every mutant but the two of its own gradient norm that no DTensor plan
can show (declared with `equivalent_mutant`). 10 mutants per test (of about 135), spread over the
call sites, keep it to 20 reruns.
"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPLICATED_GRAD_REDUCTION = ("transformers/distributed/tensor_parallel.py", "ReplicatedWithGradAllReduce.install_forward.<locals>._all_reduce_grads")


def test_output_and_input_grad_check_lets_the_q_norm_reduction_mutant_survive_and_the_step_check_kills_all(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "test_transformers_tp.py"), "-k",
         "test_output_and_input_grad or (test_one_training_step and qwen3_5)", "-p", "no:xdist", "-p", "no:cacheprovider",
         "--linattn-device", "cpu", "--linattn-mutate-collectives", "--linattn-mutants-per-test", "10",
         "--linattn-report", str(tmp_path)],
        cwd=HERE.parent, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text  # both tests pass; a mutant survived: the session fails
    assert "2 passed" in text, text
    rows = json.loads((tmp_path / "collective-mutants.json").read_text())
    weak = [r for r in rows if r["test"].endswith("::test_output_and_input_grad")]
    step = [r for r in rows if r["test"].endswith("::test_one_training_step[qwen3_5]")]
    assert len(weak) == len(step) == 10, text
    survived = {(r["site"].rsplit(":", 1)[0], r["function"], r["mutation"], r["phase"]) for r in weak
                if r["outcome"] == "survived"}
    assert (*REPLICATED_GRAD_REDUCTION, "all_reduce.skip", "backward") in survived, text
    assert [r for r in step if r["outcome"] != "killed" and not r["equivalent"]] == [], text
    assert {r["function"] for r in step if r["equivalent"]} <= {"default_grad_norm"}, text
