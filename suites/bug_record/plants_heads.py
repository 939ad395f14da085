"""Planted bugs of the key-head pairing convention and of process-wide state: a TP split that
assumes the other head pairing, a decode step whose recurrence indexes the key head as i % H, a
head count one layer writes process-wide and another reads. Module-level: spawn's ranks get them
by reference.
"""

from __future__ import annotations

import dataclasses
import functools

from cases.layer_parity import linattn_state_path
from linattn import kernels
from linattn.layers import (GatedDeltaNet, shard_layer_state, shard_state_dict, unshard_layer_state,
                            unshard_state_dict)

OTHER_PAIRING = {"grouped": "tiled", "tiled": "grouped"}


# ---- llama.cpp #21732: the TP split of one model's head pairing applied to another's ----------------


def _as_other(config):
    return dataclasses.replace(config, head_pairing=OTHER_PAIRING[config.head_pairing])


def shard_assuming_the_other_pairing(config, full, placement, tp_rank):
    """llama.cpp #21732 (fixes #21703): the TP split assumed Qwen3-Next broadcasts K across V as
    Qwen3.5's GGUF does (tiled: V segmented on the scale of K), so for Qwen3-Next (grouped) every
    rank got value heads of other key heads: half of the heads paired the wrong K and V."""
    return shard_state_dict(full, _as_other(config), tp_rank, placement.tp)


def unshard_assuming_the_other_pairing(config, grads, placement):
    return unshard_state_dict(grads, _as_other(config))


def shard_state_assuming_the_other_pairing(config, state, placement, tp_rank):
    """The same split of the carried state (llama.cpp splits its r and s caches with the weights)."""
    return shard_layer_state(state, _as_other(config), tp_rank, placement.tp)


def unshard_state_assuming_the_other_pairing(config, states, placement):
    return unshard_layer_state(states, _as_other(config))


def path_split_as_the_other_pairing(config):
    """linattn's StatePath of `config` with its weights and states split as the other head pairing splits."""
    path = linattn_state_path(
        config, shard_state=functools.partial(shard_state_assuming_the_other_pairing, config),
        unshard_state=functools.partial(unshard_state_assuming_the_other_pairing, config))
    layer = dataclasses.replace(path.layer, shard=functools.partial(shard_assuming_the_other_pairing, config),
                                unshard=functools.partial(unshard_assuming_the_other_pairing, config))
    return dataclasses.replace(path, layer=layer)


# ---- sglang #36722: the decode kernels' key-head index i_hv % H ------------------------------------------


class DecodeIndexingKeyHeadsModuloH(GatedDeltaNet):
    """sglang #36722 (closed unmerged): the proposal to change the fused GDN decode kernels' key-head
    index from i_hv // (HV / H) to i_hv % H, for HV = 2H models whose checkpoints pair grouped. The
    decode step's recurrence then pairs each rank's value heads tiled (the kernel sees the rank's
    H and HV), while prefill (the chunk kernels) still pairs them grouped."""

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        if carry is None or carry.mode != "recurrent":  # not a decode step
            return super()._delta_rule(q, k, v, g, beta, cu_seqlens, cp_context, carry, **gate)
        o, carry.recurrent = kernels.gated_delta_rule(
            q, k, v, g, beta, scale=self.config.head_k_dim ** -0.5, cu_seqlens=cu_seqlens, use_qk_l2norm=True,
            initial_state=carry.initial_recurrent, output_final_state=True, mode="recurrent", head_pairing="tiled")
        return o


# ---- DeepSpeed #8316: a head count written process-wide by one component, read by another -----------

# the process-wide key-head count: every layer's build writes it (as AutoTP writes the model's KV-head
# count at every injection), every forward reads it (as Ulysses' uneven-head all-to-all did)
KEY_HEADS_PER_RANK = {"heads": None}


class KeyHeadCountSharedByTheProcess(GatedDeltaNet):
    """DeepSpeed #8316 (issue #8291): Ulysses' uneven-head all-to-all read a process-wide KV-head count
    that AutoTP overwrites at every injection, so one model's heads were split by another's count
    (12 heads on sp = 4 as [4, 4, 4, 0]). Here the layer writes its rank's key-head count to a
    module-level global when built and lays out q and k by the global in its forward: with two
    differently configured layers in one process, the one built first reads the other's count."""

    def __init__(self, config, **options):
        super().__init__(config, **options)
        KEY_HEADS_PER_RANK["heads"] = self.local_config.num_k_heads

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        heads = KEY_HEADS_PER_RANK["heads"]
        q, k = (t.reshape(*t.shape[:2], heads, -1) for t in (q, k))
        return super()._delta_rule(q, k, v, g, beta, cu_seqlens, cp_context, carry, **gate)
