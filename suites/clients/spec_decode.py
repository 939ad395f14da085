"""The slot-pool client (`clients.state_pool`) extended with speculative decoding, for
`pytest_linattn.harness.assert_spec_decode_parity`: a verify call over K draft tokens of each
sequence keeps every token's state, and accepting j drafts writes the state after the j-th into
the slot (vLLM's and fla's `num_accepted_tokens` interface: per-token states, no replay).

`linattn_spec_path(config, verify=..., accept=...)`: the harness's SpecDecodePath for a config;
`linattn_block_spec_path(config)`: the same keeping blocks at block boundaries (block_accept);
a planted bug replaces prefill, verify or accept (module-level functions: spawn pickles them by
reference).

vLLM's layout (`linattn_row_spec_path`, and `clients.fla_spec_decode` on fla's kernel): a row of
1 + K slots per sequence, a verify call of the sequence's next token and K drafts writing its
state after token t to the row's column t, accept keeping only num_accepted_tokens (the next call
starts from column num_accepted_tokens - 1: nothing is copied back).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cases.layer_parity import linattn_layer
from linattn.layers import LayerState
from pytest_linattn.harness import SpecDecodePath
from clients.state_pool import _shard, _unshard, pool_prefill

__all__ = ["block_accept", "current_slots", "linattn_block_spec_path", "linattn_row_spec_path", "linattn_spec_path",
           "num_accepted", "pool_accept", "pool_verify", "row_accept", "row_prefill", "row_prefill_slots", "row_state", "row_verify", "verify_states"]


def verify_states(module, x, cu_seqlens, state):
    """Each of N sequences' tokens (packed by cu_seqlens; a mixed call's rows differ in length) from
    `state`, one token of every sequence per step: the outputs `[1, T, hidden]` and the states after
    0..K tokens, per field `[K + 1, N, ...]` (K the longest row's; a shorter row keeps its last state)."""
    lengths = cu_seqlens.diff().tolist()
    starts = cu_seqlens[:-1].tolist()
    y = torch.empty_like(x)
    states = [state]
    for k in range(max(lengths)):
        rows = [n for n, length in enumerate(lengths) if k < length]
        tokens = torch.tensor([starts[n] + k for n in rows])
        y_k, stepped = module.step(x[:, tokens], type(state)(*(f[rows] for f in state)))
        y[:, tokens] = y_k
        state = type(state)(*(f.index_copy(0, torch.tensor(rows, device=f.device), s) for f, s in zip(state, stepped)))
        states.append(state)
    return y, [torch.stack(fields) for fields in zip(*states)]


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


def block_accept(module, pool, slots, num_accepted_tokens, placement, snapshot_slots, snapshot_offsets):
    """pool_accept with blocks (`assert_spec_decode_parity(block_size=...)`, vLLM's align mode): where
    the round's committed tokens reach a block boundary, the state there goes to the boundary's
    block (the block the running state leaves behind), then each slot takes its committed state."""
    rows = torch.arange(slots.numel(), device=slots.device)
    taken = snapshot_slots >= 0
    for f, kept in zip(pool, module.verify_states):
        f[snapshot_slots[taken]] = kept[snapshot_offsets[taken], rows[taken]]
    pool_accept(module, pool, slots, num_accepted_tokens, placement)


def linattn_block_spec_path(config, accept=block_accept) -> SpecDecodePath:
    """The slot-pool client with verify and accept that keeps the state at block boundaries in blocks
    (its prefill writes a chunk-end boundary's, pool_prefill's snapshot_slots)."""
    return linattn_spec_path(config, accept=accept)


def linattn_spec_path(config, prefill=pool_prefill, verify=pool_verify, accept=pool_accept) -> SpecDecodePath:
    """linattn's layer for `config` through the slot-pool client with verify and accept, its state
    sharded over TP as its weights are."""
    return SpecDecodePath(linattn_layer(config), prefill=prefill, verify=verify, accept=accept,
                          shard_state=functools.partial(_shard, config),
                          unshard_state=functools.partial(_unshard, config))


# ---- vLLM's layout: a row of slots per sequence, the state after every token in a slot ----

def num_accepted(module, pool, slots):
    """Each row's num_accepted_tokens of its last verify call (kept on the module by the row's
    first slot, as an engine keeps it per request for the next step); 1 for a row never verified."""
    if getattr(module, "accepted", None) is None:
        module.accepted = torch.ones(pool[0].shape[0], dtype=torch.long, device=slots.device)
    return module.accepted[slots[:, 0]]


def current_slots(slots, accepted):
    """Each row's slot at column accepted - 1: where its sequence's state is."""
    return slots.gather(1, (accepted - 1).unsqueeze(1)).squeeze(1)


def row_prefill_slots(module, pool, slots, fresh):
    """The slot each row's prefill reads and writes: its current one; a fresh sequence's row
    starts over at column 0."""
    accepted = torch.where(fresh, 1, num_accepted(module, pool, slots))
    module.accepted[slots[:, 0]] = accepted
    return current_slots(slots, accepted)


def row_prefill(module, x, cu_seqlens, pool, slots, fresh, placement):
    """The slot-pool prefill on each row's current slot."""
    return pool_prefill(module, x, cu_seqlens, pool, row_prefill_slots(module, pool, slots, fresh), fresh, placement)


def row_verify(module, x, cu_seqlens, pool, slots, placement):
    """Every token from the row's current slot; the state after token t written to column t."""
    start = current_slots(slots, num_accepted(module, pool, slots))
    y, states = verify_states(module, x, cu_seqlens, LayerState(*(f[start] for f in pool)))
    for f, kept in zip(pool, states):
        f[slots[:, :kept.shape[0] - 1]] = kept[1:].transpose(0, 1)
    return y


def row_accept(module, pool, slots, num_accepted_tokens, placement):
    """Nothing moves: the next call starts from column num_accepted_tokens - 1."""
    num_accepted(module, pool, slots)
    module.accepted[slots[:, 0]] = num_accepted_tokens


def row_state(module, pool, slots, placement):
    """Each sequence's state: its row's slot at column num_accepted_tokens - 1."""
    current = current_slots(slots, num_accepted(module, pool, slots))
    return LayerState(*(f[current] for f in pool))


def linattn_row_spec_path(config, num_draft, prefill=row_prefill, verify=row_verify,
                          accept=row_accept) -> SpecDecodePath:
    """linattn's layer in vLLM's layout: a bonus token and num_draft drafts per verify call, a row
    of 1 + num_draft slots per sequence."""
    return dataclasses.replace(linattn_spec_path(config, prefill, verify, accept), bonus_token=True,
                               slots_per_sequence=1 + num_draft, read_state=row_state)
