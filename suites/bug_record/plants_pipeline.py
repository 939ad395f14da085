"""Plants of pipeline-stage bugs, in the pipeline stack client (suites/clients/pipeline_stack.py):
subclasses of its PipelineStage and a replacement of its shard function. Each breaks what only a
stage after the first, or before the last, runs: the replicated stack (one stage) never runs it.

    StageLookingUpCachesByStageIndex   sglang #39699 / #38866: the caches kept under global layer
                                       IDs, looked up by stage-local IDs: a non-first stage's decode
                                       finds none of its layers' states (it reads the entries of
                                       stage 0's layers, never written on this stage) and runs
                                       from empty state
    StageWithAStaleRowMap              wtdcode/vllm-backport #63: a non-last stage post-processes a
                                       step late, so each decode step runs on the batch-to-row map
                                       the step before it left; once the batch changes, its rows
                                       read and write the states of other requests' slots
    shard_stage_by_local_index         transformers #24381: a stage's layers loaded from the
                                       checkpoint by their index inside the stage (no stage
                                       offset): stage 1 of 2 holds layers 0 and 1's weights
"""

from __future__ import annotations

from clients.pipeline_stack import PipelineStage, shard_stage

__all__ = ["StageLookingUpCachesByStageIndex", "StageWithAStaleRowMap", "shard_stage_by_local_index"]


class StageLookingUpCachesByStageIndex(PipelineStage):
    """The decode looks each layer's cache up by its index in the stage; the prefill kept it under
    the layer's global index (sglang #39699: transfer maps of stage-local IDs against pools of
    global model-layer IDs)."""

    def decode_layers(self) -> list:
        return list(enumerate(self.layers.values()))


class StageWithAStaleRowMap(PipelineStage):
    """Off the last stage, each decode step runs on the previous step's batch-to-row map (the
    post-processing that refreshes it lands a step late); the last stage's is fresh."""

    def row_map(self, sequences):
        fresh = super().row_map(sequences)
        if self.last_stage:
            return fresh
        stale = getattr(self, "_previous_rows", fresh)
        self._previous_rows = fresh
        return stale[:len(fresh)]


def shard_stage_by_local_index(config, full, placement, tp_rank, layers) -> dict:
    """The stage's shard with its layer j (0, 1, ... inside the stage) loaded from the
    checkpoint's layer j: the loop index, without the stage's first layer added."""
    moved = {}
    for j, i in enumerate(layers):
        for name, t in full.items():
            if name.startswith(f"layers.{j}."):
                moved[f"layers.{i}." + name[len(f"layers.{j}."):]] = t
    return shard_stage(config, moved, placement, tp_rank, layers)
