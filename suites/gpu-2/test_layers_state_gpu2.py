"""The state path on GPUs: bf16 layers on fla's kernels, their packed sequences cut into chunks
(a 1-token first chunk, W-1, W, fla's chunk size 64 and its neighbours, random cuts) and then
decoded token by token, each call from the state the previous one left, at TP = 2 (heads and
their state sharded as engines shard them) and CP = 2 (a continued prefill across the ranks: the
state passed rank to rank, what fla's own CP refuses), against one full forward of the float64
replicated layer on the CPU from the same random initial states: every token's output, the final
conv and recurrent states, the input gradients and the initial states' gradients <= 2e-2
relative (`pytest_linattn.assert_continuation_parity`). The CPU suite checks the same cuts in
float64 at 1e-10, and that planted state bugs fail them.
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import GPU_PARALLEL_FAMILIES as FAMILIES  # noqa: E402
from cases.layer_parity import gpu_config, linattn_state_path, random_state_dict  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.harness import Placement, assert_continuation_parity  # noqa: E402

pytestmark = pytest.mark.gpus(2)

DTYPE = torch.bfloat16
SEQLENS = (72, 70, 40, 9)  # plan_cuts' recipes: 1+3+65+1, 4+63+1, 38, 3+r+r; then 2 decode steps each
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
FLA_CHUNK = 64


@pytest.mark.parametrize("placement", [Placement(tp=2), Placement(cp=2)], ids=["tp2", "cp2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_continuation_matches_float64_full_forward(spawn, family, placement):
    config = gpu_config(family, **FAMILIES[family])
    seed = 6000 + list(FAMILIES).index(family)
    replicated = build_layer(config, dtype=torch.float64)
    replicated.load_state_dict(random_state_dict(config, seed, fla_init=True, round_to=DTYPE))
    assert_continuation_parity(spawn, linattn_state_path(config), replicated, [placement], CU,
                               hidden_size=config.hidden_size, seed=seed, rtol=RTOL, conv_width=config.conv_size,
                               chunk_size=FLA_CHUNK, dtype=DTYPE, name=family)
