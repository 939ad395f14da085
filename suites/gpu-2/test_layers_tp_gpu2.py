"""TP = 2 over NCCL, bf16 layers on two GPUs (sequence parallel on and off) against the float64
replicated layer on the CPU, same weights and inputs: output, dx and every parameter gradient
(unsharded) <= 2e-2 relative. One spawn call per family runs both SP settings. Cases are
suites/cases/layer_parity.py's; the checks the public harness's (pytest_linattn.harness).
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import GPU_PARALLEL_FAMILIES as FAMILIES  # noqa: E402
from cases.layer_parity import gpu_config, make_case  # noqa: E402
from pytest_linattn.harness import assert_parity_cases  # noqa: E402

pytestmark = pytest.mark.gpus(2)

TP = 2
DTYPE = torch.bfloat16
CU_SEQLENS = [0, 1, 130, 300, 516]  # 516 tokens: divisible by TP for sequence parallel


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_bf16_layer_matches_float64(spawn, family):
    config = gpu_config(family, **FAMILIES[family])
    seed = 4000 + list(FAMILIES).index(family)
    cases = [make_case(config, CU_SEQLENS, seed=seed, input_seed=seed + 1, tp=TP, sp=sp, dtype=DTYPE,
                       fla_init=True, round_to=DTYPE, rtol=RTOL, reference_dtype=torch.float64)
             for sp in (False, True)]
    # replicated-weight gradients equal on both TP ranks to RTOL (bitwise is not asked of NCCL)
    assert_parity_cases(spawn, cases, world_size=TP, bitwise_replicated=False)
