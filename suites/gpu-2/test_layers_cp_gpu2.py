"""CP = 2 over NCCL: bf16 layers on two GPUs (fla's chunk kernels and causal conv with an fla CP
context, linattn.parallel.cp.fla) against the float64 replicated layer on the CPU, same weights
and inputs, in the contiguous and the zigzag layout: output, dx and every parameter gradient
(summed over the CP ranks) <= 2e-2 relative. One spawn call per family runs every case; cases are
suites/cases/layer_parity.py's, the checks the public harness's (pytest_linattn.harness).

Packings from the plugin's packed_seqlens (seeded): contiguous with a sequence crossing the CP
edge, and with a boundary exactly on it; zigzag with every length divisible by 2 * cp.
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import GPU_PARALLEL_FAMILIES as FAMILIES  # noqa: E402
from cases.layer_parity import gpu_config, make_case  # noqa: E402
from pytest_linattn.harness import assert_parity_cases  # noqa: E402
from pytest_linattn.seqlens import packed_seqlens  # noqa: E402

pytestmark = pytest.mark.gpus(2)

DTYPE = torch.bfloat16
T = 512


@pytest.mark.cp_sizes(2)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cp2_bf16_layer_matches_float64(spawn, cp_size, family):
    config = gpu_config(family, **FAMILIES[family])
    seed = 5000 + list(FAMILIES).index(family)
    packings = [
        ("contiguous", "cross", packed_seqlens(T, cp_size=cp_size, layout="contiguous", seed=seed)),
        ("contiguous", "edge", packed_seqlens(T, cp_size=cp_size, layout="contiguous", seed=seed, edge_boundary=True)),
        ("zigzag", "zz", packed_seqlens(T, cp_size=cp_size, layout="zigzag", seed=seed)),
    ]
    cases = [make_case(config, cu, seed=seed, cp=cp_size, layout=layout, dtype=DTYPE, name=name,
                       fla_init=True, round_to=DTYPE, rtol=RTOL, reference_dtype=torch.float64)
             for layout, name, cu in packings]
    assert_parity_cases(spawn, cases, world_size=cp_size, bitwise_replicated=False)
