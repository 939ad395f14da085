"""Planted bugs of a prefill/decode disaggregation client: handoffs (the StateHandoffPath's
`handoff(states, source, target, target_tp_rank)`, with the config first, as
`clients.state_handoff.handoff_by_section`) that move linattn's layer state between TP sizes the
way a public report's transfer did. Module-level: spawn's ranks get them by reference.

Each reproduces the report's mechanism in the project's client, not in the engine's transfer
code (fidelity: moved). The prefill and the decode are right, and the replicated layer never
hands off, so only the state handoff check sees them: the handed-off state of the target rank,
before any decode step, names the rank, the sequence, the field and the section and head.

The conv state's channels are `[q | k | v]` sections, each by head (`linattn.layers.state`); a TP
rank holds its heads' rows of every section, so resharding must go section by section.
"""

from __future__ import annotations

import torch

from clients.state_handoff import replicated_state
from linattn.layers import LayerState, shard_layer_state

__all__ = ["handoff_merging_conv_in_one_shot", "handoff_splitting_conv_flat", "handoff_with_heads_per_rank_floored",
           "wrong_region"]


def handoff_splitting_conv_flat(config, states, source, target, target_tp_rank):
    """vllm-project/vllm #55208 (tracking issue #37638): the conv state transferred with a flat
    split of its channel dimension, each target rank taking an even contiguous slice of the
    concatenated [q | k | v] channels instead of its heads' rows of each section (the recurrent
    state is right). The slice crosses section boundaries wherever the sections' sizes differ
    from the even split. It is also sgl-project/sglang #23746's part (b): the GDN conv state
    `[K, K, V]` sliced contiguously across group boundaries. Beyond the key heads (a target rank's
    conv has replicated key channels) the slice has another size than the rank's conv state."""
    full = replicated_state(config, states, source)
    right = shard_layer_state(full, config, target_tp_rank, target.tp)
    conv = full.conv.chunk(target.tp, dim=1)[target_tp_rank]
    return LayerState(conv.contiguous(), right.recurrent)


def handoff_merging_conv_in_one_shot(config, states, source, target, target_tp_rank):
    """sgl-project/sglang #22060: the source ranks' conv shards merged in one shot, concatenated as
    they come ([q0 | k0 | v0 | q1 | k1 | v1 ...]), instead of per segment; from TP a > 1 to TP 1 the
    second rank's q channels land where the first rank's k should be. The recurrent state, split by
    value heads alone, concatenates right."""
    merged = LayerState(torch.cat([s.conv for s in states], dim=1), torch.cat([s.recurrent for s in states], dim=1))
    return shard_layer_state(merged, config, target_tp_rank, target.tp)


def handoff_with_heads_per_rank_floored(config, states, source, target, target_tp_rank):
    """sgl-project/sglang #23746, part (a): TP 1 prefill to TP 4 decode of a model with 2 key heads:
    `heads_per_rank = num_k_heads // target_tp = 0`, so every target rank's first key head is
    `target_tp_rank * 0 = 0`: it takes key head 0's state (its q and k conv channels, and the
    recurrent state of key head 0's value heads) whatever key head it holds. Right up to TP = the
    key heads. Part (b) of the report is `handoff_splitting_conv_flat`."""
    full = replicated_state(config, states, source)
    T, r = target.tp, target_tp_rank
    local, replicas = config.local(T), config.key_head_replicas(T)
    heads_per_rank = config.num_k_heads // T  # floored: 0 beyond the key heads
    key0 = r * heads_per_rank
    dk, kd, vd = config.head_k_dim, config.key_dim, config.value_dim
    q, k, v = full.conv.split([kd, kd, vd], dim=1)
    keys = slice(key0 * dk, (key0 + local.num_k_heads) * dk)
    conv = torch.cat([q[:, keys], k[:, keys], v.chunk(T, dim=1)[r]], dim=1)
    value0 = key0 * config.v_heads_per_k_head + r % replicas * local.num_v_heads  # within key head key0's
    recurrent = full.recurrent[:, value0:value0 + local.num_v_heads]
    return LayerState(conv.contiguous(), recurrent.contiguous())


# ---- where a plant's handed-off state must be reported wrong (the tests and the registry derive it) ----


def _channel_words(config, channel: int) -> str:
    """The section and head of the replicated layer's conv channel (linattn.layers.state: [q | k | v])."""
    kd, dk, dv = config.key_dim, config.head_k_dim, config.head_v_dim
    if channel < 2 * kd:
        return f"section {'qk'[channel // kd]} key head {channel % kd // dk}"
    return f"section v value head {(channel - 2 * kd) // dv}"


def wrong_region(config, handoff, source, target, tp_rank, field) -> str | None:
    """Where `handoff`'s state for target rank `tp_rank` first differs from the right one, as the
    check's report words it (conv: the first wrong channel's section and head; recurrent: the wrong
    value heads of the first one's key head), found by handing off states whose conv channels and
    recurrent value heads hold their own global index; None where it is right."""
    from clients.state_handoff import handoff_by_section

    N, W = 1, config.conv_size - 1
    conv = torch.arange(config.conv_dim, dtype=torch.float64).view(1, -1, 1).expand(N, -1, W)
    recurrent = torch.arange(config.num_v_heads, dtype=torch.float64).view(1, -1, 1, 1).expand(
        N, -1, config.head_k_dim, config.head_v_dim)
    full = LayerState(conv.contiguous(), recurrent.contiguous())
    states = [shard_layer_state(full, config, r, source.tp) for r in range(source.tp)]
    right = handoff_by_section(config, states, source, target, tp_rank)
    planted = handoff(config, states, source, target, tp_rank)
    if field == "conv":
        wrong = torch.nonzero(planted.conv[0, :, 0] != right.conv[0, :, 0]).flatten().tolist()
        return _channel_words(config, int(right.conv[0, wrong[0], 0])) if wrong else None
    wrong = torch.nonzero(planted.recurrent[0, :, 0, 0] != right.recurrent[0, :, 0, 0]).flatten().tolist()
    if not wrong:
        return None
    heads = [int(right.recurrent[0, i, 0, 0]) for i in wrong]  # the value heads the rank should hold there
    key = heads[0] // config.v_heads_per_k_head  # the first wrong one's key head, and its other wrong value heads
    same = [str(h) for h in heads if h // config.v_heads_per_k_head == key]
    return f"value head{'s' * (len(same) > 1)} {', '.join(same)} (key head {key})"
