"""Each family's layer in bf16 on the CPU against the float64 replicated layer: output, dx and every
parameter gradient (the gate's A_log, dt_bias and projections included) <= 2e-2 relative.

The CPU proxy of suites/gpu-1/test_layers_bf16.py (same cases, seeds, sizes and packing): the
torch kernels compute bf16 inputs in float32, so what is left is the bf16 rounding of the layer's
own math, the part the GPU run shares with this one. It catches elementwise math (decay gate,
beta, gated RMSNorm) falling back to bf16: KDA's bounded gate reached 2-4e-2 that way.
"""

import pytest
import torch

from layer_parity import gpu_config, random_state_dict, run_layer
from linattn.layers import build_layer
from pytest_linattn.parity import assert_parity

RTOL = 2e-2
DTYPE = torch.bfloat16
CU_SEQLENS = [0, 1, 130, 300, 515]
CASES = {  # as suites/gpu-1/test_layers_bf16.py
    "qwen3_next-gva2": ("qwen3_next", 2, {}),
    "qwen3_5-gva3": ("qwen3_5", 3, {}),
    "kda-gva2-lower_bound": ("kda", 2, {"gate_lower_bound": -5.0}),
    "kda-gva1-low_rank_gate": ("kda", 1, {"output_gate_rank": 128}),
}



@pytest.fixture(autouse=True)
def one_thread():
    """Ops this small run faster on one thread (5x on a busy 2-core CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_cpu_layer_matches_float64(case):
    family, ratio, extra = CASES[case]
    config = gpu_config(family, ratio, **extra)
    seed = 2026 + list(CASES).index(case)
    sd = random_state_dict(config, seed, fla_init=True, round_to=DTYPE)
    gen = torch.Generator().manual_seed(seed + 1)
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    T = CU_SEQLENS[-1]
    x = torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64).to(DTYPE).double()
    dy = torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64).to(DTYPE).double()

    reference = build_layer(config, dtype=torch.float64)
    reference.load_state_dict(sd)
    y_ref, dx_ref, grads_ref = run_layer(reference, x, dy, cu)

    layer = build_layer(config, dtype=DTYPE)
    layer.load_state_dict({n: t.to(DTYPE) for n, t in sd.items()})
    y, dx, grads = run_layer(layer, x.to(DTYPE), dy.to(DTYPE), cu)
    assert all(g.dtype == DTYPE for g in grads.values())  # float32 math inside, bf16 parameters' gradients

    assert_parity(y, y_ref, rtol=RTOL, name=f"{case} output", cu_seqlens=cu)
    assert_parity(dx, dx_ref, rtol=RTOL, name=f"{case} dx", cu_seqlens=cu)
    assert_parity(grads, grads_ref, rtol=RTOL, name=f"{case} grad")
