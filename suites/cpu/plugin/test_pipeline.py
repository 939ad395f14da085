"""The pipeline checks (`pytest_linattn.harness.assert_pipeline_parity`, `assert_pipeline_decode_parity`)
on a stack of 4 of linattn's layers (suites/clients/pipeline_stack.py: pre-norm residual blocks)
split into stages, float64 within 1e-10: PP 2 and PP 2 x TP 2 (4 ranks) for GDN (qwen3_5, and
PP 2 x CP 2) and KDA, forward and backward, and the decode path (the prompts prefilled, then
decode steps with a sequence leaving the batch); PP 4 over 5 layers (stages of 1 and 2 layers).
Three plants of pipeline-stage bugs (suites/bug_record/plants_pipeline.py) each fail with the
stage and layer located; bad input raises a ValueError naming the parameter.
"""

import functools
import re

import pytest
import torch

from bug_record.plants_pipeline import (StageLookingUpCachesByStageIndex, StageWithAStaleRowMap,
                                        shard_stage_by_local_index)
from cases.layer_parity import linattn_layer, linattn_state_path, make_config, replicated_layer
from clients.pipeline_stack import LinearAttentionStack, PipelineStage, pipeline_stack
from pytest_linattn.harness import (ParityCase, Placement, PipelineStack, assert_continuation_parity,
                                    assert_pipeline_decode_parity, assert_pipeline_parity)
from pytest_linattn.harness.pipeline import decode_counts, stage_layers
from pytest_linattn.parity import capture_records

LAYERS = 4
CU = [0, 1, 14, 24, 32]  # a 1-token sequence; sequences crossing the CP 2 shard edge
DECODE_CU = [0, 9, 17, 26, 32]  # decode counts (2, 1, 2, 1): prompts of 7, 7, 7, 5 tokens (26: CP 2 splits them)
PP2, TP2_PP2, CP2_PP2 = Placement(pp=2), Placement(tp=2, pp=2), Placement(cp=2, pp=2)
RTOL = 1e-10


@functools.lru_cache(maxsize=4)
def reference(family, layers=LAYERS):
    return LinearAttentionStack(make_config(family, 2), layers, seed=7)


def stack(family="qwen3_5", stage_class=PipelineStage, shard=None, layers=LAYERS):
    config = make_config(family, 2)
    return pipeline_stack(config, layers, stage_class,
                          shard=None if shard is None else functools.partial(shard, config))


def train(spawn, subject, placements, family="qwen3_5", layers=LAYERS):
    with capture_records():
        assert_pipeline_parity(spawn, subject, reference(family, layers), placements, CU,
                               hidden_size=make_config(family, 2).hidden_size, seed=8, rtol=RTOL, name=family)


def decode(spawn, subject, placements, family="qwen3_5", layers=LAYERS):
    with capture_records():
        assert_pipeline_decode_parity(spawn, subject, reference(family, layers), placements, DECODE_CU,
                                      hidden_size=make_config(family, 2).hidden_size, seed=8, rtol=RTOL, name=family)


def failure(check, spawn, subject, placements) -> str:
    with pytest.raises(AssertionError) as info:
        check(spawn, subject, placements)
    return str(info.value)


# ---- the correct client ----------------------------------------------------------------------------


# CP inside a stage once (GDN): the layers' CP is the CP suites'; what PP adds is the same per family
PLACEMENTS = {"qwen3_5": [PP2, TP2_PP2, CP2_PP2], "kda": [PP2, TP2_PP2]}


@pytest.mark.parametrize("family", PLACEMENTS)
def test_stages_match_the_replicated_stack_forward_and_backward(spawn, family):
    train(spawn, stack(family), PLACEMENTS[family], family)


@pytest.mark.parametrize("family", PLACEMENTS)
def test_decode_across_stages_matches_one_full_forward(spawn, family):
    decode(spawn, stack(family), PLACEMENTS[family], family)


def test_four_stages_of_uneven_layer_counts(spawn):
    assert [list(stage_layers(5, 4, s)) for s in range(4)] == [[0], [1], [2], [3, 4]]
    train(spawn, stack(layers=5), [Placement(pp=4)], layers=5)
    decode(spawn, stack(layers=5), [Placement(pp=4)], layers=5)


# ---- the plants: each located by stage and layer ----------------------------------------------------


def test_layers_loaded_by_their_index_inside_the_stage_are_located(spawn):
    """transformers #24381: stage 1's layers 2 and 3 loaded from the checkpoint's layers 0 and 1
    (the loop index without the stage's offset): its weights are named for the layers they are,
    and the forward goes wrong at stage 1, stage 0 right."""
    report = failure(train, spawn, stack(shard=shard_stage_by_local_index), [TP2_PP2])
    assert ("the stages' weights: stage 1 (layers 2..3) holds other weights than the reference's for layer 2: the "
            "reference's layer 0's; stage 1 (layers 2..3) holds other weights than the reference's for layer 3: the "
            "reference's layer 1's\nthe forward goes wrong at stage 1 (layers 2..3): its output is off; before it "
            "right: stage 0 (layers 0..1)") in report
    assert re.search(r"qwen3_5/tp2/pp2/seed8 stage 1 \(layers 2\.\.3\) output tp_rank0\s+\S+\s+\S+\s+\S+\s+seq \d+ "
                     r"token \d+ \(global \d+\)", report)
    assert "stage 0 (layers 0..1) output" not in report  # stage 0's forward is right
    # a layer's gradient by stage, layer, and the head holding its worst element
    assert re.search(r"qwen3_5/tp2/pp2/seed8 stage 1 \(layers 2\.\.3\) layer 2 grad: \d+ of 10 tensor\(s\) off"
                     r"[\s\S]*?layers\.2\.linear_attn\.A_log\s+\S+\s+\S+\s+\S+\s+value head \d+ \(TP rank \d\)", report)


def test_caches_looked_up_by_stage_index_are_located(spawn):
    """sglang #39699: the caches kept under global layer IDs, the decode's lookup by stage-local
    IDs: stage 1 finds no state for its layers (it reads layer 0's and 1's entries, never written
    there) and decodes from empty state; the prefill and stage 0 right."""
    report = failure(decode, spawn, stack(stage_class=StageLookingUpCachesByStageIndex), [TP2_PP2])
    assert ("first wrong output: decode step 1 of 2 (sequences [0, 1, 2, 3]) on stage 1 (layers 2..3); the calls "
            "before it right on every stage, this one right on stage 0") in report
    for layer in (2, 3):
        assert re.search(rf"qwen3_5/tp2/pp2/seed8 stage 1 \(layers 2\.\.3\) layer {layer} cache: 2 of 2 tensor\(s\) off"
                         r"[\s\S]*?sequences off: \[0, 1, 2, 3\]; right: none", report)
    assert "stage 0 (layers 0..1) layer" not in report


def test_stale_row_map_off_the_last_stage_is_located(spawn):
    """wtdcode/vllm-backport #63: stage 0 (not the last) runs each decode step on the previous
    step's batch-to-row map. Step 2 runs sequences 0 and 2 (sequence 1 finished): row 1, sequence
    2's token, reads and writes sequence 1's slot on stage 0; the last stage's map is fresh."""
    report = failure(decode, spawn, stack(stage_class=StageWithAStaleRowMap), [TP2_PP2])
    assert ("first wrong output: decode step 2 of 2 (sequences [0, 2]) on stage 0 (layers 0..1); the calls before it "
            "right on every stage\n") in report
    assert "rows off: row 1 (sequence 2, token 8); right: row 0 (sequence 0, token 8)" in report
    for layer in (0, 1):  # sequence 1's slot written with sequence 2's step, sequence 2's never advanced
        assert re.search(rf"stage 0 \(layers 0\.\.1\) layer {layer} cache: [\s\S]*?sequences off: \[1, 2\]; "
                         r"right: \[0, 3\]", report)


# ---- bad input: ValueError naming the parameter and the rule -----------------------------------------


def _bad_reference():
    ref = LinearAttentionStack(make_config("qwen3_5", 2), LAYERS, seed=7)
    ref.head = torch.nn.Linear(2, 2, dtype=torch.float64)
    return ref


def no_spawn(*args, **kwargs):
    raise AssertionError("spawn must not be reached on bad input")


def _train_with(subject=None, placements=(PP2,), ref=None, cu=CU):
    assert_pipeline_parity(no_spawn, subject or stack(), ref or reference("qwen3_5"), list(placements), cu,
                           hidden_size=20, seed=0, rtol=RTOL)


def _decode_with(subject=None, placements=(PP2,), decode_tokens=None):
    assert_pipeline_decode_parity(no_spawn, subject or stack(), reference("qwen3_5"), list(placements), DECODE_CU,
                                  hidden_size=20, seed=0, rtol=RTOL, decode=decode_tokens)


def _no_unshard_state():
    import dataclasses

    return dataclasses.replace(stack(), unshard_state=None)


@pytest.mark.parametrize("make, rule", [
    (lambda: Placement(pp=0), r"Placement.pp must be a positive int, got 0"),
    (lambda: PipelineStack(num_layers=0, build=print, shard=print, unshard=print),
     r"PipelineStack.num_layers must be a positive int, got 0"),
    (lambda: PipelineStack(num_layers=2, build=lambda *a: None, shard=print, unshard=print),
     r"PipelineStack's callables must be module-level"),
    (lambda: _train_with(placements=[Placement(pp=8)]),
     r"Placement.pp must be at most the stack's num_layers=4 \(a stage holds one layer at least\), got pp8"),
    (lambda: _train_with(placements=[Placement(cp=3, pp=2)]),
     r"contiguous CP needs the total token count divisible by cp: 32 % 3 != 0"),
    (lambda: _train_with(ref=replicated_layer(make_config("qwen3_5", 2), 7)),
     r"reference.layers must hold the stack's num_layers=4 layers in order"),
    (lambda: _train_with(ref=_bad_reference()),
     r"reference: every parameter must be a layer's, named layers.<i>.<name> with i < 4; not so: \['head.weight', "
     r"'head.bias'\]"),
    (lambda: _decode_with(decode_tokens=[2, 1, 9, 1]),
     r"decode must give each of the 4 sequences an int number of decoded tokens, >= 0 and below its length "
     r"\[9, 8, 9, 6\]"),
    (lambda: _decode_with(placements=[Placement(cp=2, cp_layout="zigzag", pp=2)]),
     r"placements: the decode check runs TP and contiguous CP without sequence parallel, got cp2-zigzag/pp2"),
    (lambda: _decode_with(subject=_no_unshard_state(), placements=[TP2_PP2]),
     r"placement tp2/pp2: tp > 1 needs PipelineStack.unshard_state"),
    (lambda: ParityCase(linattn_layer(make_config("qwen3_5", 2)), Placement(tp=2, pp=2),
                        replicated_layer(make_config("qwen3_5", 2), 7), CU, *torch.randn(2, 1, 32, 20), rtol=RTOL),
     r"Placement.pp must be 1 for the parity harness \(ParityCase\), which runs one layer on every rank; got tp2/pp2: "
     r"a stack split into pipeline stages is checked by assert_pipeline_parity and assert_pipeline_decode_parity"),
    (lambda: assert_continuation_parity(no_spawn, linattn_state_path(make_config("qwen3_5", 2)),
                                        replicated_layer(make_config("qwen3_5", 2), 7), [PP2], CU, hidden_size=20,
                                        seed=0, rtol=RTOL, conv_width=4),
     r"Placement.pp must be 1 for the continuation check"),
])
def test_bad_input_raises_value_error(make, rule):
    with pytest.raises(ValueError, match=rule):
        make()


def test_placement_names_and_sizes_with_stages():
    assert Placement(pp=2).name == "pp2" and Placement(pp=2).size == 2
    assert Placement(tp=2, cp=2, pp=2).name == "tp2/cp2-contiguous/pp2" and Placement(tp=2, cp=2, pp=2).size == 8
    assert decode_counts(5) == [2, 1, 2, 1, 2]

