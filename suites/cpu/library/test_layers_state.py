"""The state path of the project's layers: chunked prefill and decode against one full forward.

Every family's layer, its packed sequences cut into chunks (a 1-token first chunk, W-1, W, the
reference kernel's chunk size 64 and its neighbours, a 1-token chunk mid-sequence, random cuts)
and then decoded token by token, each call from the state the previous one left, at TP 2/4
(heads and their state sharded as engines shard them) and CP 2/4 (a continued prefill across the
ranks), in float64 (<= 1e-10): every token's output, the final conv and recurrent states, the
input gradients and the initial states' gradients against one full forward of the replicated
layer from the same random initial states (`pytest_linattn.assert_continuation_parity`).

Planted bugs (wrappers around the layer, defined here) must fail the same check, each with a
report naming the sequence, its cuts and the token where it goes wrong.
"""

import functools

import pytest
import torch

from layer_parity import FAMILIES, linattn_state_path, make_config, random_state_dict
from linattn.layers import LayerState, build_layer
from linattn.reference.delta_rule import CHUNK_SIZE
from pytest_linattn.harness import Placement, assert_continuation_parity
from pytest_linattn.parity import capture_records

# plan_cuts' recipes by sequence: 1+3+65+1 (then 2 decode steps), 4+63+1, 38, 3+r+r
SEQLENS = (72, 70, 40, 9)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
RTOL = 1e-10


@functools.lru_cache(maxsize=8)
def replicated(config, seed):
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(config, seed))
    return layer


def check(spawn, config, placement, seed, path=None):
    assert_continuation_parity(spawn, path or linattn_state_path(config), replicated(config, seed), [placement], CU,
                               hidden_size=config.hidden_size, seed=seed, rtol=RTOL, conv_width=config.conv_size,
                               chunk_size=CHUNK_SIZE, name=config.family)


@pytest.mark.tp_sizes(2, 4)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_continuation_matches_full_forward(spawn, tp_size, family):
    check(spawn, make_config(family, 2), Placement(tp=tp_size), seed=10 + FAMILIES.index(family))


@pytest.mark.cp_sizes(2, 4)
@pytest.mark.parametrize("family", FAMILIES)
def test_cp_continued_prefill_matches_full_forward(spawn, cp_size, family):
    check(spawn, make_config(family, 1), Placement(cp=cp_size), seed=20 + FAMILIES.index(family))
