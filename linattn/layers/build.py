"""`build_layer`: one entry for every family, with its TP / SP / CP placement."""

from __future__ import annotations

import torch

from linattn.parallel.groups import group_size

from .config import LinearAttentionConfig
from .gated_deltanet import GatedDeltaNet
from .kimi_delta_attention import KimiDeltaAttention

__all__ = ["build_layer"]

LAYER_CLASSES = {"qwen3_next": GatedDeltaNet, "qwen3_5": GatedDeltaNet, "kda": KimiDeltaAttention}


def build_layer(
    config: LinearAttentionConfig,
    *,
    tp_group=None,
    cp_group=None,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    device="cpu",
):
    """The layer of `config.family`, holding this rank's TP shard of the heads.

    tp_group: heads split over it (None: replicated layer). sequence_parallel: with TP > 1, the
    layer takes and returns this rank's contiguous 1/tp of the tokens. cp_group: reserved for
    context parallelism (None or a one-rank group for now). forward(hidden_states `[1, T_local,
    hidden]`, cu_seqlens global int32) -> `[1, T_local, hidden]`.
    """
    if not isinstance(config, LinearAttentionConfig):
        raise ValueError(f"config must be a LinearAttentionConfig, got {type(config).__name__}")
    if group_size(cp_group) > 1:
        raise ValueError(
            f"context parallelism is not yet supported by build_layer: cp_group has {group_size(cp_group)} ranks"
        )
    return LAYER_CLASSES[config.family](
        config, tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype, device=device
    )
