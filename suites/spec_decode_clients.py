"""The slot-pool client (`state_pool_clients`) extended with speculative decoding, for
`pytest_linattn.harness.assert_spec_decode_parity`: a verify call over K draft tokens of each
sequence keeps every token's state, and accepting j drafts writes the state after the j-th into
the slot (vLLM's and fla's `num_accepted_tokens` interface: per-token states, no replay).

`linattn_spec_path(config, verify=..., accept=...)`: the harness's SpecDecodePath for a config;
a planted bug replaces prefill, verify or accept (module-level functions: spawn pickles them by
reference).
"""

from __future__ import annotations

import functools

import torch

from layer_parity import linattn_layer
from linattn.layers import LayerState
from pytest_linattn.harness import SpecDecodePath
from state_pool_clients import _shard, _unshard, pool_prefill

__all__ = ["linattn_spec_path", "pool_accept", "pool_verify", "verify_states"]


def verify_states(module, x, cu_seqlens, state):
    """K tokens of each of N sequences (packed, K each) from `state`, one token of every sequence
    per step: the outputs `[1, N*K, hidden]` and the states after 0..K tokens, per field `[K + 1, N, ...]`."""
    N = cu_seqlens.numel() - 1
    K = x.shape[1] // N
    tokens = x.view(N, K, -1)
    ys, states = [], [state]
    for k in range(K):
        y, state = module.step(tokens[:, k].unsqueeze(0), state)
        ys.append(y[0])
        states.append(state)
    return torch.stack(ys, dim=1).reshape(1, N * K, -1), [torch.stack(fields) for fields in zip(*states)]


def pool_verify(module, x, cu_seqlens, pool, slots, placement):
    """Every draft from the slot's state; the per-token states kept on the module for accept."""
    y, module.verify_states = verify_states(module, x, cu_seqlens, LayerState(*(f[slots] for f in pool)))
    return y


def pool_accept(module, pool, slots, num_accepted_tokens, placement):
    """Each slot takes the state after its sequence's accepted drafts."""
    rows = torch.arange(slots.numel(), device=slots.device)
    for f, kept in zip(pool, module.verify_states):
        f[slots] = kept[num_accepted_tokens, rows]
    module.verify_states = None


def linattn_spec_path(config, prefill=pool_prefill, verify=pool_verify, accept=pool_accept) -> SpecDecodePath:
    """linattn's layer for `config` through the slot-pool client with verify and accept, its state
    sharded over TP as its weights are."""
    return SpecDecodePath(linattn_layer(config), prefill=prefill, verify=verify, accept=accept,
                          shard_state=functools.partial(_shard, config),
                          unshard_state=functools.partial(_unshard, config))
