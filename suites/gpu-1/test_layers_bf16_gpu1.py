"""Each family's layer in bf16 on one GPU (fla kernels through linattn.kernels) against the
float64 replicated layer on the CPU, same weights and inputs: output, dx and every parameter
gradient <= 2e-2 relative (Frobenius). Cases and checks: cases.layer_parity.BF16_CASES and
check_bf16_layer (weights and inputs drawn in float64 and rounded to bf16 once; packed sequences,
one of a single token, one crossing fla's 64-token chunks).
"""

import pytest

from cases.gpu import require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import BF16_CASES, check_bf16_layer  # noqa: E402

pytestmark = pytest.mark.gpus(1)


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_layer_matches_float64(case):
    check_bf16_layer(case, "cuda")
