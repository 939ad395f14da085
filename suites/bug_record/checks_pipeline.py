"""The bug record's pipeline checks (`bug_record.checks`: "pp-parity", "pp-decode"), at the record's
sizes: a stack of 4 of the record's layers (suites/clients/pipeline_stack.py: pre-norm residual
blocks) split into 2 stages of 2 layers, float64.

    pp-parity  assert_pipeline_parity at PP 2 on the record's packing (CU)
    pp-decode  assert_pipeline_decode_parity at PP 2 on STATE_CU: the prompts prefilled, then
               the default decode counts (2, 1, 2, 1): the second step runs sequences 0 and 2,
               sequence 2 moved up to row 1
"""

from __future__ import annotations

import functools

from bug_record.checks import CONFIG, CU, RTOL, SEED, STATE_CU
from pytest_linattn.harness import Placement, assert_pipeline_decode_parity, assert_pipeline_parity

__all__ = ["PIPELINE", "PIPELINE_LAYERS", "pipeline_decode", "pipeline_parity", "pipeline_reference",
           "record_pipeline_stack"]

PIPELINE_LAYERS = 4
PIPELINE = Placement(pp=2)


@functools.lru_cache(maxsize=1)
def pipeline_reference():
    """The replicated stack of the record's layer, seeded."""
    from clients.pipeline_stack import LinearAttentionStack

    return LinearAttentionStack(CONFIG, PIPELINE_LAYERS, seed=SEED)


def record_pipeline_stack(stage_class=None, shard=None):
    """The client's PipelineStack of the record's layer; `stage_class` a planted stage, `shard` a
    planted shard function (each None: the client's)."""
    from clients.pipeline_stack import PipelineStage, pipeline_stack

    return pipeline_stack(CONFIG, PIPELINE_LAYERS, stage_class or PipelineStage, shard=shard)


def pipeline_parity(spawn, stack=None):
    assert_pipeline_parity(spawn, stack or record_pipeline_stack(), pipeline_reference(), [PIPELINE], CU,
                           hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, name="record")


def pipeline_decode(spawn, stack=None):
    assert_pipeline_decode_parity(spawn, stack or record_pipeline_stack(), pipeline_reference(), [PIPELINE], STATE_CU,
                                  hidden_size=CONFIG.hidden_size, seed=SEED, rtol=RTOL, name="record")
