"""transformers' Qwen3-Next, Qwen3.5 and Kimi Linear linear-attention layers with transformers'
cache (DynamicCache), float64: chunked prefill and decode steps, as a serving loop calls them,
against one full forward of the same layer from the same random cache
(`pytest_linattn.assert_continuation_parity`; `transformers_tp.state_path`). Unsharded, and layer 0
of a checkpoint loaded at TP 2 by transformers' own plan (every rank then holds the whole state).

The cuts per sequence: a 1-token first chunk then 3 and 65 tokens; 4, 63 and 1; 38; 3 and random;
then 2 decode steps each. transformers' torch path chunks by 64, the conv width is 4.

Tolerance: these modules compute in float32 in places whatever the dtype (the decay gate's
`A_log.float()`, the gated norm; with fla absent the torch kernels cast to float32 throughout;
Kimi Linear stores its recurrent state in float32), so RTOL is the float32 bound; a lost or stale
state is an O(1) error. Measured figures: docs/harness.md, "The state path".
"""

import pytest
import torch

from pytest_linattn import Placement, assert_continuation_parity
from transformers_tp.checkpoints import MODELS, config, write_checkpoint
from transformers_tp.state_path import (cached_forward, checkpoint_layer, linear_attention_layer, state_path,
                                        tp_plan_state_path)

RTOL = 1e-5
SEQLENS = (72, 70, 40, 9)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
SEED = 7


@pytest.mark.parametrize("model", MODELS)
def test_cached_prefill_and_decode_match_one_forward(spawn, model):
    hidden = config(model).hidden_size
    assert_continuation_parity(spawn, state_path(model, SEED), linear_attention_layer(model, SEED), [Placement()], CU,
                               hidden_size=hidden, seed=SEED, rtol=RTOL, conv_width=4, chunk_size=64,
                               reference_forward=cached_forward, name=model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("state-path-checkpoints")
    return lambda model: write_checkpoint(model, root / model)


@pytest.mark.parametrize("model", MODELS)
def test_tp_plan_cached_prefill_and_decode_match_one_forward(spawn, checkpoint, model):
    """Layer 0 of the checkpoint at TP 2 under transformers' own plan against the whole layer."""
    path = checkpoint(model)
    assert_continuation_parity(spawn, tp_plan_state_path(path), checkpoint_layer(path), [Placement(tp=2)], CU,
                               hidden_size=config(model).hidden_size, seed=SEED, rtol=RTOL, conv_width=4,
                               chunk_size=64, reference_forward=cached_forward, name=model)
