"""TP = 2 over NCCL, bf16 layers on two GPUs (sequence parallel on and off) against the float64
replicated layer on the CPU, same weights and inputs: output, dx and every parameter gradient
(unsharded) <= 2e-2 relative. One spawn call per family runs both SP settings. Cases, the rank
function and the checks are suites/layer_parity.py's.
"""

import pytest
import torch

if not torch.cuda.is_available():  # checked first: importing fla on a CPU costs seconds
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("fla", reason="fla is not installed: the GPU kernels need it")

from layer_parity import GPU_PARALLEL_FAMILIES as FAMILIES  # noqa: E402
from layer_parity import check_parallel_cases, gpu_config, make_case, run_parallel_cases  # noqa: E402

pytestmark = pytest.mark.gpus(2)

TP = 2
RTOL = 2e-2
DTYPE = torch.bfloat16
CU_SEQLENS = [0, 1, 130, 300, 516]  # 516 tokens: divisible by TP for sequence parallel


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_bf16_layer_matches_float64(spawn, family):
    config = gpu_config(family, **FAMILIES[family])
    seed = 4000 + list(FAMILIES).index(family)
    cases = [make_case(config, CU_SEQLENS, seed=seed, input_seed=seed + 1, tp=TP, sp=sp, dtype=DTYPE,
                       fla_init=True, round_to=DTYPE)
             for sp in (False, True)]
    per_rank = spawn(run_parallel_cases, TP, cases)
    check_parallel_cases(cases, per_rank, rtol=RTOL, reference_dtype=torch.float64, replicated_equal=False)
