"""Each family's layer in bf16 on one GPU (fla kernels through linattn.kernels) against the
float64 replicated layer on the CPU, same weights and inputs: output, dx and every parameter
gradient <= 2e-2 relative (Frobenius).

Weights and inputs are drawn in float64 and rounded to bf16 once; the float64 layer runs on the
rounded values, so what is left is the bf16 computation's error. Packed sequences, one of a
single token, one crossing fla's 64-token chunks.
"""

import pytest
import torch

if not torch.cuda.is_available():  # checked first: importing fla on a CPU costs seconds
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("fla", reason="fla is not installed: the GPU kernels need it")

from layer_parity import gpu_config, random_state_dict, run_layer  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.parity import assert_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

RTOL = 2e-2
DTYPE = torch.bfloat16
CU_SEQLENS = [0, 1, 130, 300, 515]
CASES = {
    # name: (family, v heads per k head, kda options)
    "qwen3_next-gva2": ("qwen3_next", 2, {}),
    "qwen3_5-gva3": ("qwen3_5", 3, {}),
    "kda-gva2-lower_bound": ("kda", 2, {"gate_lower_bound": -5.0}),
    "kda-gva1-low_rank_gate": ("kda", 1, {"output_gate_rank": 128}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_layer_matches_float64(case):
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

    layer = build_layer(config, dtype=DTYPE, device="cuda")
    layer.load_state_dict({n: t.to(DTYPE) for n, t in sd.items()})
    y, dx, grads = run_layer(layer, x.to("cuda", DTYPE), dy.to("cuda", DTYPE), cu.cuda())

    assert_parity(y, y_ref, rtol=RTOL, name=f"{case} output", cu_seqlens=cu)
    assert_parity(dx, dx_ref, rtol=RTOL, name=f"{case} dx", cu_seqlens=cu)
    assert_parity(grads, grads_ref, rtol=RTOL, name=f"{case} grad")
