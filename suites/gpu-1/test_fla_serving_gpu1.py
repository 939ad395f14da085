"""The serving client on fla's KDA ops (suites/clients/fla_serving.py: chunk_kda for prefill,
fused_recurrent_kda_fwd with `ssm_state_indices` in place on a state pool for decode) on fla's
real kernels in bf16 on one GPU, through `assert_state_pool_parity` against linattn's replicated
float64 layer (weights rounded to bf16 first), at BF16_RTOL: every token's output, every
sequence's final state, and every live slot a call did not schedule bitwise unchanged. Decode
calls are padded with rows at slot -1, slot 0 and a free slot, given zero tokens.
"""

import functools

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from clients.fla_serving import fla_pool_path  # noqa: E402
from cases.layer_parity import gpu_config, random_state_dict  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

CONFIG = gpu_config("kda", gate_lower_bound=-5.0)
SEQLENS = (70, 6, 40, 9)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
# a chunk crossing fla's 64-token chunk, 1-token first chunks, decode runs; 2 live at once
PLANS = [SequencePlan((1, 65), 4), SequencePlan((3,), 3), SequencePlan((30, 7), 3), SequencePlan((1, 5), 3)]


@functools.lru_cache(maxsize=1)
def reference(seed=51):
    layer = build_layer(CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(CONFIG, seed, round_to=torch.bfloat16))
    return layer


def test_fla_pool_client_bf16_matches_float64(spawn):
    assert_state_pool_parity(spawn, fla_pool_path(CONFIG), reference(), [Placement()], CU, plans=PLANS,
                             hidden_size=CONFIG.hidden_size, seed=52, rtol=RTOL, max_live=2, capture_sizes=(4,),
                             dtype=torch.bfloat16, name="fla-kda-bf16")
