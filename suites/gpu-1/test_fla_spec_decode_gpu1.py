"""Speculative decoding through fla's KDA serving kernel (suites/clients/fla_spec_decode.py: verify
calls on `fused_recurrent_kda_fwd` with `ssm_state_indices` `[N, 1 + K]`, a slot per token, and
`num_accepted_tokens` picking the column the next call starts from; prefill on `chunk_kda`) on
fla's real kernels in bf16 on one GPU, through `assert_spec_decode_parity` against linattn's
replicated float64 layer (weights rounded to bf16 first), at BF16_RTOL: every token's output (a
rejected draft's too), every sequence's state after every call (where the client's row says it
is), and every slot a call did not schedule bitwise unchanged.

Every verify call runs the sequence's next token and K = 3 drafts, accepting 0..3 drafts, a
different count per sequence in one call; prefill chunks cross fla's 64-token chunk.
"""

import functools

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from clients.fla_spec_decode import fla_spec_path  # noqa: E402
from cases.layer_parity import gpu_config, random_state_dict  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.harness import Placement, SpecPlan, assert_spec_decode_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

CONFIG = gpu_config("kda", gate_lower_bound=-5.0)
K = 3
# a chunk crossing fla's 64-token chunk, 1-token first chunks; round 1 accepts 3, 0, 2 and 1
# drafts, round 2 0, 1, 3 and 2, round 3 2, 3, 1 and 0
PLANS = [SpecPlan((1, 65), (3, 0, 2)), SpecPlan((3,), (0, 1, 3)), SpecPlan((30, 7), (2, 3, 1)),
         SpecPlan((1, 5), (1, 2, 0))]


@functools.lru_cache(maxsize=1)
def reference(seed=51):
    layer = build_layer(CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(CONFIG, seed, round_to=torch.bfloat16))
    return layer


def test_fla_spec_client_bf16_matches_float64(spawn):
    assert_spec_decode_parity(spawn, fla_spec_path(CONFIG, K), reference(), [Placement()], PLANS, num_draft=K,
                              hidden_size=CONFIG.hidden_size, seed=52, rtol=RTOL, dtype=torch.bfloat16,
                              name="fla-kda-spec-bf16")
