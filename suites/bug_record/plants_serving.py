"""Planted bugs of the serving options (`pytest_linattn.harness.pool_modes`, the spec-decode
check's blocks and drafter): wrappers around the project's clients (suites/clients/state_pool.py,
suites/clients/spec_decode.py, suites/clients/spec_drafter.py), each carrying one mechanism of a
public report. Module-level: spawn's ranks get them by reference. Each is seen by the state-pool
check's option it names, or by the spec-decode check with `block_size` or with a drafter.
"""

from __future__ import annotations

import torch

from clients.spec_decode import block_accept
from clients.spec_drafter import draft_seq_rm
from clients.state_pool import block_of, pool_prefill, published, restored_slots

# ---- block tables (StatePoolPath.block_tables) ------------------------------------------------------

# the record's blocks (the recurrent group's block size) and a drafter's smaller one, at the record's sizes
MAMBA_BLOCK = 4
DRAFTER_BLOCK = 2


def prefill_restoring_the_group_hit(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots,
                                    block_table, num_computed_tokens, decode_rows=None, *, block_size):
    """vLLM #53912 / #43559 (a block-table client's prefill): the attention groups dropped the final,
    partially accepted block of the hit, the recurrent group did not: its hit is longer, and the
    layer restores the last block its group cached instead of the block where the engine resumes,
    reusing a state that already holds tokens the call then runs again."""
    last = (block_table >= 0).sum(dim=1) - 1  # the group's own hit: its last cached block
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots,
                        restored_slots(block_table, last))


def prefill_seeding_from_the_drafter_block_size(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots,
                                                block_table, num_computed_tokens, decode_rows=None, *, block_size):
    """vLLM #55601 (a block-table client's prefill): the running slot seeded from block
    (num_computed_tokens - 1) // block_size after block_size was reassigned to the smallest prefix-
    cacheable group's (a drafter's, DRAFTER_BLOCK) instead of the Mamba block size: a short hit
    restores a later block, a long one a column past the table (no block: the slot's stale state).
    `block_size`, the Mamba block size the client is built with, goes unused."""
    prefix = restored_slots(block_table, block_of(num_computed_tokens, DRAFTER_BLOCK))
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix)


# ---- mixed calls (StatePoolPath.mixed_calls) --------------------------------------------------------


def prefill_tracking_snapshots_through_the_decode_rows(module, x, cu_seqlens, pool, slots, fresh, placement,
                                                       snapshot_slots, prefix_slots, decode_rows):
    """sglang #23075 (a mixed call's prefill, decode rows after the prefill rows): the tracking
    helpers that write the prefill rows' snapshots read query_start_loc and the cache indices of the
    whole call, the decode rows counted in, so prefill row k's snapshot takes the state of the row
    as many places on as the call has decode rows (a decode row's, where the call has one per
    prefill row). Every row's own slot is right."""
    y = pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, None, prefix_slots)
    shift = int(decode_rows.sum())
    rows = torch.arange(slots.numel(), device=slots.device)
    taken = snapshot_slots >= 0
    source = slots[(rows[taken] + shift) % slots.numel()]
    for f in pool:
        f[snapshot_slots[taken]] = f[source]
    return y


# ---- admissions (StatePoolPath.admit) ---------------------------------------------------------------


def admit_publishing_before_the_load(module, pool, slots, load_slots, loaded, placement):
    """sglang #30986 (a load-back client's admission): the load-back allocates the copy-on-write slot
    and publishes it as the request's state before it knows the load proceeds; when the load is
    rejected nothing unwinds the publication, and the request runs from the slot's contents (the
    previous occupant's state) instead of from zero."""
    go = (load_slots >= 0) & loaded
    for f in pool:
        f[slots[go]] = f[load_slots[go]]
    published(module, pool)[slots] = load_slots >= 0


def admit_reporting_hits_it_never_restored(module, pool, slots, load_slots, loaded, placement):
    """LMCache #2863 (a connector client's admission, the load-back client as an external KV
    connector): the connector stores the attention KV only, yet reports the whole prefix as loaded,
    so the engine resumes past it for every layer type; the recurrent state was never stored, the
    admitted slot never populated, and the hit runs from the slot's contents (the previous occupant's
    state). A rejected load reports nothing."""
    published(module, pool)[slots] = (load_slots >= 0) & loaded


# ---- spec decode with blocks (assert_spec_decode_parity(block_size=...)) ----------------------------


def accept_copying_back_on_a_landed_boundary(module, pool, slots, num_accepted_tokens, placement, snapshot_slots,
                                             snapshot_offsets):
    """vLLM #53505 (an align-mode client's accept): when the accepted tokens land exactly on a block
    boundary, the postprocess computes a destination block before its source and copies the pre-move
    state (the one the round started from) back over the just-migrated one: the running state and the
    boundary's block both hold the state before the round. Every round that stops short of a boundary
    or crosses one inside its tokens is right."""
    before = [f[slots].clone() for f in pool]
    block_accept(module, pool, slots, num_accepted_tokens, placement, snapshot_slots, snapshot_offsets)
    landed = (snapshot_slots >= 0) & (snapshot_offsets == num_accepted_tokens)
    for f, old in zip(pool, before):
        f[slots[landed]] = old[landed]
        f[snapshot_slots[landed]] = old[landed]



# ---- a drafter's rollback (SpecDecodePath.drafter) --------------------------------------------------


def rollback_of_a_context_without_checkpoints(module, pool, slots, num_accepted_tokens, placement):
    """PrismML llama.cpp #174 (a draft context's rollback): the draft context was built with
    n_rs_seq = 0, so it keeps no recurrent-state checkpoint to go back to; its removal of the
    rejected positions (llama_memory_seq_rm) fails wherever a draft was rejected, nobody checks the
    result, and the slot keeps the state after every token of the round: the next round proposes
    from stale positions. Where every draft was accepted there is nothing to remove."""
    draft_seq_rm(module, pool, slots, num_accepted_tokens, n_rs_seq=0)  # False where a draft was rejected
