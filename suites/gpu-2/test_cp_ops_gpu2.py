"""CP=2 ops over NCCL in bf16 against the float64 reference on the full batch (<= 2e-2).

Two backends per case: "fla" (fla's chunk kernels and causal conv with an fla CP context) and
"exchange" (our halo all-gather and rank-to-rank state passing around fla's single-GPU kernels).
Both layouts; zigzag goes through the all-to-all relayout.
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.cp_ops import check_cases, make_case, run_cases_on_rank
from cases.layer_parity import GPU_HEADS  # the CP layer tests have already tuned the CP kernels for this head shape
from linattn.parallel import cp
from pytest_linattn.seqlens import packed_seqlens

pytestmark = pytest.mark.gpus(2)

T = 512
W, D = 4, 128


def _cases(cp_size):
    gen = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cases = []
    for layout in cp.LAYOUTS:
        for seed in (0, 1):
            cu = packed_seqlens(T, cp_size=cp_size, layout=layout, seed=seed, edge_boundary=bool(seed))
            cases.append(make_case(f"{layout}/seed{seed}", layout, cu, randn, GPU_HEADS, conv_dim=D, conv_width=W,
                                   l2norm=True, cast=torch.Tensor.bfloat16, g_cast=torch.Tensor.float))
    return cases


@pytest.mark.cp_sizes(2)
def test_cp_ops_bf16_match_reference(spawn, cp_size):
    cases = _cases(cp_size)
    check_cases(cases, spawn(run_cases_on_rank, cp_size, cases, ("fla", "exchange")), cp_size, RTOL)
