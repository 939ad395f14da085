"""A slot-pool client of linattn's layer for `pytest_linattn.harness.assert_state_pool_parity`,
shared by the state-pool tests and the bug record: prefill and decode read and write the
scheduled slots of a pool in place, as a serving engine's layer call does.

The prefill takes the prefix mode's keywords too (`snapshot_slots`, `prefix_slots`): a prefix
hit reads its prefix block and writes its own slot.

`linattn_pool_path(config, prefill=..., decode=...)`: the harness's StatePoolPath for a config;
a planted bug replaces prefill or decode (module-level functions: spawn pickles them by reference).
"""

from __future__ import annotations

import functools

import torch

from cases.layer_parity import linattn_layer
from linattn.layers import LayerState, shard_layer_state, unshard_layer_state
from pytest_linattn.harness import StatePoolPath

__all__ = ["linattn_pool_path", "pool_decode", "pool_prefill"]


def _rows(mask, rows):
    return mask.view(-1, *[1] * (rows.dim() - 1))


def pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots=None, prefix_slots=None):
    """Each sequence from its slot (zero when fresh; a prefix hit from its prefix slot), its final
    state written back to the slot, and to its snapshot slot where it has one."""
    read = slots if prefix_slots is None else torch.where(prefix_slots >= 0, prefix_slots, slots)
    state = LayerState(*(torch.where(_rows(fresh, f[read]), torch.zeros_like(f[read]), f[read]) for f in pool))
    y, new = module(x, cu_seqlens, state, output_final_state=True)
    for f, n in zip(pool, new):
        f[slots] = n
    if snapshot_slots is not None:
        taken = snapshot_slots >= 0
        for f, n in zip(pool, new):
            f[snapshot_slots[taken]] = n[taken]
    return y


def pool_decode(module, x, pool, slots, num_valid, placement):
    """The valid rows only (a captured graph runs every row; its padding writes must go nowhere)."""
    valid = slots[:num_valid]
    y, new = module.step(x[:, :num_valid], LayerState(*(f[valid] for f in pool)))
    for f, n in zip(pool, new):
        f[valid] = n
    return torch.cat([y, torch.zeros_like(x[:, num_valid:])], dim=1)


def _shard(config, state, placement, tp_rank):
    return shard_layer_state(state, config, tp_rank, placement.tp)


def _unshard(config, states, placement):
    return unshard_layer_state(states, config)


def linattn_pool_path(config, prefill=pool_prefill, decode=pool_decode) -> StatePoolPath:
    """linattn's layer for `config` through the slot-pool client, its state sharded over TP as
    its weights are."""
    return StatePoolPath(linattn_layer(config), prefill=prefill, decode=decode,
                         shard_state=functools.partial(_shard, config),
                         unshard_state=functools.partial(_unshard, config))
