"""The bug record's checks of the serving options (`pytest_linattn.harness.pool_modes`, the
spec-decode check's blocks), at the record's sizes (`bug_record.checks`: its layer, float64, TP 2):

    state-pool-blocks      assert_state_pool_parity with block tables (the client maps token counts to
                           blocks itself) and a per-group hit length: blocks of 4, sequence 0 snapshots
                           at 4 and 8; sequence 1 resumes at 4 while its recurrent group cached up to 8,
                           sequence 2 resumes at 8
    state-pool-mixed       assert_state_pool_parity with mixed calls (decode rows in the prefill call): a
                           chunk ending on a block boundary beside a decode row, a later hit on it
    state-pool-admissions  assert_state_pool_parity with admissions (a load-back client): a rejected load
                           of a snapshot, its sequence run from zero in a slot another left, a hit loaded
    spec-decode-blocks     assert_spec_decode_parity with blocks of 4, 3 drafts: a scripted acceptance
                           landing on block boundaries, crossing one inside a round, a prefill chunk ending
                           on one
    spec-decode-drafter    assert_spec_decode_parity with a drafter (`SpecDecodePath.drafter`): a smaller GDN
                           layer (DRAFT_CONFIG, its own weights) as a draft context with a slot per sequence
                           (suites/clients/spec_drafter.py) beside the spec-decode check's client, on its plans

`run(spawn, check, subject)`: as `checks.run` (which hands these over; their words are in
`checks.CHECKS`).
"""

from __future__ import annotations

import torch

from bug_record.checks import CONFIG, RTOL, SEED, SPEC_DRAFTS, SPEC_PLANS, reference
from cases.layer_parity import make_config, replicated_layer
from clients.spec_decode import linattn_block_spec_path, linattn_spec_path
from clients.spec_drafter import with_drafter
from clients.state_pool import linattn_block_pool_path, linattn_load_back_path, linattn_pool_path
from pytest_linattn.harness import Placement, SequencePlan, SpecPlan, assert_spec_decode_parity, \
    assert_state_pool_parity

BLOCK = 4  # plants_serving.MAMBA_BLOCK
# block tables: sequence 1 resumes at 4 (the attention group's hit), its recurrent group cached up to 8
BLOCK_PLANS = (SequencePlan((4, 4, 2), 1), SequencePlan((3,), 1), SequencePlan((2,), 1))
BLOCK_HITS = {1: (0, 4), 2: (0, 8)}
GROUP_HITS = {1: 8}
# mixed calls: sequence 1's chunk ending on 4 runs beside sequence 0's decode row; sequence 2 hits it
MIXED_PLANS = (SequencePlan((2,), 3), SequencePlan((1, 3), 1), SequencePlan((2,), 1))
MIXED_HITS = {2: (1, 4)}
# admissions: sequence 2's load of sequence 0's snapshot at 4 is rejected (it runs all 7 tokens from
# zero, in the slot sequence 0 left); sequence 3's load goes through
LOAD_PLANS = (SequencePlan((4,), 1), SequencePlan((2,), 3), SequencePlan((3, 4), 1), SequencePlan((2,), 1))
LOAD_HITS = {3: (0, 4)}
REJECTED = {2: (0, 4)}
# spec decode with blocks: committed tokens 2 -> 4 (lands) -> 7 -> 8 (lands); a chunk ending on 4, then
# 7, 8 (lands); 3 -> 6 (crosses 4 inside) -> 6 -> 8 (lands)
SPEC_BLOCK_PLANS = (SpecPlan((2,), (2, 3, 1)), SpecPlan((4,), (3, 1)), SpecPlan((3,), (3, 0, 2)))
SPEC_BLOCK_DRAFTS = 3

# a drafter: the record's layer family with half its value heads, its own weights
DRAFT_CONFIG = make_config("qwen3_5", 1)

NAMES = ("state-pool-blocks", "state-pool-mixed", "state-pool-admissions", "spec-decode-blocks",
         "spec-decode-drafter")  # in checks.CHECKS


def cu_of(plans, hits):
    return torch.tensor([0, *(pl.length + hits.get(n, (0, 0))[1] for n, pl in enumerate(plans))]).cumsum(0).to(
        torch.int32)


def _pool(spawn, path, plans, hits, **options):
    assert_state_pool_parity(spawn, path, reference(), [Placement(tp=2)], cu_of(plans, hits), plans=plans,
                             hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, max_live=2, capture_sizes=(4,),
                             block_size=BLOCK, prefix_hits=hits, name="record", **options)


def drafter_spec_path(**fields):
    """The spec-decode check's client with linattn's drafter of DRAFT_CONFIG (`fields`: a planted propose
    or rollback)."""
    return with_drafter(linattn_spec_path(CONFIG), DRAFT_CONFIG, **fields)


def run(spawn, check, subject=None):
    if check == "state-pool-blocks":
        return _pool(spawn, subject or linattn_block_pool_path(CONFIG, BLOCK), BLOCK_PLANS, BLOCK_HITS,
                     group_hits=GROUP_HITS)
    if check == "state-pool-mixed":
        return _pool(spawn, subject or linattn_pool_path(CONFIG, mixed_calls=True), MIXED_PLANS, MIXED_HITS)
    if check == "state-pool-admissions":
        return _pool(spawn, subject or linattn_load_back_path(CONFIG), LOAD_PLANS, LOAD_HITS, rejected_hits=REJECTED)
    if check == "spec-decode-blocks":
        return assert_spec_decode_parity(spawn, subject or linattn_block_spec_path(CONFIG), reference(),
                                         [Placement(tp=2)], SPEC_BLOCK_PLANS, num_draft=SPEC_BLOCK_DRAFTS,
                                         hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, block_size=BLOCK,
                                         name="record")
    if check == "spec-decode-drafter":
        return assert_spec_decode_parity(spawn, subject or drafter_spec_path(), reference(), [Placement(tp=2)],
                                         SPEC_PLANS, num_draft=SPEC_DRAFTS, hidden_size=CONFIG.hidden_size, seed=SEED,
                                         rtol=RTOL, drafter_reference=replicated_layer(DRAFT_CONFIG, SEED + 1),
                                         name="record")
    raise ValueError(f"unknown serving check {check!r}; the serving checks: {list(NAMES)}")
