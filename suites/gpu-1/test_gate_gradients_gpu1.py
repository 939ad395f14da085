"""The in-kernel gate's gradients under strong decay on fla's compiled kernels, one GPU: the gate
input's, A_log's and dt_bias's gradients of fla 0.6.0's chunk_gated_delta_rule with
use_gate_in_kernel=True, in bf16 and float32, against the float64 reference with the same gate
(cases.gate_gradients: why strong decay, what is compared; its CPU check is
suites/cpu/library/test_gate_gradients.py).

The route is the one the project's layers take (linattn.selection.gdn_route): fla's
chunk_gated_delta_rule with the gate in the kernel, or, where fla refuses that backward (Hopper with
Triton in [3.4.0, 3.7.1) and no TileLang), chunk_kda on the gate computed before the kernel. fla
never hands an in-kernel gate to its FlashQLA backend (its verifier refuses use_gate_in_kernel),
so this is fla's own multi-kernel Triton backward: the one the fused backward's fix fell back to.

Bounds (docs/gpus.md, "Bounds by precision"): bf16 2e-2; float32 TF32_RTOL = 5e-3, the bound of
float32 chunk kernels (their tl.dot takes float32 operands in tf32). Under Triton's interpreter
(float32 dots, CPU) fla's dA_log at these decays was 3e-5 to 4e-4 off at the CPU sizes, so tf32
may come close to the bound: a failure here is for the first GPU run to read, with its table.

The same function then runs the bug record's plant (bug_record.plants_gate: the gate gradient
cancelled through a bf16 transpose, torch code) on CUDA tensors at these sizes: caught, A_log's
and dt_bias's rows named at a fast-decaying head, as on the CPU.
"""

import pytest
import torch

from cases.gpu import BF16_RTOL, require_cuda_and_fla

require_cuda_and_fla()

from bug_record.plants_gate import gated_delta_rule_with_a_bf16_transposed_gate_gradient as planted  # noqa: E402
from bug_record.plants_gate import located  # noqa: E402
from cases.gate_gradients import Sizes, assert_gate_gradients  # noqa: E402
from cases.layer_parity import GPU_HEADS  # noqa: E402
from linattn import kernels, selection  # noqa: E402
from pytest_linattn.parity import capture_records  # noqa: E402

pytestmark = pytest.mark.gpus(1)

TF32_RTOL = 2 * BF16_RTOL / 8
H, HV, K, V = GPU_HEADS  # the GPU suites' heads: fla's kernels compiled for them are shared
SIZES = Sizes(cu_seqlens=(0, 47, 128, 300), key_heads=H, value_heads=HV, head_k_dim=K, head_v_dim=V)


def fla_gated_delta_rule(*args, **kwargs):
    return kernels.gated_delta_rule(*args, route=selection.gdn_route(), **kwargs)


def test_gate_gradients_at_strong_decay():
    route = selection.gdn_route()
    failures = []
    for dtype, rtol in ((torch.bfloat16, BF16_RTOL), (torch.float32, TF32_RTOL)):
        try:
            assert_gate_gradients(fla_gated_delta_rule, dtype=dtype, decay="strong", sizes=SIZES, device="cuda",
                                  rtol=rtol, label=f"fla {route} gate gradients at strong decay "
                                                   f"({str(dtype).removeprefix('torch.')})")
        except AssertionError as failed:
            failures.append(str(failed))
    # the check sees the mechanism on this device: the plant caught, located
    with capture_records(), pytest.raises(AssertionError, match=located(SIZES)):
        assert_gate_gradients(planted, dtype=torch.bfloat16, decay="strong", sizes=SIZES, device="cuda")
    assert not failures, "\n\n".join(failures)
