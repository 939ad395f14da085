"""transformers' linear-attention layers with transformers' cache, as a serving loop calls them:
chunked prefill and decode steps for `pytest_linattn.assert_continuation_parity`, unsharded.

The layer is one linear-attention module of the tiny configs (`checkpoints.config`: Qwen3-Next's
and Qwen3.5's Gated DeltaNet, Kimi Linear's KDA), layer 0, its weights `checkpoints.perturb`ed.
Its state is what `DynamicCache(config=...)` keeps for the layer (`LinearAttentionLayer`): the
conv state `[N, D, W]` (W wide; the newest input last) and the recurrent state `[N, HV, K, V]`,
one row per sequence. A prefill call runs each sequence of the packed chunk as a batch of one
(transformers' modules take `[B, T, hidden]`), from a cache holding that sequence's rows; a decode
step runs the N sequences as one batch `[N, 1, hidden]` from a cache holding all N rows: the
single-token branch (`causal_conv1d_update`, the recurrent kernel). The cache updates in place
and is an inference path: checked without gradients.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

import transformers_tp  # noqa: F401  - applies the fla mode before transformers' modeling modules are imported

from .checkpoints import config, perturb

__all__ = ["HFLinearState", "cached_forward", "linear_attention_layer", "state_path"]


class HFLinearState(NamedTuple):
    conv: torch.Tensor
    recurrent: torch.Tensor


def _module_class(model: str):
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    return {"qwen3_next": Qwen3NextGatedDeltaNet, "qwen3_5": Qwen3_5GatedDeltaNet,
            "kimi_linear": KimiLinearDeltaAttention}[model]


def linear_attention_layer(model: str, seed: int, dtype=torch.float64, device="cpu"):
    """Layer 0 of `model`'s tiny config, weights perturbed with `seed`."""
    module = _module_class(model)(config(model), layer_idx=0).to(device, dtype)
    module.model_config = config(model)  # what DynamicCache(config=...) reads; the modules keep no config
    perturb(module, seed)
    return module.eval()


def _cache(module, state):
    """A DynamicCache of the module's config holding `state` for layer 0 (None: an empty one)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=module.model_config)
    if state is not None:
        layer = cache.layers[0]
        layer.lazy_initialization(conv_states=state.conv, recurrent_states=state.recurrent)
        layer.conv_states[0].copy_(state.conv)
        layer.recurrent_states[0].copy_(state.recurrent)
        layer.has_previous_state[0] = True
    return cache


def _kept(cache) -> HFLinearState:
    layer = cache.layers[0]
    return HFLinearState(layer.conv_states[0].clone(), layer.recurrent_states[0].clone())


def cached_forward(module, x, cu_seqlens, state):
    """Every sequence of the packed `x` `[1, T, hidden]` from its rows of `state`, one at a time
    (the reference's full forward, and a prefill call): `(y, HFLinearState)`."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    ys, kept = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows = None if state is None else HFLinearState(*(s[n:n + 1] for s in state))
        cache = _cache(module, rows)
        ys.append(module(x[:, start:end], cache_params=cache))
        kept.append(_kept(cache))
    return torch.cat(ys, dim=1), HFLinearState(*(torch.cat(f) for f in zip(*kept)))


def prefill(module, x, cu_seqlens, state, placement):
    return cached_forward(module, x, cu_seqlens, state)


def decode(module, x, state, placement):
    cache = _cache(module, state)
    y = module(x.transpose(0, 1), cache_params=cache)
    return y.transpose(0, 1), _kept(cache)


def _build(model, seed, placement, groups, dtype, device):
    return linear_attention_layer(model, seed, dtype, device)


def _first(grads, placement):
    return grads[0]


def state_path(model: str, seed: int):
    """The StatePath of `model`'s layer 0 (its weights from `seed`, the same as the reference's)."""
    from pytest_linattn import ShardedLayer, StatePath

    layer = ShardedLayer(functools.partial(_build, model, seed), None, _first)  # shard None: built with the weights
    return StatePath(layer, prefill=prefill, decode=decode, differentiable=False)


# ---- under transformers' own TP plan ----------------------------------------------------------


def checkpoint_layer(checkpoint: str, tp_size: int = 1, dtype=torch.float64):
    """Layer 0's linear-attention module of the CausalLM at `checkpoint`, loaded whole or sharded by
    transformers' own plan (`client.load`), in eval mode."""
    from .client import load

    model = load(checkpoint, tp_size=tp_size, dtype=dtype)
    layer = model.model.layers[0]
    module = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
    module.model_config = model.config
    return module.eval()


def _build_from_checkpoint(checkpoint, placement, groups, dtype, device):
    from .client import build

    build(placement, groups, dtype, device, checkpoint=checkpoint)  # the placement and device rules only
    return checkpoint_layer(checkpoint, placement.tp, dtype)


def _whole_state(state, placement, tp_rank):
    return state


def _tp_rank_0_state(states, placement):
    return states[0]


def tp_plan_state_path(checkpoint: str):
    """The StatePath of layer 0 under transformers' TP plan. The plan gathers the GDN projections'
    outputs (`colwise_gather_output`) and leaves the conv, the recurrence and Kimi's KDA whole, so
    every TP rank holds the whole state: shard_state gives it whole, unshard_state takes TP rank
    0's (every rank's outputs are checked)."""
    from pytest_linattn import ShardedLayer, StatePath

    from .client import process_groups

    layer = ShardedLayer(functools.partial(_build_from_checkpoint, checkpoint), None, _first,
                         process_groups=process_groups)
    return StatePath(layer, prefill=prefill, decode=decode, shard_state=_whole_state, unshard_state=_tp_rank_0_state,
                     differentiable=False)
