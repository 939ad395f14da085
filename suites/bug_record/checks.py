"""The checks the bug record runs, each on the project's layer (unplanted) or on a plant, at the
record's sizes: one tiny GatedDeltaNet (qwen3_5 layout, 4 key heads, 2 value heads per key head,
conv width 4), float64 unless a check says otherwise. Each check is the public one a client calls:

    tp-parity      assert_sharded_parity at TP 2 (output, dx, every parameter gradient)
    tp-replicated  assert_sharded_parity at TP 4 beyond the key heads: 2 key heads (8 value heads),
                   each key head replicated over 2 ranks
    tp-stack       assert_sharded_parity at TP 2 of a 2-layer decoder stack of the layer, sharded as sglang
                   runs Qwen3.5 (suites/clients/tp_decoder.py: each layer's MLP all-reduce deferred to the
                   next layer's input norm): the hidden state after each layer, then the final norm's
                   output, each its own case; the report says which are off and which right
                   (bug_record.checks_model)
    cp-parity      assert_sharded_parity at CP 2, contiguous
    cp-short       assert_sharded_parity at CP 4 on 8 tokens: pieces of 2 < W-1 tokens
    cp-zigzag      assert_sharded_parity at CP 2 in the per-sequence zigzag layout (each sequence in 2 * cp
                   chunks, rank r holding chunks r and 2cp-1-r of every one), CU_ZIGZAG
    cp-padded      assert_sharded_parity at CP 2, padded THD (zigzag over every sequence padded to a
                   multiple of 2 * cp; the lengths are not)
    oracle         the replicated layer against the HF-written composition over linattn.reference
                   (suites/cpu/library/test_layer_math.py's oracle, recurrent mode; bug_record.checks_model)
    continuation   assert_continuation_parity at TP 2: chunked prefill and decode vs one forward
    continuation-fp32  the same with the ranks' layer in float32 (<= 1e-5)
    state-pool     assert_state_pool_parity at TP 2: the slot-pool client (suites/clients/state_pool.py),
                   2 sequences live at once (slots freed and reused), decode padded to 4 rows
    state-pool-inner  assert_state_pool_parity at TP 2 in prefix mode with inner snapshots: blocks of 4,
                   chunks of 10 and 6 tokens crossing block boundaries, 2 prefix hits on inner snapshots
    state-pool-captured  assert_state_pool_parity at TP 2 with captured decode steps (the pool client's
                   CUDA-graph runner, suites/clients/state_pool.py): decode padded to 1 or 2 rows, each size
                   captured once and replayed, static buffers of 4 rows
    state-pool-prefix  assert_state_pool_parity at TP 2 in prefix mode: blocks of 4 tokens, 2 prefix
                   hits (one with a 2-token chunk, shorter than W-1), snapshots and shared blocks checked
    spec-decode    assert_spec_decode_parity at TP 2: the slot-pool client with verify and accept
                   (suites/clients/spec_decode.py), 3 drafts per verify call, 0..3 accepted
    spec-decode-mixed  assert_spec_decode_parity at TP 2 in vLLM's layout (a bonus token, rows of 1 + K
                   slots, suites/clients/spec_decode.py's row client), K = 2, verify calls mixing rows
                   that drafted nothing with rows that did
    state-handoff  assert_state_handoff_parity on 2 key heads (TP 4 beyond them): prompts prefilled at
                   TP 1, their states handed to TP 2 and TP 4 (suites/clients/state_handoff.py), 3 decode steps
    state-handoff-merge  the same from TP 2 to TP 1 (the source ranks' shards merged)
    long-decode    assert_long_decode_parity at TP 1, float32 ranks: 2 sequences, a 5-token
                   prefill, 32 decode steps (the state-dtype rule and the error bound)
    padded         assert_padded_continuation_parity at TP 2: the padded-batch client
                   (suites/clients/padded.py), left padded, pad runs straddling call boundaries
    recompute      assert_sharded_parity at TP 2 with recompute='non-reentrant': the layer under
                   torch.utils.checkpoint, its replay's collectives and gradients against the run without it
    isolation      assert_document_isolation: the layers in a two-block decoder stack
                   (suites/clients/isolation.py) fed position_ids only, as a packing collator
                   gives them; one token of each document perturbed, the others bitwise unchanged
                   (bug_record.checks_model, as checkpoint, checkpoint-fp8 and fresh-init)
    training-tp, training-cp  assert_training_parity: 2 micro-batches of one length and two
                   packings, 2 steps, clipping that bites, at TP 2 / CP 2
    checkpoint     assert_checkpoint_round_trip: saved at TP 2, loaded at TP 1, and saved at TP 1, loaded at
                   TP 2 (suites/clients/checkpoint.py: linattn's shard / unshard as an exporter and a loader)
    checkpoint-fp8 the same through an FP8-style client (suites/clients/quantized_checkpoint.py: a scale
                   per section of a fused weight, per head along the sharded dim), its weights at its bound
    fresh-init     assert_fresh_init_is_finite: the layer class built 64 times (seeds) in float32 and bf16 with
                   32 value heads, every parameter finite
    pp-parity      assert_pipeline_parity at PP 2: a stack of 4 of the layer in 2 stages
                   (suites/clients/pipeline_stack.py; bug_record.checks_pipeline)
    pp-decode      assert_pipeline_decode_parity at PP 2: the same stack's prefill and decode steps, a
                   sequence leaving the batch after the first step (bug_record.checks_pipeline)
    head-pairing   assert_head_pairing at TP 2: a prefill call and a decode step, the key head each value head
                   reads observed against the config's pairing (bug_record.checks_heads)
    head-pairing-next  the same on a Qwen3-Next layer (qwen3_next layout, the record's sizes)
    shared-process assert_layers_share_a_process at TP 2: the record's layer and a second layer of another
                   key-head layout built in the same rank processes, then run (bug_record.checks_heads)
    state-pool-blocks, state-pool-mixed, state-pool-admissions, spec-decode-blocks, spec-decode-drafter
                   the serving options: block tables with a per-group hit, decode rows in the prefill
                   call, admissions with a rejected load, speculative decoding with blocks at block
                   boundaries, and with a drafter of its own state beside the target
                   (bug_record.checks_serving)
    gate-gradients the GDN op entry's in-kernel gate (A_log, dt_bias) under strong decay: the gate input's,
                   A_log's and dt_bias's gradients against float64, bf16 (<= 2e-2); the subject an op with
                   kernels.gated_delta_rule's signature (suites/cases/gate_gradients.py)
    kernel         fla's kernel against the float64 reference in the entry's kernel test (a bug the
                   layers cannot reach); run by that test, never by `run`

`run(spawn, check, subject)` raises AssertionError with the check's report when it fails; the
subject is what the check takes (a ShardedLayer, a StatePath, a StatePoolPath, a SpecDecodePath, a
PaddedStatePath, a layer class, a decoder stack class, a TrainingStep and its layer), None for the
project's own (for tp-stack, the client stack of suites/clients/tp_decoder.py). Reference
runs are cached: the rows of one check share one.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cases.layer_parity import linattn_layer, linattn_state_path, make_config, random_state_dict
from linattn.layers import build_layer
from clients.padded import linattn_padded_path
from pytest_linattn.harness import (Placement, SequencePlan, SpecPlan, TrainingStep, assert_continuation_parity,
                                    assert_padded_continuation_parity, assert_sharded_parity,
                                    assert_spec_decode_parity, assert_state_handoff_parity, assert_state_pool_parity,
                                    assert_training_parity)
from pytest_linattn.harness.long_decode import assert_long_decode_parity
from clients.spec_decode import linattn_row_spec_path, linattn_spec_path
from clients.state_pool import linattn_pool_path

CONFIG = make_config("qwen3_5", 2)
RTOL = 1e-10
SEED = 44
REPLICATED_CONFIG = dataclasses.replace(CONFIG, num_k_heads=2)  # TP 4: 2 replicas per key head
CU = [0, 1, 14, 24, 32]  # a 1-token sequence; sequences crossing the CP 2 shard edge
CU_ZIGZAG = [0, 8, 20, 32]  # every length a multiple of 2 * cp (4)
CU_SHORT = [0, 1, 8]  # at CP 4 every piece holds 2 tokens, fewer than W-1 = 3
STATE_SEQLENS = (14, 12, 10, 7)  # cut by plan_cuts into 1+3+8, 4+6, 8, 3+.. chunks, then 2 decode steps
STATE_CU = torch.tensor([0, *STATE_SEQLENS]).cumsum(0).to(torch.int32)
CUT_CHUNK = 8  # plan_cuts' chunk size: cuts at 8, 7 and 9 tokens
# the state-pool check's schedule over STATE_SEQLENS: chunks, then decode steps; with 2 live at once
# sequences 2 and 3 take freed slots, and a decode padded to 4 rows runs while slot 0's sequence
# is in a prefill call
POOL_PLANS = (SequencePlan((1, 5, 6), 2), SequencePlan((4, 6), 2), SequencePlan((8,), 2), SequencePlan((3,), 4))
POOL_CAPTURE_SIZES = (4,)
# prefix mode: sequence 0 snapshots at tokens 4 and 8; sequence 1 hits its first 8 and runs a
# 2-token chunk (< W-1), sequence 2 hits its first 4 and snapshots at 8 itself
PREFIX_SEQLENS = (12, 11, 9)
PREFIX_CU = torch.tensor([0, *PREFIX_SEQLENS]).cumsum(0).to(torch.int32)
PREFIX_PLANS = (SequencePlan((4, 4, 2), 2), SequencePlan((2,), 1), SequencePlan((4,), 1))
PREFIX_HITS = {1: (0, 8), 2: (0, 4)}
PREFIX_BLOCK = 4
# verify rounds of 3 drafts: every round mixes 0 < j < 3 with j = 3 (where keeping every draft is right)
# inner snapshots: sequence 0's 10-token chunk crosses 4 and 8 and ends off a boundary, its 6-token
# chunk (shorter than plants_state.CADENCE) crosses 12 and ends on 16; sequence 1 hits the snapshot
# at 8, sequence 2 the one at 12
INNER_SEQLENS = (18, 12, 16)
INNER_CU = torch.tensor([0, *INNER_SEQLENS]).cumsum(0).to(torch.int32)
INNER_PLANS = (SequencePlan((10, 6), 2), SequencePlan((3,), 1), SequencePlan((2,), 2))
INNER_HITS = {1: (0, 8), 2: (0, 12)}
INNER_BLOCK = 4
SPEC_PLANS = (SpecPlan((1, 5), (2, 3)), SpecPlan((4,), (3, 1)), SpecPlan((6,), (0, 2)), SpecPlan((3,), (1, 0)))
SPEC_DRAFTS = 3
# mixed verify calls, K = 2 and a bonus token: round 1 sequence 2 drafted nothing, round 2 sequence
# 0 drafted nothing after accepting both drafts of round 1 (its state in column 2, not 0)
SPEC_MIXED_PLANS = (SpecPlan((3,), (2, 0, 1), drafts=(2, 0, 2)), SpecPlan((1, 2), (1, 2, 0)),
                    SpecPlan((2,), (0, 1, 2), drafts=(0, 2, 2)))
SPEC_MIXED_DRAFTS = 2
LONG_DECODE_STEPS = 32  # a bf16 state fails the dtype rule at step 1, the error bound within a few steps
# left padded: row 1's 5 pads fill call 0 and straddle into call 1, row 3's 7 pads span calls 0..2
PADDED_SEQLENS = (7, 3, 5, 1)
PADDED_WIDTH, PADDED_CUTS, PADDED_DECODE = 8, (3, 5), 2
TRAINING_PACKINGS = [[0, 1, 14, 24, 32], [0, 5, 24, 32]]  # one length, two packings
MAX_NORM = 0.05  # under every step's gradient norm: clipping bites
FLOAT32_RTOL = 1e-5

CHECKS = {
    "tp-parity": "TP parity (`assert_sharded_parity`, TP 2)",
    "tp-replicated": "TP parity beyond the key heads (`assert_sharded_parity`, TP 4, 2 key heads)",
    "tp-stack": "TP parity of a decoder stack (`assert_sharded_parity`, TP 2, 2 layers: each layer's hidden state, "
                "then the output)",
    "cp-parity": "CP parity (`assert_sharded_parity`, CP 2)",
    "cp-short": "CP parity, pieces shorter than W-1 (`assert_sharded_parity`, CP 4, 8 tokens)",
    "cp-zigzag": "CP parity, per-sequence zigzag (`assert_sharded_parity`, CP 2, `zigzag`)",
    "cp-padded": "CP parity, padded THD (`assert_sharded_parity`, CP 2, `zigzag-padded`)",
    "oracle": "oracle (`test_layer_math.py` composition over `linattn.reference`)",
    "continuation": "continuation (`assert_continuation_parity`, TP 2, float64)",
    "continuation-fp32": "continuation (`assert_continuation_parity`, TP 2, float32 at 1e-5)",
    "state-pool": "state pool (`assert_state_pool_parity`, TP 2, slots reused, decode padded to 4 rows)",
    "state-pool-inner": "state pool, inner snapshots (`assert_state_pool_parity`, TP 2, blocks of 4, "
                        "`inner_snapshots`: chunks of 10 and 6, 2 prefix hits on inner snapshots)",
    "state-pool-captured": "state pool, captured steps (`assert_state_pool_parity`, TP 2, `capture`: each padded "
                           "batch size captured once and replayed)",
    "state-pool-prefix": "state pool, prefix mode (`assert_state_pool_parity`, TP 2, blocks of 4, 2 prefix hits)",
    "spec-decode": "speculative decoding (`assert_spec_decode_parity`, TP 2, 3 drafts, 0..3 accepted)",
    "spec-decode-mixed": "speculative decoding, mixed calls (`assert_spec_decode_parity`, TP 2, vLLM's layout, rows "
                         "that drafted nothing beside rows that did)",
    "state-handoff": "state handoff (`assert_state_handoff_parity`, TP 1 to TP 2 and TP 4, 2 key heads)",
    "state-handoff-merge": "state handoff (`assert_state_handoff_parity`, TP 2 to TP 1, 2 key heads)",
    "long-decode": "long decode (`assert_long_decode_parity`, float32, 32 steps, state dtype >= float32)",
    "recompute": "TP parity under activation recompute (`assert_sharded_parity(recompute='non-reentrant')`, TP 2)",
    "isolation": "document isolation (`assert_document_isolation`, a decoder stack fed position_ids only)",
    "padded": "padded batches (`assert_padded_continuation_parity`, TP 2, left padded, pads straddling calls)",
    "training-tp": "training step (`assert_training_parity`, TP 2)",
    "training-cp": "training step (`assert_training_parity`, CP 2)",
    "checkpoint": "checkpoint round trip (`assert_checkpoint_round_trip`, saved at TP 2 loaded at TP 1, and 1 to 2)",
    "checkpoint-fp8": "checkpoint round trip, FP8-style scales (`assert_checkpoint_round_trip`, TP 2 to 1 and 1 to 2)",
    "fresh-init": "fresh initialisation (`assert_fresh_init_is_finite`, float32 and bf16, 64 seeds)",
    "pp-parity": "pipeline parity (`assert_pipeline_parity`, PP 2, a stack of 4 layers)",
    "pp-decode": "pipeline decode (`assert_pipeline_decode_parity`, PP 2, a stack of 4 layers, the batch changing)",
    "head-pairing": "head pairing (`assert_head_pairing`, TP 2: prefill and a decode step, which key head each value "
                    "head reads)",
    "head-pairing-next": "head pairing of a Qwen3-Next layer (`assert_head_pairing`, TP 2, qwen3_next layout)",
    "shared-process": "layers sharing a process (`assert_layers_share_a_process`, TP 2, two layers of other key-head "
                      "layouts built, then run)",
    "state-pool-blocks": "state pool, block tables (`assert_state_pool_parity`, TP 2, `block_tables`, a hit whose "
                         "recurrent group cached more than the engine resumes at: `group_hits`)",
    "state-pool-mixed": "state pool, mixed calls (`assert_state_pool_parity`, TP 2, `mixed_calls`: decode rows in "
                        "the prefill call)",
    "state-pool-admissions": "state pool, admissions (`assert_state_pool_parity`, TP 2, `admit`: a load-back at "
                             "admission, a rejected load rolled back)",
    "spec-decode-blocks": "speculative decoding with blocks (`assert_spec_decode_parity`, TP 2, `block_size` 4: "
                          "acceptance landing on block boundaries)",
    "spec-decode-drafter": "speculative decoding with a drafter (`assert_spec_decode_parity`, TP 2, 3 drafts, "
                           "`SpecDecodePath.drafter`: a draft layer's own state rolled back to the accepted prefix)",
    "gate-gradients": "gate gradients at strong decay (`cases.gate_gradients`: dg, dA_log, ddt_bias of the GDN op, "
                      "bf16, against float64)",
    "delta-rule-at-scale": "the op at scale (`harness.scale.assert_delta_rule_at_scale`: float32 against float64 "
                           "in pieces with the state passed along, forward and backward, rows judged one by one; "
                           "3,000 tokens here, past 2**31 elements on a GPU in suites/scale)",
    "rows-at-scale": "an elementwise op at scale (`harness.scale.assert_rows_match`: forward and backward against "
                     "its float64 formula, every (token, head) row judged, the first wrong one named; 785 tokens, "
                     "past 131,072 tokens on a GPU in suites/scale)",
    "kernel": "fla's kernel against the float64 reference (`linattn.reference`), in its kernel test",
}



@functools.lru_cache(maxsize=4)
def reference(cls=None):
    """The replicated layer (float64, seeded weights); `cls` a planted layer class."""
    layer = build_layer(CONFIG, dtype=torch.float64) if cls is None else cls(CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(CONFIG, SEED))
    return layer


@functools.lru_cache(maxsize=1)
def replicated_heads_reference():
    """The replicated layer of REPLICATED_CONFIG (float64, seeded weights)."""
    layer = build_layer(REPLICATED_CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(REPLICATED_CONFIG, SEED))
    return layer


def _parity(spawn, layer, placement, cu, ref=None, config=CONFIG):
    assert_sharded_parity(spawn, layer or linattn_layer(config), ref or reference(), [placement], cu,
                          hidden_size=config.hidden_size, seed=SEED, rtol=RTOL, name="record")


def state_path(layer=None, **fields):
    """linattn's StatePath with a planted layer and/or planted prefill / decode."""
    path = linattn_state_path(CONFIG, **fields)
    return path if layer is None else dataclasses.replace(path, layer=layer)


def continuation(spawn, path, dtype=torch.float64, rtol=RTOL):
    assert_continuation_parity(spawn, path or state_path(), reference(), [Placement(tp=2)], STATE_CU,
                               hidden_size=CONFIG.hidden_size, seed=SEED, rtol=rtol, conv_width=CONFIG.conv_size,
                               chunk_size=CUT_CHUNK, dtype=dtype, name="record")


def state_pool(spawn, path=None):
    assert_state_pool_parity(spawn, path or linattn_pool_path(CONFIG), reference(), [Placement(tp=2)], STATE_CU,
                             plans=POOL_PLANS, hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, max_live=2,
                             capture_sizes=POOL_CAPTURE_SIZES, name="record")


def state_pool_inner(spawn, path=None):
    assert_state_pool_parity(spawn, path or linattn_pool_path(CONFIG, inner_snapshots=True), reference(),
                             [Placement(tp=2)], INNER_CU, plans=INNER_PLANS, hidden_size=CONFIG.hidden_size, seed=SEED,
                             rtol=RTOL, max_live=2, capture_sizes=POOL_CAPTURE_SIZES, block_size=INNER_BLOCK,
                             prefix_hits=INNER_HITS, name="record")


CAPTURED_SIZES = (1, 2)  # below the runner's 4-row static buffers (clients.state_pool.MAX_CAPTURED_ROWS)


def state_pool_captured(spawn, path=None):
    from clients.state_pool import linattn_captured_pool_path

    assert_state_pool_parity(spawn, path or linattn_captured_pool_path(CONFIG), reference(), [Placement(tp=2)],
                             STATE_CU, plans=POOL_PLANS, hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL,
                             max_live=2, capture_sizes=CAPTURED_SIZES, name="record")


def state_pool_prefix(spawn, path=None):
    assert_state_pool_parity(spawn, path or linattn_pool_path(CONFIG), reference(), [Placement(tp=2)], PREFIX_CU,
                             plans=PREFIX_PLANS, hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, max_live=2,
                             capture_sizes=POOL_CAPTURE_SIZES, block_size=PREFIX_BLOCK, prefix_hits=PREFIX_HITS,
                             name="record")


def spec_decode(spawn, path=None):
    assert_spec_decode_parity(spawn, path or linattn_spec_path(CONFIG), reference(), [Placement(tp=2)], SPEC_PLANS,
                              num_draft=SPEC_DRAFTS, hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL,
                              name="record")


def spec_decode_mixed(spawn, path=None):
    assert_spec_decode_parity(spawn, path or linattn_row_spec_path(CONFIG, SPEC_MIXED_DRAFTS), reference(),
                              [Placement(tp=2)], SPEC_MIXED_PLANS, num_draft=SPEC_MIXED_DRAFTS,
                              hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, name="record")


HANDOFF_STEPS = 3


def state_handoff(spawn, path=None, source=Placement(), targets=(Placement(tp=2), Placement(tp=4))):
    from clients.state_handoff import linattn_handoff_path

    assert_state_handoff_parity(spawn, path or linattn_handoff_path(REPLICATED_CONFIG), replicated_heads_reference(),
                                source, list(targets), STATE_CU, decode_steps=HANDOFF_STEPS,
                                hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, name="record")


def long_decode(spawn, path=None):
    # one rank: a collective per decode step at TP costs more than it shows; TP is the short checks'
    assert_long_decode_parity(spawn, path or state_path(), reference(), [Placement(tp=1)], num_sequences=2, prefill=5,
                              steps=LONG_DECODE_STEPS, hidden_size=CONFIG.hidden_size, seed=SEED, rtol=FLOAT32_RTOL,
                              name="record")


def padded(spawn, path=None):
    assert_padded_continuation_parity(spawn, path or linattn_padded_path(CONFIG), reference(), [Placement(tp=2)],
                                      PADDED_SEQLENS, padding="left", cuts=PADDED_CUTS, decode=PADDED_DECODE,
                                      width=PADDED_WIDTH, hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL,
                                      name="record")


def training(spawn, subject, placement):
    layer, step = subject or (None, None)
    steps = assert_training_parity(spawn, layer or linattn_layer(CONFIG), reference(), [placement], TRAINING_PACKINGS,
                                   hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL,
                                   step=step or TrainingStep(steps=2, max_norm=MAX_NORM), name="record")
    assert all(s["clipped"] for s in steps), f"clipping must bite on every step: {steps}"


def run(spawn, check, subject=None):
    """Run `check` (a CHECKS key) on `subject` (None: the project's layer)."""
    if check == "tp-parity":
        return _parity(spawn, subject, Placement(tp=2), CU)
    if check == "tp-replicated":
        return _parity(spawn, subject, Placement(tp=4), CU, replicated_heads_reference(), REPLICATED_CONFIG)
    if check in ("oracle", "tp-stack", "isolation", "checkpoint", "checkpoint-fp8", "fresh-init"):
        from bug_record import checks_model

        return checks_model.run(check, spawn, subject)
    if check == "cp-parity":
        return _parity(spawn, subject, Placement(cp=2), CU)
    if check == "cp-short":
        return _parity(spawn, subject, Placement(cp=4), CU_SHORT)
    if check == "cp-zigzag":
        return _parity(spawn, subject, Placement(cp=2, cp_layout="zigzag"), CU_ZIGZAG)
    if check == "cp-padded":
        return _parity(spawn, subject, Placement(cp=2, cp_layout="zigzag-padded"), CU)
    if check == "continuation":
        return continuation(spawn, subject)
    if check == "continuation-fp32":
        return continuation(spawn, subject, dtype=torch.float32, rtol=FLOAT32_RTOL)
    if check == "state-pool":
        return state_pool(spawn, subject)
    if check == "state-pool-inner":
        return state_pool_inner(spawn, subject)
    if check == "state-pool-captured":
        return state_pool_captured(spawn, subject)
    if check == "state-pool-prefix":
        return state_pool_prefix(spawn, subject)
    if check == "spec-decode":
        return spec_decode(spawn, subject)
    if check == "spec-decode-mixed":
        return spec_decode_mixed(spawn, subject)
    if check == "state-handoff":
        return state_handoff(spawn, subject)
    if check == "state-handoff-merge":
        return state_handoff(spawn, subject, Placement(tp=2), (Placement(),))
    if check == "long-decode":
        return long_decode(spawn, subject)
    if check == "padded":
        return padded(spawn, subject)
    if check == "recompute":
        return assert_sharded_parity(spawn, subject or linattn_layer(CONFIG), reference(), [Placement(tp=2)], CU,
                                     hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, name="record",
                                     recompute="non-reentrant")
    if check == "training-tp":
        return training(spawn, subject, Placement(tp=2))
    if check == "training-cp":
        return training(spawn, subject, Placement(cp=2))
    if check in ("pp-parity", "pp-decode"):
        from bug_record.checks_pipeline import pipeline_decode, pipeline_parity

        return (pipeline_parity if check == "pp-parity" else pipeline_decode)(spawn, subject)
    if check in ("head-pairing", "head-pairing-next", "shared-process"):
        from bug_record import checks_heads

        if check == "shared-process":
            return checks_heads.shared_process(spawn, subject)
        config = checks_heads.NEXT_CONFIG if check == "head-pairing-next" else CONFIG
        return checks_heads.head_pairing(spawn, subject, config)
    if check in ("state-pool-blocks", "state-pool-mixed", "state-pool-admissions", "spec-decode-blocks",
                 "spec-decode-drafter"):
        from bug_record import checks_serving

        return checks_serving.run(spawn, check, subject)
    if check == "gate-gradients":
        from cases.gate_gradients import assert_gate_gradients

        return assert_gate_gradients(subject, dtype=torch.bfloat16, decay="strong")
    if check in ("delta-rule-at-scale", "rows-at-scale"):
        from bug_record import checks_scale

        run = checks_scale.delta_rule_at_scale if check == "delta-rule-at-scale" else checks_scale.rows_at_scale
        return run(subject, SEED)
    if check == "kernel":
        raise ValueError("the kernel check runs in the entry's kernel test (registry.Bug.kernel_test), not here")
    raise ValueError(f"unknown check {check!r}; the checks: {sorted(CHECKS)}")
