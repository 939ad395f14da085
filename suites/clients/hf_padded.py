"""transformers' linear-attention layers as padded-batch clients of
`pytest_linattn.harness.assert_padded_continuation_parity`: Qwen3-Next's `Qwen3NextGatedDeltaNet`,
Qwen3.5's `Qwen3_5GatedDeltaNet` and Kimi Linear's `KimiLinearDeltaAttention` (KDA), one rank
(TP 1), with transformers' own cache.

Each call runs the layer as the model runs it: `layer(x, cache_params=cache,
attention_mask=create_recurrent_attention_mask(config, x, mask))` (transformers' mask for the
linear-attention layers: the call's 2D padding mask, None for a one-token step or an all-token
call), the cache a `DynamicCache(config=...)` created on the first call and carried from call to
call. The state handed to the check is the cache's layer 0: its conv state's last W-1 columns
(transformers keeps W; the oldest one never reaches an output) and its recurrent state.

`hf_padded_path(family)`: the check's PaddedStatePath; `hf_reference(family, seed)`: linattn's
float64 replicated layer of the same config (`LinearAttentionConfig.from_hf_config`), whose
weights the ranks load through `to_hf_state_dict`.
"""

from __future__ import annotations

import functools

import torch

from cases.layer_parity import replicated_layer
from linattn.layers import LayerState, LinearAttentionConfig
from linattn.layers.adapters import to_hf_state_dict
from pytest_linattn.harness import PaddedStatePath
from pytest_linattn.harness.cases import ShardedLayer

__all__ = ["HF_PADDED_FAMILIES", "HFState", "hf_config", "hf_padded_forward", "hf_padded_path", "hf_reference"]

HF_PADDED_FAMILIES = ("qwen3_next", "qwen3_5", "kimi_linear")

# the CPU suites' tiny GDN layer (cases.layer_parity.make_config's sizes): 4 key heads, 8 value heads
GDN_SIZES = dict(hidden_size=20, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                 linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                 layer_types=["linear_attention"], rms_norm_eps=1e-5)
# Kimi Linear's KDA layer of the same scale: 4 heads of 8 (its key and value heads are one), a
# low-rank output gate of rank 8 (transformers' g_a_proj / g_b_proj)
KDA_SIZES = dict(hidden_size=20, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                 layer_types=["linear_attention"], mlp_layer_types=["dense"], rms_norm_eps=1e-5)


def hf_config(family: str):
    """transformers' (text) config of a one-layer model of `family`, its layer 0 linear attention."""
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**GDN_SIZES, num_experts=0)
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**GDN_SIZES)
    if family == "kimi_linear":
        from transformers import KimiLinearConfig

        return KimiLinearConfig(**KDA_SIZES)
    raise ValueError(f"family must be one of {HF_PADDED_FAMILIES}, got {family!r}")


def _layer_class(family):
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        return Qwen3NextGatedDeltaNet
    if family == "kimi_linear":
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

        return KimiLinearDeltaAttention
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    return Qwen3_5GatedDeltaNet


def hf_reference(family: str, seed: int):
    """linattn's float64 replicated layer of `family`'s config, seeded weights."""
    return replicated_layer(LinearAttentionConfig.from_hf_config(hf_config(family)), seed)


class HFState(LayerState):
    """A row per sequence: the conv state's last W-1 columns and the recurrent state; `cache`
    (the DynamicCache they were read from) goes on to the next call (not compared, not pickled
    into the results: the rank rebuilds the fields alone)."""

    cache = None


def _build(family, placement, groups, dtype, device):
    if placement.tp != 1:
        raise ValueError(f"transformers' layers run unsharded: tp must be 1, got {placement.tp}")
    config = hf_config(family)
    module = _layer_class(family)(config, layer_idx=0).to(device=device, dtype=dtype).eval()
    module.hf_config = config
    return module


def _shard(family, state_dict, placement, tp_rank):
    return to_hf_state_dict(state_dict, hf_config(family))


def hf_padded_forward(module, x, attention_mask, state, placement):
    """One call of transformers' layer on a padded batch from the cache of the previous call."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_recurrent_attention_mask

    cache = DynamicCache(config=module.hf_config) if state is None else state.cache
    mask = create_recurrent_attention_mask(module.hf_config, x, attention_mask.to(torch.long))
    y = module(x, cache_params=cache, attention_mask=mask)
    layer = cache.layers[module.layer_idx]
    new = HFState(layer.conv_states[0][..., 1:].clone(), layer.recurrent_states[0].clone())
    new.cache = cache
    return y, new


def hf_padded_path(family: str, forward=hf_padded_forward) -> PaddedStatePath:
    """transformers' layer of `family` through the padded-batch client, TP 1."""
    if family not in HF_PADDED_FAMILIES:
        raise ValueError(f"family must be one of {HF_PADDED_FAMILIES}, got {family!r}")
    layer = ShardedLayer(build=functools.partial(_build, family), shard=functools.partial(_shard, family))
    return PaddedStatePath(layer, forward=forward)
