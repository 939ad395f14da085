"""The record's serving bugs on the engines' own kernels: each plant (suites/bug_record/plants_engines.py)
replaces the engine-side code the upstream bug lived in (vLLM's metadata builder, its CUDA-graph
padding, its align-mode prefix copies, the accept step; sglang's CUDA-graph padding, its accept
after target_verify) around vLLM 0.33.0's or sglang 0.5.23's unchanged kernels, and the serving
check the registry names must fail with a report that locates it. The same paths unplanted pass
in test_state_pools.py. Each test is an entry's `engine_tests` in suites/bug_record/registry.py.

Where each report must point is derived from the schedule (test_state_pools' plans, the record's
prefix plans) and the plant, never read off a report.
"""

import functools
import re

import pytest
import torch

from bug_record import plants_engines as plants
from bug_record.checks import PREFIX_HITS, PREFIX_PLANS
from cases.layer_parity import replicated_layer
from clients.engines.fetch import SGLANG, VLLM
from pytest_linattn.harness import Placement, assert_spec_decode_parity
from pytest_linattn.parity import capture_records
from test_state_pools import CONFIG, NUM_DRAFT, RTOL, SPEC_PLANS, check, mixed_spec_check, needs, prefix_check

CALL = r"call \d+ \((decode|prefill) of sequences \[[\d, ]+\] in slots \[[\d, ]+\][^)]*\)"


def caught(run, located):
    """`run` fails; its report matches `located` (a regex); the matched text, for the test's record."""
    with capture_records(), pytest.raises(AssertionError) as info:
        run()
    report = str(info.value)
    found = re.search(located, report)
    assert found, f"the report does not locate the plant as {located!r}:\n{report}"
    return found.group(0)


@needs(VLLM)
def test_vllm_51483_first_chunk_of_1_token_run_as_a_decode(spawn):
    from clients.engines.vllm_gdn import vllm_pool_path

    # sequence 0's first chunk is 1 token (test_state_pools.PLANS[0]): the decode kernels read its
    # slot as a previous holder left it (the pool's random fill), so its token 0 is the first wrong
    caught(lambda: check(spawn, vllm_pool_path(CONFIG, prefill=plants.vllm_prefill_1_token_chunks_as_decodes),
                         "vllm-51483"),
           r"first wrong token: sequence 0 \(chunks 1\+4, then 2 decode steps\) token 0, call 0 \(prefill of "
           r"sequences \[0, 1\] in slots \[1, 2\]\), its slot 1")


@needs(VLLM)
def test_vllm_37728_padding_rows_from_stale_state_indices(spawn):
    from clients.engines.vllm_gdn import vllm_pool_path

    # the first 1-row decode after a 2-row one (call 7: sequence 3 in slot 2, after call 4 ran slots
    # [1, 2]) pads row 1 with the stale slot 2: the padding row's state lands in sequence 3's slot,
    # whose next decode (call 8, its token 6) is the first wrong
    caught(lambda: check(spawn, vllm_pool_path(CONFIG, decode=plants.vllm_decode_padding_from_stale_rows),
                         "vllm-37728"),
           r"first wrong token: sequence 3 \(chunks 5, then 3 decode steps\) token 6, call 8 \(decode of sequences "
           r"\[2, 3\] in slots \[1, 2\][^)]*\), its slot 2")


@needs(SGLANG)
def test_sglang_padding_rows_clamped_to_live_slot_0(spawn):
    from clients.engines.sglang_gdn import sglang_pool_path

    # the first padded decode (call 2: sequence 1 alone) writes its padding rows into slot 0, sequence 0's
    caught(lambda: check(spawn, sglang_pool_path(CONFIG, decode=plants.sglang_decode_padding_clamped_to_slot_0),
                         "sglang-pad-clamp"),
           r"call 2 \(decode of sequences \[1\] in slots \[1\], padded to 3 rows with padding rows at slots "
           r"\[-1, -1\]\) changed live slot 0 \(sequence 0, [^)]*\), which it did not schedule: field conv")


@needs(VLLM)
def test_vllm_56196_short_chunk_writes_the_prefix_block(spawn):
    from clients.engines.vllm_gdn import vllm_pool_path

    # sequence 1 hits sequence 0's first 8 tokens and runs a 2-token chunk (< W-1 = 3): the block it
    # read (sequence 0's snapshot at token 8) changes
    owner, token = next(PREFIX_HITS[n] for n in PREFIX_HITS if sum(PREFIX_PLANS[n].chunks) < CONFIG.conv_size - 1)
    caught(lambda: prefix_check(spawn, vllm_pool_path(CONFIG, prefill=plants.vllm_prefix_short_chunk_in_the_prefix_block),
                                "vllm-56196"),
           CALL + rf" changed prefix block slot \d+ \(the snapshot of sequence {owner} at token {token}\), which it "
           r"read from: field conv")


def spec_check(spawn, path, reference_forward, name):
    assert_spec_decode_parity(spawn, path, replicated_layer(CONFIG, 41), [Placement()], SPEC_PLANS, num_draft=NUM_DRAFT,
                              hidden_size=CONFIG.hidden_size, seed=43, rtol=RTOL, dtype=torch.float32,
                              reference_forward=reference_forward, name=name)


# the first verify round that accepts fewer than every draft: round 1, sequence 1 accepts 1 of 2
SPEC_STATE = (r"call 2 \(verify round 1: the next token and 2 drafts each of sequences \[0, 1, 2\] in slots .*?, "
              r"accepted \[2, 1, 0\]\): slot [^,]+(, [^,]+)*, sequence 1 \([^)]*\), state after token 4, 1 of 2 drafts "
              r"accepted: field conv error \S+")


@needs(VLLM)
def test_vllm_spec_rows_keep_the_rejected_drafts(spawn):
    from clients.engines.vllm_gdn import spec_reference_forward, vllm_spec_path

    caught(lambda: spec_check(spawn, vllm_spec_path(CONFIG, NUM_DRAFT, accept=plants.vllm_accept_keeping_rejected_drafts),
                              functools.partial(spec_reference_forward, NUM_DRAFT), "vllm-spec-rejected"),
           SPEC_STATE)


@needs(SGLANG)
def test_sglang_27658_verify_keeps_the_rejected_drafts(spawn):
    from clients.engines.layout import engine_reference_forward
    from clients.engines.sglang_gdn import sglang_spec_path

    caught(lambda: spec_check(spawn, sglang_spec_path(CONFIG, accept=plants.sglang_accept_keeping_rejected_drafts),
                              engine_reference_forward, "sglang-27658"),
           SPEC_STATE)


@needs(VLLM)
def test_vllm_56531_undrafted_rows_on_the_non_spec_path(spawn):
    from bug_record.registry import by_key
    from clients.engines.vllm_gdn import vllm_spec_path

    # the record's mixed plans (bug_record.checks.SPEC_MIXED_PLANS): the entry's own located line
    caught(lambda: mixed_spec_check(spawn, vllm_spec_path(CONFIG, NUM_DRAFT,
                                                          verify=plants.vllm_verify_undrafted_rows_on_the_non_spec_path),
                                    "vllm-56531"),
           by_key()["vllm-56531"].located)
