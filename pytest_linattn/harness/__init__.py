"""The layer-parity harness: a client's sharded layer (`ShardedLayer`) at TP / SP / CP placements
(`Placement`) against its replicated layer, one forward and backward (`assert_sharded_parity`,
`assert_parity_cases`), and inside a trainer's steps: micro-batches, the trainer's reduction,
gradient norm, clipping, optimizer (`TrainingStep`, `assert_training_parity`). Plain modules, no
pytest:

    placement            where a layer runs and which tokens each rank holds
    cases                what a client supplies (ShardedLayer, ParityCase, TrainingStep)
    sharded_parity       one forward and backward: the test process's side (reference, checks)
    sharded_parity_report ... what it says beside a failing check (layouts, packing, shards, first wrong tokens)
    sharded_parity_rank  ... and what each rank runs
    training_step        training steps: the test process's side
    training_step_rank   ... and what each rank runs
    recompute            `recompute=` of both: the layer's forward under torch.utils.checkpoint,
                         bitwise equal to the run without it, its replay issuing the forward's collectives
    continuation         chunked prefill and decode against one full forward (`StatePath`,
                         `assert_continuation_parity`): the test process's side
    continuation_plans   ... where it cuts the sequences, and the calls
    continuation_report  ... its comparisons and reports
    continuation_rank    ... and what each rank runs
    state_pool           the same calls against a pool of state slots, padded decode batches,
                         freed and reused slots (`StatePoolPath`, `assert_state_pool_parity`)
    state_pool_rank      ... and what each rank runs
    state_pool_report    ... its comparisons and reports
    pool_modes           ... its serving options: block tables and per-group hits, mixed prefill and
                         decode rows in one call, admissions and rejected loads
    spec_decode          verify calls of K drafts accepting j of them, against the serial run
                         (`SpecDecodePath`, `SpecPlan`, `assert_spec_decode_parity`)
    spec_decode_rank     ... and what each rank runs
    spec_decode_report   ... its comparisons and reports
    spec_blocks          ... blocks at block boundaries (prefix caching with speculative decoding)
    spec_drafter         ... a drafter with its own recurrent state, rolled back to the accepted prefix
                         after every round (`SpecDrafter`)
    padded               padded batches `[B, T, hidden]` with an attention mask, left or right
                         padded, cut into calls (`PaddedStatePath`, `assert_padded_continuation_parity`)
    padded_rank          ... and what each rank runs
    isolation            document isolation of a whole model or decoder stack on a packed batch:
                         one document perturbed, the others bitwise unchanged, no gradient across
                         (`assert_document_isolation`, `PackedDocuments`)
    long_decode          many decode steps in the ranks' dtype: the state's dtype contract and
                         its error growth against the float64 serial run (`assert_long_decode_parity`;
                         the per-step errors it judges: `long_decode_errors`)
    state_handoff        prefill at one TP size, decode at another: each sequence's state handed
                         between the placements' ranks, the handed-off state located by rank,
                         sequence, field and head (`StateHandoffPath`, `assert_state_handoff_parity`)
    state_handoff_rank   ... and what each rank runs
    batch_invariance     N identical requests in one batch: bitwise identical rows and states, equal
                         to the request alone and to the float64 reference (`assert_batch_invariance`)
    fresh_init           a layer's fresh initialisation in the dtypes users init in: every parameter
                         finite, no dead head (`assert_fresh_init_is_finite`)
    checkpoint           checkpoints across TP sizes: saved at one TP size, merged, checked section by
                         section against the reference, loaded at another, run forward and backward there
                         (`CheckpointIO`, `assert_checkpoint_round_trip`)
    checkpoint_report    ... its per-section comparisons and words
    checkpoint_rank      ... and what each rank runs
    pipeline             a stack of layers split into pipeline stages (Placement.pp) over point-to-point
                         hand-offs, TP and CP inside each stage: forward and backward, and the decode
                         path with per-layer caches (`PipelineStack`, `assert_pipeline_parity`,
                         `assert_pipeline_decode_parity`), every report naming the stage and the layer
    pipeline_report      ... its comparisons and words
    pipeline_rank        ... and what each rank runs
"""

from .batch_invariance import assert_batch_invariance
from .cases import ParityCase, PipelineStack, ShardedLayer, StatePath, TrainingStep
from .checkpoint import CheckpointIO, assert_checkpoint_round_trip
from .continuation import SequencePlan, StateInvisibleWarning, assert_continuation_parity, plan_cuts
from .fresh_init import assert_fresh_init_is_finite
from .head_pairing import assert_head_pairing
from .isolation import PackedDocuments, assert_document_isolation
from .long_decode import assert_long_decode_parity, long_decode_errors
from .padded import PaddedStatePath, assert_padded_continuation_parity
from .pipeline import assert_pipeline_decode_parity, assert_pipeline_parity
from .placement import LAYOUTS, Placement, default_process_groups, rank_token_index
from .shared_process import assert_layers_share_a_process
from .sharded_parity import assert_parity_cases, assert_sharded_parity
from .spec_decode import SpecDecodePath, SpecDrafter, SpecPlan, assert_spec_decode_parity
from .state_handoff import StateHandoffPath, assert_state_handoff_parity
from .state_pool import StatePoolPath, assert_state_pool_parity
from .training_step import assert_training_parity

__all__ = ["LAYOUTS", "ParityCase", "Placement", "SequencePlan", "ShardedLayer", "StateInvisibleWarning", "StatePath",
           "StatePoolPath", "assert_state_pool_parity", "SpecDecodePath", "SpecDrafter", "SpecPlan",
           "assert_spec_decode_parity",
           "PaddedStatePath", "assert_padded_continuation_parity", "assert_long_decode_parity",
           "long_decode_errors", "PackedDocuments", "assert_document_isolation", "StateHandoffPath",
           "assert_state_handoff_parity",
           "CheckpointIO", "assert_checkpoint_round_trip",
           "PipelineStack", "assert_pipeline_parity", "assert_pipeline_decode_parity",
           "assert_batch_invariance", "assert_fresh_init_is_finite", "assert_head_pairing",
           "assert_layers_share_a_process",
           "TrainingStep", "assert_continuation_parity", "assert_parity_cases", "assert_sharded_parity",
           "assert_training_parity", "default_process_groups", "plan_cuts", "rank_token_index"]
