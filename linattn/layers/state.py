"""A layer's carried state (conv and recurrent), per sequence, and how TP splits it.

    conv       `[N, q H*dk | k H*dk | v HV*dv, W-1]`: each sequence's last W-1 inputs of the
               short convolution, per channel, oldest first; channels in the conv weight's
               block-major order (GDN's conv1d; KDA's q_conv1d, k_conv1d, v_conv1d concatenated)
    recurrent  `[N, HV, dk, dv]`: each sequence's delta-rule state (fla's layout), float64 for a
               float64 layer, float32 otherwise (fla's state dtype)

TP gives rank i the state of its heads, as it gives it their weights (`state_dict`): the i-th
rows of each conv block, the i-th contiguous group of value heads of the recurrent state (a
tiled layer's: the value heads of the rank's key heads, `config.head_pairing`); beyond the key
heads the q and k conv channels of the rank's key head, as its replicas all hold them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import LinearAttentionConfig
from .state_dict import ParameterLayout, shard_rows, unshard_rows

__all__ = ["LayerState", "check_layer_state", "shard_layer_state", "unshard_layer_state"]


class LayerState(NamedTuple):
    """The state a layer carries from one call to the next, one row per sequence."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def _tiled(config: LinearAttentionConfig) -> tuple[int, ...]:
    H, HV = config.num_k_heads, config.num_v_heads
    return (H, HV) if config.head_pairing == "tiled" and HV > H else ()


def _conv_layout(config: LinearAttentionConfig) -> ParameterLayout:
    """The conv state's channels: [q | k | v] blocks, q and k of key heads, v in the value heads'
    head-pairing order (as the conv weight's)."""
    return ParameterLayout((), "row_blocks", (config.key_dim, config.key_dim, config.value_dim), (True, True, False),
                           tiled=_tiled(config))


def _recurrent_layout(config: LinearAttentionConfig) -> ParameterLayout:
    """The recurrent state's value heads (dim 1), in the config's head-pairing order."""
    return ParameterLayout((), "rows", tiled=_tiled(config))


def check_layer_state(state, config: LinearAttentionConfig, num_sequences: int, name: str = "state") -> LayerState:
    """`state` as a LayerState of `config`'s (a TP rank's local config) shapes for `num_sequences`,
    else ValueError naming the field and the shape it must have."""
    if not isinstance(state, tuple) or len(state) != 2:
        raise ValueError(f"{name} must be a LayerState(conv, recurrent), got {type(state).__name__}")
    conv, recurrent = state
    c, N = config, num_sequences
    shapes = {"conv": (N, c.conv_dim, c.conv_size - 1), "recurrent": (N, c.num_v_heads, c.head_k_dim, c.head_v_dim)}
    for field, value in zip(("conv", "recurrent"), (conv, recurrent)):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) == shapes[field]):
            raise ValueError(f"{name}.{field} must be a floating-point tensor of shape {shapes[field]} (one row per "
                             f"sequence), got {getattr(value, 'shape', type(value).__name__)}")
    return LayerState(conv, recurrent)


def shard_layer_state(state, config: LinearAttentionConfig, tp_rank: int, tp_size: int) -> LayerState:
    """The TP rank's part of the replicated layer's state (`config` the replicated layer's)."""
    replicas = config.key_head_replicas(tp_size)
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    conv, recurrent = check_layer_state(state, config, _num_sequences(state))
    conv = shard_rows(conv, _conv_layout(config), tp_rank, tp_size, replicas, dim=1)
    recurrent = shard_rows(recurrent, _recurrent_layout(config), tp_rank, tp_size, replicas, dim=1)
    return LayerState(conv.contiguous(), recurrent.contiguous())


def unshard_layer_state(states, config: LinearAttentionConfig) -> LayerState:
    """Inverse of shard_layer_state: the replicated layer's state from the TP ranks', in rank order."""
    if isinstance(states, LayerState) or not len(states):
        raise ValueError("states must be a non-empty sequence of per-rank LayerStates in TP rank order")
    local, replicas = config.local(len(states)), config.key_head_replicas(len(states))
    states = [check_layer_state(s, local, _num_sequences(s), f"states[{i}]") for i, s in enumerate(states)]
    conv = unshard_rows([s.conv for s in states], _conv_layout(config), _conv_layout(local), replicas, dim=1)
    recurrent = unshard_rows([s.recurrent for s in states], _recurrent_layout(config), _recurrent_layout(local),
                             replicas, dim=1)
    return LayerState(conv, recurrent)


def _num_sequences(state) -> int:
    recurrent = state[1] if isinstance(state, tuple) and len(state) == 2 else None
    return recurrent.shape[0] if isinstance(recurrent, torch.Tensor) and recurrent.dim() else -1
