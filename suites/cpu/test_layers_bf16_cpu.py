"""Each family's layer in bf16 on the CPU against the float64 replicated layer: output, dx and every
parameter gradient (the gate's A_log, dt_bias and projections included) <= 2e-2 relative.

The CPU proxy of suites/gpu-1/test_layers_bf16.py (the same cases, seeds, sizes and packing:
layer_parity.BF16_CASES): the torch kernels compute bf16 inputs in float32, so what is left is the
bf16 rounding of the layer's own math, the part the GPU run shares with this one. It catches
elementwise math (decay gate, beta, gated RMSNorm) falling back to bf16: KDA's bounded gate
reached 2-4e-2 that way.
"""

import pytest
import torch

from layer_parity import BF16_CASES, check_bf16_layer


@pytest.fixture(autouse=True)
def one_thread():
    """Ops this small run faster on one thread (5x on a busy 2-core CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_cpu_layer_matches_float64(case):
    check_bf16_layer(case, "cpu")
