"""Head-sharded linear-attention layers: Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi delta
attention, with HF parameter names, tensor, sequence and context parallelism.

    config = LinearAttentionConfig("qwen3_next", hidden_size=..., num_k_heads=..., num_v_heads=...,
                                   head_k_dim=..., head_v_dim=...)
    tp_group, cp_group = new_groups(tp_size, cp_size)          # linattn.parallel
    layer = build_layer(config, tp_group=tp_group, cp_group=cp_group, cp_layout="zigzag",
                        sequence_parallel=True)
    layer.load_state_dict(shard_state_dict(full_state_dict, config, tp_rank, tp_size))
    y = layer(hidden_states, cu_seqlens)   # this rank's tokens; cu_seqlens global
    y, state = layer(hidden_states, cu_seqlens, state, output_final_state=True)   # a continued prefill
    y, state = layer.step(next_tokens, state)                                      # one decode step

Under CP, parameter gradients are per-rank partial sums (see linattn.parallel.cp).

Other implementations' weights (transformers modules, fla's layers, megatron-core's GDN, with its
TP shards) convert to and from these with the adapters (adapters.py); a transformers config
gives the layer's config with LinearAttentionConfig.from_hf_config.
"""

from linattn.kernels import gated_rms_norm

from .adapters import (
    config_from_fla_layer,
    from_fla_state_dict,
    from_hf_state_dict,
    from_megatron_state_dicts,
    qwen3_5_to_qwen3_next,
    qwen3_next_to_qwen3_5,
    to_fla_state_dict,
    to_hf_state_dict,
    to_megatron_state_dict,
)
from .base import HeadShardedLinearAttention
from .build import build_layer
from .config import FAMILIES, LinearAttentionConfig
from .gated_deltanet import GatedDeltaNet
from .kimi_delta_attention import KimiDeltaAttention
from .state import LayerState, shard_layer_state, unshard_layer_state
from .state_dict import ParameterLayout, parameter_layouts, reorder_value_heads, shard_state_dict, unshard_state_dict

__all__ = [
    "FAMILIES",
    "GatedDeltaNet",
    "HeadShardedLinearAttention",
    "KimiDeltaAttention",
    "LayerState",
    "LinearAttentionConfig",
    "ParameterLayout",
    "build_layer",
    "config_from_fla_layer",
    "from_fla_state_dict",
    "from_hf_state_dict",
    "from_megatron_state_dicts",
    "gated_rms_norm",
    "parameter_layouts",
    "qwen3_5_to_qwen3_next",
    "qwen3_next_to_qwen3_5",
    "reorder_value_heads",
    "shard_layer_state",
    "shard_state_dict",
    "to_fla_state_dict",
    "to_hf_state_dict",
    "to_megatron_state_dict",
    "unshard_layer_state",
    "unshard_state_dict",
]
