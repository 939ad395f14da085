"""Every placement on four GPUs over NCCL, bf16 layers (fla kernels; fla's CP context under CP)
against the float64 replicated layer on the CPU, same weights and inputs: TP = 4 (sequence
parallel on and off), CP = 4 (contiguous and zigzag), TP x CP = 2 x 2 (both layouts, SP on and
off). Output, dx and every parameter gradient (summed over CP, unsharded over TP) <= 2e-2.

One spawn call per family runs every placement on the same world (new_groups per placement);
cases with the same packing share weights, inputs and one float64 reference. Cases are
suites/cases/layer_parity.py's, the checks the public harness's (pytest_linattn.harness).
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import GPU_PARALLEL_FAMILIES as FAMILIES  # noqa: E402
from cases.layer_parity import gpu_config, make_case  # noqa: E402
from pytest_linattn.harness import assert_parity_cases  # noqa: E402
from pytest_linattn.seqlens import packed_seqlens  # noqa: E402

pytestmark = pytest.mark.gpus(4)

WORLD = 4
DTYPE = torch.bfloat16
T = 512  # T / 4 = 128 tokens per rank; zigzag lengths divisible by 2 * 4
# (tp, cp, layout, sp)
PLACEMENTS = [
    (4, 1, "contiguous", False),
    (4, 1, "contiguous", True),
    (1, 4, "contiguous", False),
    (1, 4, "zigzag", False),
    (2, 2, "contiguous", False),
    (2, 2, "contiguous", True),
    (2, 2, "zigzag", False),
    (2, 2, "zigzag", True),
]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parallel_bf16_layer_matches_float64(spawn, family):
    config = gpu_config(family, **FAMILIES[family])
    seed = 6000 + list(FAMILIES).index(family)
    # packed for cp 4 (a sequence over >= 3 ranks, a boundary on a shard edge): valid for cp 2 too
    packings = {layout: packed_seqlens(T, cp_size=4, layout=layout, seed=seed) for layout in ("contiguous", "zigzag")}
    cases = [make_case(config, packings[layout], seed=seed, tp=tp, cp=cp, layout=layout, sp=sp, dtype=DTYPE,
                       name=layout, fla_init=True, round_to=DTYPE, rtol=RTOL,
                       reference_dtype=torch.float64)
             for tp, cp, layout, sp in PLACEMENTS]
    assert_parity_cases(spawn, cases, world_size=WORLD, bitwise_replicated=False)
