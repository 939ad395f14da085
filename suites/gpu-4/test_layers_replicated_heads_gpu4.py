"""TP beyond the key heads on GPUs: TP = 4 over 1 and 2 key heads (each key head replicated over 4
or 2 consecutive ranks, which split its 8 value heads), bf16 layers on fla's kernels against the
float64 replicated layer on the CPU, same weights and inputs. Output, dx and every parameter
gradient (the replicas' key-head gradients summed over the replicas inside the layer) <= 2e-2.
The CPU suite's float64 twin: suites/cpu/library/test_layers_tp_replicated_heads.py.
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import GPU_HEADS, GPU_PARALLEL_FAMILIES as FAMILIES  # noqa: E402
from cases.layer_parity import make_case  # noqa: E402
from linattn.layers import LinearAttentionConfig  # noqa: E402
from pytest_linattn.harness import assert_parity_cases  # noqa: E402
from pytest_linattn.seqlens import packed_seqlens  # noqa: E402

pytestmark = pytest.mark.gpus(4)

WORLD = 4
DTYPE = torch.bfloat16
T = 256


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp4_beyond_the_key_heads_bf16_matches_float64(spawn, family):
    _, _, K, V = GPU_HEADS
    seed = 7000 + list(FAMILIES).index(family)
    cu = packed_seqlens(T, seed=seed)
    cases = []
    for key_heads in (1, 2):
        config = LinearAttentionConfig(family, hidden_size=256, num_k_heads=key_heads, num_v_heads=8, head_k_dim=K,
                                       head_v_dim=V, conv_size=4, **FAMILIES[family])
        cases.append(make_case(config, cu, seed=seed + 10 * key_heads, tp=WORLD, name=f"k{key_heads}",
                               dtype=DTYPE, fla_init=True, round_to=DTYPE, rtol=RTOL, reference_dtype=torch.float64))
    assert_parity_cases(spawn, cases, world_size=WORLD, bitwise_replicated=False)
