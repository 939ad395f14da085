"""A drafter for the speculative-decoding check (`SpecDecodePath.drafter`): linattn's layer of a
draft config as a draft context with a recurrent state of its own, a slot per sequence, as a
llama.cpp engine keeps a draft model's context beside the target's.

The draft context's prefill is the slot-pool client's (`clients.state_pool.pool_prefill`). Its
propose runs a round's tokens from the slot and leaves the slot advanced past them (the context's
decode of the drafts), keeping a checkpoint of the state after every position of the round (the
context's recurrent-state cells). Its rollback removes the rejected positions, as
`llama_memory_seq_rm(seq, p0 = accepted, p1 = -1)` does: the checkpoint at the accepted prefix
restored (`draft_seq_rm`). A recurrent context can go back only as far as it keeps checkpoints
(`n_rs_seq` positions); a removal past them fails and returns False, and this client's rollback
raises on it rather than keep stale positions.

`linattn_drafter(config)`: the SpecDrafter; `with_drafter(path, config)`: a SpecDecodePath with it;
a planted bug replaces propose or rollback (module-level functions: spawn pickles them by reference).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cases.layer_parity import linattn_layer
from clients.spec_decode import verify_states
from clients.state_pool import _shard, _unshard, pool_prefill
from linattn.layers import LayerState
from pytest_linattn.harness import SpecDrafter

__all__ = ["draft_propose", "draft_rollback", "draft_seq_rm", "linattn_drafter", "with_drafter"]


def draft_propose(module, x, cu_seqlens, pool, slots, placement):
    """Every token of the round from the slot's state; the slot left holding the state after the
    row's last token (the draft context decoded them), the states after 0..T tokens kept as the
    context's checkpoints, with each row's length."""
    y, states = verify_states(module, x, cu_seqlens, LayerState(*(f[slots] for f in pool)))
    for f, kept in zip(pool, states):
        f[slots] = kept[-1]  # verify_states: a shorter row keeps its last state to the end
    module.draft_checkpoints = (states, cu_seqlens.diff().to(slots.device))
    return y


def draft_seq_rm(module, pool, slots, keep, n_rs_seq=None):
    """llama_memory_seq_rm(seq, p0 = keep, p1 = -1) on each row's slot: the round's positions from
    `keep` on removed, the checkpoint after `keep` tokens restored. The context goes back at most
    `n_rs_seq` positions (None: every position of the round, as this client keeps them); removing
    nothing always succeeds. Returns `[N]` bool, False where the removal failed (the slot as it was)."""
    states, lengths = module.draft_checkpoints
    back = lengths - keep
    done = back <= (int(lengths.max()) if n_rs_seq is None else n_rs_seq)
    rows = torch.arange(slots.numel(), device=slots.device)
    for f, kept in zip(pool, states):
        f[slots[done]] = kept[keep[done], rows[done]]
    return done


def draft_rollback(module, pool, slots, num_accepted_tokens, placement):
    """Each slot back to the state after its accepted tokens; a failed removal raises."""
    done = draft_seq_rm(module, pool, slots, num_accepted_tokens)
    if not bool(done.all()):
        raise RuntimeError(f"the draft context could not remove the rejected positions of rows "
                           f"{torch.nonzero(~done).flatten().tolist()}: its slots would keep stale positions")
    module.draft_checkpoints = None


def linattn_drafter(config, propose=draft_propose, rollback=draft_rollback) -> SpecDrafter:
    """linattn's layer for `config` as a drafter (the same hidden size as the target's), its state
    sharded over TP as its weights are."""
    return SpecDrafter(linattn_layer(config), prefill=pool_prefill, propose=propose, rollback=rollback,
                       shard_state=functools.partial(_shard, config), unshard_state=functools.partial(_unshard, config))


def with_drafter(path, config, **fields):
    """`path` (a SpecDecodePath) with linattn's drafter of `config` (`fields`: propose, rollback)."""
    return dataclasses.replace(path, drafter=linattn_drafter(config, **fields))
