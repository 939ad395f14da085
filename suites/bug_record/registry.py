"""The bug record: the public reports (2025-2026) of bugs in sharded or stateful linear-attention
and SSM layers, grouped by mechanism (docs/bugs.md is the table made from a run), one `Bug` each:
its upstream report(s), its mechanism in one sentence, its class, the check that must catch it,
the plant (`plants_layer`, `plants_state`) and where the plant runs. A serving entry whose
mechanism lived in an engine's code around its kernels is also planted there (`plants_engines`,
`engine_tests`): vLLM's or sglang's own kernels, pinned, under the serving check, in suite engines.

Adding a bug is one entry here and one plant. `caught`: the check must fail on the plant with a
report matching `located` (a line naming the tensor and the sequence, token, head, call or rank
where it is off; `bug_record.located` derives each from the record's sizes); otherwise `missing`
names the check not built yet, and the closest check runs on the plant as a strict xfail (when
the missing check is built, it turns into XPASS).

A kernel row (`suite` other than "cpu") is a bug in fla's kernels, which the project's layers
cannot reach (they hand fla B = 1 and contiguous gradients): its catch is a kernel test,
`kernel_test` ("suites/<suite>/<file>.py::<function>", fla's kernels under Triton's interpreter
in suite "fla-interpret"), with the same check on a GPU in `gpu_test`; the tests locate it
themselves, and docs/bugs.md shows their outcome. A bug the pinned release still has is live: no
plant (the release is the subject), its kernel test a strict xfail naming the report, `repro` a
standalone script under suites/live_bugs/ (a row of the live-bug page, docs/live-bugs.md).

`fidelity` says how close the plant is to the upstream report (the audit's reading of each
entry against its thread, /work/shared/notes/bug-record-audit.md); `fidelity_note` says how, for
every entry that is not simply faithful:
    faithful         the upstream mechanism, planted where it lived (in linattn's layer, or in the
                     project's client of the same kind: then the note says so)
    moved            the upstream mechanism, planted elsewhere: the note says where it lived and
                     where it is planted
    partial          one part of the upstream report is planted: the note says which
    project finding  no upstream report: the project found it in the code (the note says where)

`runs` says where the plant acts (the planting rule: a plant that changes the replicated layer as
much as the sharded one is invisible to sharded-vs-replicated parity):
    sharded      only a TP / CP shard runs it (its shard function, its TP or CP group): parity sees it
    stateful     only calls from a carried state or decode steps run it: the continuation check
    trainer      only the trainer around the layer (micro-batches, its reduction): the training step
    everywhere   the replicated layer too: parity is blind, the oracle sees it
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

from bug_record import located as where
from bug_record import plants_checkpoint as C
from bug_record import checks_heads as CH
from bug_record import plants_gate as PG
from bug_record import plants_heads as PH
from bug_record import plants_handoff as H
from bug_record import plants_layer as L
from bug_record import checks_scale as CS
from bug_record import plants_scale as PS
from bug_record import plants_pipeline as P
from bug_record import plants_state as S
from bug_record import checks
from bug_record.checks import CONFIG, MAX_NORM, REPLICATED_CONFIG, state_path
from bug_record.checks_pipeline import record_pipeline_stack
from clients.checkpoint import linattn_checkpoint_io
from clients.isolation import IgnoresPositionIds
from clients.per_token_loss import per_token_loss_step
from clients.quantized_checkpoint import quantized_checkpoint_io
from linattn.layers import LayerState
from pytest_linattn.harness import Placement, TrainingStep
from clients.padded import linattn_padded_path
from clients.spec_decode import linattn_row_spec_path, linattn_spec_path
from clients.state_pool import linattn_pool_path
from bug_record import located_serving as where_serving
from bug_record import plants_serving as SV
from bug_record.checks_serving import BLOCK as SERVING_BLOCK, drafter_spec_path
from clients.spec_decode import linattn_block_spec_path
from clients.state_pool import linattn_block_pool_path, linattn_load_back_path

__all__ = ["BUGS", "Bug", "FIDELITIES", "NOT_YET", "NotYet", "Report", "by_key"]

FIDELITIES = ("faithful", "moved", "partial", "project finding")


@dataclasses.dataclass(frozen=True)
class Report:
    repo: str
    ref: str  # "#7452", "PR #1989", a commit, or "" for a project finding
    url: str

    def __str__(self):
        return f"{self.repo} {self.ref}".strip()


def gh(repo, number, what="issues"):
    return Report(repo, f"#{number}", f"https://github.com/{repo}/{what}/{number}")


def commit(repo, sha):
    return Report(repo, sha, f"https://github.com/{repo}/commit/{sha}")


@dataclasses.dataclass(frozen=True)
class Bug:
    key: str
    row: str  # the note's row number, or "also" for its "Also found" list
    reports: tuple[Report, ...]
    mechanism: str
    bug_class: str
    here: str  # the note's "here?" column as of 2026-12-03
    check: str  # a bug_record.checks.CHECKS key
    plant: Callable | None  # () -> the check's subject; None for a kernel row (its test holds the subject)
    runs: str  # sharded | stateful | trainer | everywhere | kernel
    located: str = ""  # regex over the check's report (caught rows)
    missing: str = ""  # the check not built yet (strict xfail rows)
    suite: str = "cpu"  # where the catch runs: "cpu" (suites/cpu/record), or a kernel row's suite
    kernel_test: str = ""  # a kernel row's catch: "suites/<suite>/<file>.py::<function>"
    gpu_test: str = ""  # a kernel row's check on fla's compiled kernels: "suites/gpu-1/<file>.py::<function>"
    repro: str = ""  # a live bug (the pinned release has it): its standalone repro, a path under suites/live_bugs/
    # the mechanism planted in an engine's own code path around its unchanged kernels (vLLM, sglang):
    # "suites/engines/test_record_on_engines.py::<function>" each, caught there (plants_engines)
    engine_tests: tuple[str, ...] = ()
    fidelity: str = ""  # one of FIDELITIES
    fidelity_note: str = ""  # how (required unless faithful): where it lived and is planted, which part, ...

    @property
    def caught(self) -> bool:
        return not self.missing


def _layer(cls=None, **fields):
    return functools.partial(L.planted_layer, CONFIG, cls, **fields)


def _path(layer_cls=None, **fields):
    def make():
        layer = None if layer_cls is None else L.planted_layer(CONFIG, layer_cls)
        return state_path(layer, **fields)
    return make


def _pool(**fields):
    return functools.partial(linattn_pool_path, CONFIG, **fields)


def _spec(**fields):
    return functools.partial(linattn_spec_path, CONFIG, **fields)


def _row_spec(**fields):
    return functools.partial(linattn_row_spec_path, CONFIG, checks.SPEC_MIXED_DRAFTS, **fields)


def _block_pool(**fields):
    return functools.partial(linattn_block_pool_path, CONFIG, SERVING_BLOCK, **fields)


def _load_back(**fields):
    return functools.partial(linattn_load_back_path, CONFIG, **fields)


def _padded(**fields):
    return functools.partial(linattn_padded_path, CONFIG, **fields)


def _training(cls=None, layer_fields=None, **step):
    def make():
        return (L.planted_layer(CONFIG, cls, **(layer_fields or {})), TrainingStep(steps=2, max_norm=MAX_NORM, **step))
    return make

ENGINES = "suites/engines/test_record_on_engines.py::"


def _cls(cls):
    return lambda: cls


def _handoff(plant):
    from clients.state_handoff import linattn_handoff_path

    return lambda: linattn_handoff_path(REPLICATED_CONFIG, plant)


def checks_captured_path():
    from clients.state_pool import linattn_captured_pool_path

    return linattn_captured_pool_path(CONFIG)


BUGS = (
    Bug("megatron-7452", "1", (gh("NVIDIA/Megatron-LM", 7452),),
        "GDN's out_norm is replicated over TP; its gradient, a per-rank partial sum, is all-reduced only when "
        "sequence parallel is on", "gradient reduction (TP)", "Yes", "tp-parity", _layer(L.NormGradUnreducedWithoutSP),
        "sharded", located=r"grad norm\.weight: TP-replicated parameter, but TP ranks 0 and 1 hold different gradients",
        fidelity="faithful"),
    Bug("transformers-tp-plan-grad-allreduce", "2",
        (Report("huggingface/transformers", "TP plan replicated_with_grad_allreduce (project finding)",
                "https://github.com/huggingface/transformers/blob/main/src/transformers/integrations/tensor_parallel.py"),
         gh("NVIDIA-NeMo/RL", 3788), gh("NVIDIA-NeMo/RL", 3716), gh("ROCm/TransformerEngine", 715)),
        "a replicated weight's gradient is all-reduced after every micro-batch's backward, so under accumulation "
        "the earlier micro-batches are counted again", "gradient reduction (trainer)", "Yes", "training-tp",
        _training(L.NormGradUnreducedWithoutSP, dict(after_backward=L.all_reduce_replicated_grads)), "trainer",
        located=r"step 1/2 \(2 micro-batches\) grad: 1 of 9 tensor\(s\) off.*\n.*\n\s+" + where.parity_row("norm.weight", r"index \(\d\)"),
        fidelity="project finding", fidelity_note=("no upstream report: found in transformers' TP plan "
            "(replicated_with_grad_allreduce in integrations/tensor_parallel.py); NeMo-RL #3788 / #3716 and ROCm "
            "TransformerEngine #715 are reports of the same class elsewhere")),
    Bug("transformers-45513", "3", (gh("huggingface/transformers", 45513), gh("fla-org/flash-linear-attention", 351)),
        "a multi-token cached forward called the chunk kernel with initial_state=None, restarting from zero",
        "state carry", "Yes", "continuation", _path(prefill=S.prefill_restarting_multi_token_chunks), "stateful",
        located=where.first_wrong_in_prefill(lambda size, offset: 0 if size > 1 else None),
        fidelity="faithful"),
    Bug("vllm-51483", "4", (gh("vllm-project/vllm", 51483), gh("vllm-project/vllm", 51562),
                            gh("vllm-project/vllm", 51565), gh("vllm-project/vllm", 57573)),
        "a stateless 1-token first chunk was classified as a decode and read a reused, unzeroed state page",
        "state carry / kernel selection", "Yes", "continuation",
        _path(prefill=S.prefill_reading_a_stale_state_for_1_token_chunks), "stateful",
        located=where.first_wrong_in_prefill(lambda size, offset: 0 if size == 1 else None),
        engine_tests=(f"{ENGINES}test_vllm_51483_first_chunk_of_1_token_run_as_a_decode",),
        fidelity="faithful", fidelity_note=("the reused, unzeroed state page stands as the neighbouring row's state; "
            "also planted in vLLM 0.33.0's metadata builder (the 1-token row routed to the decode kernels, reading the "
            "page a previous sequence left) around its own kernels")),
    Bug("fla-conv-dht-column-0", "5",
        (Report("fla-org/flash-linear-attention", "causal_conv1d backward (project finding)",
                "https://github.com/fla-org/flash-linear-attention/tree/main/fla/modules"),),
        "a project finding, not a report of fla's: the final conv state's column 0 passes no gradient back, so dx "
        "at each call's token T-(W-1) of a sequence misses the part the next call reads: linattn's state is the "
        "last W-1 tokens and its next call (a chunk or decode step) convolves column 0. In fla, where the state is "
        "W wide, its column 0 (token T-W) is read by neither the forward (causal_conv1d/ops.py:129, fla 0.6.0) nor "
        "the update kernel (:404), so the backward's mask of tokens before T-(W-1) is right there",
        "state carry (gradient)", "Yes", "continuation",
        _path(prefill=S.prefill_dropping_the_oldest_conv_column_gradient,
              decode=S.decode_dropping_the_oldest_conv_column_gradient), "stateful",
        # the forward and the recurrent state are right: the first failing check is dx, and of the initial
        # state's gradient only the conv state's is off
        located=(r"continuation parity failed for record/tp2/seed44: 3 failing check\(s\)\n(?:  sequence [^\n]*\n)+\n"
                 r"parity failed for record/tp2/seed44 dx tp_rank0: [\s\S]*?"
                 + re.escape(f"parity failed for record/tp2/seed44 dh0 (gradient of the initial state): 1 of "
                             f"{len(LayerState._fields)} tensor(s) off") + r"[^\n]*\n[^\n]*\n\s+conv\s[^\n]*"),
        fidelity="project finding", fidelity_note=("no upstream report: found reading fla's causal_conv1d backward; "
            "planted in linattn's state path, where the state's column 0 is read")),
    Bug("megatron-pr-1989", "6", (gh("NVIDIA/Megatron-LM", 1989, "pull"), gh("tenstorrent/tt-forge-models", 798),
                                  gh("NVIDIA-NeMo/Megatron-Bridge", 1690), gh("NVIDIA-NeMo/Megatron-Bridge", 629)),
        "the packed in_proj [Q_all|K_all|V_all|...] is split evenly by a column-parallel linear, so rank 0 gets "
        "Q|K|part of V instead of its heads of each", "TP sharding", "Check", "tp-parity",
        _layer(shard=functools.partial(L.shard_fused_in_proj_evenly, CONFIG)), "sharded",
        located=where.shard_note_of_even_split(),
        fidelity="faithful"),
    Bug("tp-beyond-key-heads", "9", (gh("vllm-project/vllm", 13660), gh("sgl-project/sglang", 20967),
                                     gh("radixark/miles", 972), gh("alibaba/ROLL", 497)),
        "with TP > key heads the key heads are replicated and the norm / gate shards become fractional or unsliced",
        "TP > key heads (GQA/GVA replication)", "No", "tp-replicated",
        functools.partial(L.planted_layer, REPLICATED_CONFIG, None,
                          shard=functools.partial(L.shard_gate_unsliced_beyond_key_heads, REPLICATED_CONFIG)),
        "sharded", located=where.parity_row("record/tp4/seed44 output tp_rank0", where.TOKEN) + r"[\s\S]*?"
                           + where.parity_row("in_proj_z.weight", r"value head \d+, channel \d+, col \d+ \(TP rank [13]\)"),
        fidelity="moved", fidelity_note=("miles #972 was Megatron's full-attention output gate (a crash in view()); "
            "planted as a silent wrong-rows slice of GDN's in_proj_z at TP 4 over 2 key heads")),
    Bug("slime-1686", "10", (gh("THUDM/slime", 1686), gh("radixark/miles", 648)),
        "cu_seqlens reached the short conv but not chunk_gated_delta_rule, so the recurrence ran through the "
        "packed samples", "packed boundaries", "Check", "oracle", _cls(L.DeltaRuleWithoutBoundaries), "everywhere",
        located=where.parity_row("qwen3_5-gva2 output", r"seq [1-9]\d* token \d+ \(global \d+\)"),
        fidelity="faithful"),
    Bug("miles-2213", "12", (gh("radixark/miles", 2213),),
        "packing metadata kept across calls: the next micro-batch reused stale cu_seqlens", 
        "packed boundaries / stale metadata across calls", "Partly", "training-tp",
        _training(L.MetadataCachedByTokenCount), "trainer",
        # step 1: the first micro-batch right, the next one of its token count (another packing) wrong
        located=where.loss_by_micro_batch_of_stale_packing(),
        fidelity="partial", fidelity_note=("the stale-mailbox half: packing metadata kept across micro-batches; the "
            "main bug (the packing patch never applied to dense qwen3_5) is not planted")),
    Bug("model-level-packing", "13", (gh("hiyouga/LlamaFactory", 10787), gh("huggingface/transformers", 46851),
                                      gh("modelscope/ms-swift", 9565), gh("verl-project/verl", 6660),
                                      gh("pytorch/torchtitan", 3892)),
        "the GDN layer never gets the boundaries: the decoder passes position_ids it does not turn into cu_seqlens",
        "model-level packing plumbing", "No", "isolation", lambda: IgnoresPositionIds, "everywhere",
        located=r"perturbing document \d+ token \d+ \(global \d+\): document \d+'s outputs changed from its "
                r"token \d+ \(global \d+\) on",
        fidelity="moved", fidelity_note=("the reports' decoders (transformers, LlamaFactory, ms-swift, verl, "
            "torchtitan) moved into the toy DecoderStack (suites/clients/isolation.py)")),
    Bug("accelerate-4177", "14", (gh("huggingface/accelerate", 4177), gh("hiyouga/LlamaFactory", 10727)),
        "Ulysses CP wrapped only attention, so GDN ran on local shards and every rank restarted the state at zero",
        "CP (state not passed)", "Check", "cp-parity", _layer(L.StateNotPassedOverCP), "sharded",
        # rank 0's outputs right; rank 1's wrong from its first token, where the state restarts
        located=where.first_wrong_per_rank("record/cp2-contiguous/seed44", "none", where.at_token(checks.CU[-1] // 2)),
        fidelity="partial", fidelity_note=("the recurrent state not passed over CP; the conv halo still crosses "
            "(upstream the conv ran on local shards too)")),
    Bug("prime-rl-3002", "15", (gh("PrimeIntellect-ai/prime-rl", 3002), gh("PrimeIntellect-ai/prime-rl", 3003),
                                gh("verl-project/verl", 6038)),
        "Ulysses CP built fla's CP context from a made-up [0, global_len], so state leaked across packed documents",
        "CP layout + packed", "Check", "cp-parity", _layer(L.ContextFromWholeBatch), "sharded",
        # the batch ran as one sequence: wrong from the first packed boundary on
        located=(r"the packing was lost: the ranks' outputs are the replicated layer's on the batch as one sequence "
                 rf"\(cu_seqlens \[0, {checks.CU[-1]}\][\s\S]*?"
                 + where.first_wrong_per_rank("record/cp2-contiguous/seed44", where.at_token(checks.CU[1]))),
        fidelity="faithful"),
    Bug("fla-774", "18", (gh("fla-org/flash-linear-attention", 774, "pull"),),
        "the CP conv backward did not mask the initial state's gradient: the forward fills only the last "
        "min(W-1, pre_num_conv_tokens) positions of a rank's first-sequence initial state with the previous "
        "rank's tokens (zeros before), but the backward sent all W-1 positions' gradient back to that rank's "
        "last W-1 tokens, so where the sequence started fewer than W-1 tokens before the piece the zeros' "
        "gradient leaked into unrelated sequences; the same PR bounds the backward kernel's dy reads for a local "
        "sequence shorter than W (out-of-bounds reads, NaN in dw)",
        "CP halo", "No", "cp-short", _layer(L.HaloGradientUnmasked), "sharded",
        # the forward is right: the first failing check is dx (the output's comes before it), wrong only at the
        # token the leak reaches, sequence 0's on CP rank 0 (rank 1's sequence started 1 token before it)
        located=where.halo_gradient_leak(),
        fidelity="partial", fidelity_note=("the unmasked halo gradient of fla's _correct_dx_for_cp, moved into "
            "linattn's halo exchange; the backward kernel's out-of-bounds dy read (NaN in dw) is fla's Triton code, "
            "not planted")),
    Bug("fla-955", "19", (gh("fla-org/flash-linear-attention", 955, "pull"),),
        "causal_conv1d with cu_seqlens and B > 1 rows: the backward sizes its weight-gradient buffer B*NT rows, "
        "its varlen branch writes NT of them and dweight sums all (y, dx right)", "gradient (kernel, batch shape)",
        "No", "kernel", None, "kernel", suite="fla-interpret",
        kernel_test="suites/fla-interpret/test_conv_backward_record.py::test_varlen_batch_of_two_rows_dweight",
        gpu_test="suites/gpu-1/test_bug_record_gpu1.py::test_varlen_batch_of_two_rows_dweight",
        repro="suites/live_bugs/fla_955_causal_conv1d_varlen_batch.py",
        fidelity="faithful", fidelity_note=("fla's own kernel, the pinned release (under Triton's interpreter, and "
            "on a GPU): no plant, a live bug")),
    Bug("vllm-38517", "N22", (gh("vllm-project/vllm", 38517, "pull"), gh("vllm-project/vllm", 38197)),
        "MergedColumnParallelLinear.weight_loader_v2 with a tuple shard_id hard-coded shard_id=0 for "
        "PerTensorScaleParameter: only the first of a fused weight's per-section scale slots is filled, every "
        "section after it dequantized with the initial value (FP8 static checkpoints of Qwen3.5's in_proj_qkvz)",
        "TP (quant scales)", "No", "checkpoint-fp8",
        lambda: quantized_checkpoint_io(CONFIG, fill_slots=C.fill_first_scale_slot_only), "sharded",
        located=C.all_lines(C.unfilled_scale_lines(CONFIG, 1, 0)),
        fidelity="moved", fidelity_note=("vLLM's loader of Qwen3.5's fused in_proj_qkvz with compressed-tensors FP8 "
            "static scales; planted in the project's FP8-style client's fill of in_proj_qkv's 3 scale slots "
            "(suites/clients/quantized_checkpoint.py)")),
    Bug("modelopt-931", "N23", (gh("NVIDIA/Model-Optimizer", 931, "pull"),),
        "an export at TP > 1 maps the mixer's SSM parameters (norm, A_log, D, dt_bias, conv1d) as REPLICATE "
        "instead of column-TP, so the exporter keeps TP rank 0's shard as the whole parameter",
        "TP (export)", "No", "checkpoint",
        lambda: linattn_checkpoint_io(CONFIG, merge=C.merge_mapping_ssm_parameters_as_replicated), "sharded",
        located=C.all_lines(C.exported_as_replicated_lines(CONFIG, 2)),
        fidelity="moved", fidelity_note=("Nemotron-H's Mamba mixer mapping in ModelOpt's Megatron exporter; planted "
            "in the project's checkpoint exporter (suites/clients/checkpoint.py) on GDN's A_log, dt_bias and "
            "conv1d (GDN has no D; its norm is rightly replicated)")),
    Bug("megatron-3282", "N24", (gh("NVIDIA/Megatron-LM", 3282, "pull"),),
        "chunkwise GDN CP on THD: the framework gives each packed sequence its own chunks per rank, while fla's "
        "build_cp_context assumes rank r owns [r*part_len, (r+1)*part_len) of the flattened stream; the two agree "
        "for one sequence only", "CP layout convention", "No", "cp-zigzag", _layer(L.ContextOfTheFlattenedStream),
        "sharded", located=where.first_wrong_of_a_flat_context(),
        fidelity="partial", fidelity_note=("the framework's per-sequence chunks are zigzag here (2 * cp chunks of "
            "every sequence, as Megatron's THD CP splits), against a context of the flattened stream built in "
            "linattn's layer (its own CP context stands for fla's)")),
    Bug("transformers-47842", "N30", (gh("huggingface/transformers", 47842, "pull"), gh("huggingface/transformers", 47831)),
        "GDN's A initialised with uniform_(0, 16) in bf16 rounds some draws to exactly 0; log(0) = -inf gives heads "
        "with no decay and no gradient", "other (init precision)", "No", "fresh-init", _cls(L.DecayRateDrawnFromZero),
        "everywhere",
        # only bf16 draws land on 0: float32's never do at these seeds
        located=r"fresh initialisation for record: \d+ of \d+ parameter\(s\) built not finite[^\n]*\n"
                r"  torch\.bfloat16, seed \d+: A_log head \d+ is -inf",
        fidelity="faithful", fidelity_note=("planted in linattn's layer init (its own draws A from [1, 16], never "
            "0: the clean run passes)")),
    Bug("flashqla-28-padded-tail", "N31", (gh("QwenLM/FlashQLA", 28),),
        "fla's varlen chunk kernels leave the outputs and gradients after cu_seqlens[-1] unwritten: a packed batch "
        "padded past its last boundary gets garbage in the padding tail", "padded THD", "No", "kernel", None, "kernel",
        suite="fla-interpret",
        kernel_test="suites/fla-interpret/test_padded_tail_gradients.py::test_padded_tail_outputs_and_gradients_are_zeros",
        repro="suites/live_bugs/fla_varlen_padded_tail_unwritten.py",
        fidelity="faithful", fidelity_note=("fla 0.6.0's own chunk_gated_delta_rule, live (part 1 of the report; its "
            "part 2, the fused backward's gate-gradient cancellation, is entry flashqla-28-gate-gradients)")),
    Bug("fla-1080", "N26", (gh("fla-org/flash-linear-attention", 1080),),
        "fla's chunk kernels computed their block-pointer offsets in int32: past B*T*H*K = 2**31 elements (524,288 "
        "tokens of Qwen3.5-4B per forward) loads and stores wrap, and the outputs are silently wrong (NaN counts "
        "understate the wrong elements 4.7x; run-to-run determinism checks pass on the corrupted output)",
        "kernel (overflow)", "No", "delta-rule-at-scale",
        _cls(PS.gated_delta_rule_reading_v_through_wrapped_offsets), "everywhere",
        located=PS.located(CS.DELTA_RULE_SHAPE["name"], CS.DELTA_RULE_SHAPE["v_heads"], CS.DELTA_RULE_SHAPE["head_v_dim"]),
        fidelity="moved", fidelity_note=("the wrapped offsets lived in fla's Triton chunk kernels (fixed before fla "
            "0.6.0: its chunk_gated_delta_rule and chunk_kda forwards at 528,384 tokens, 2**31 + 2**24 elements, "
            "and both ops forward and backward at 264,192 tokens, their chunk states h and dh at 2**31 + 2**24, "
            "passed against float64 in pieces on an H100, 2026-12-06, suites/scale); planted in the test tree "
            "(suites/bug_record/plants_scale.py) as linattn's GDN op reading v through offsets kept modulo 2**17, "
            "so the at-scale check catches it on 3,000 tokens on a CPU, located at the first wrapped token")),
    Bug("fla-906", "N28", (gh("fla-org/flash-linear-attention", 906), gh("fla-org/flash-linear-attention", 907, "pull")),
        "RWKV-7's gate_output_correction kernels masked a chunk's tokens by comparing their absolute index with the "
        "chunk size: every chunk after the first 65,536 tokens was skipped, forward and backward (outputs diverge "
        "from the reference past 65,536 tokens)", "kernel (long sequence)", "No", "rows-at-scale",
        _cls(PS.gate_output_correction_skipping_tail_chunks), "everywhere", located=PS.located_tail_chunk(CS.ROWS_LABEL),
        fidelity="moved", fidelity_note=("the mask lived in fla's Triton kernels for RWKV-7's output correction "
            "(fla/ops/rwkv7/gate_output_correction.py, fixed by fla PR #907 before 0.6.0: its kernels at 131,172 "
            "tokens passed against float64 on an H100, 2026-12-06, suites/scale); planted in the test tree "
            "(suites/bug_record/plants_scale.py) as the op in chunks of 256 tokens whose tail chunks are never "
            "written, so the row check catches it on 785 tokens on a CPU, located at the first skipped token")),
    Bug("flashqla-28-gate-gradients", "N32", (gh("QwenLM/FlashQLA", 28, "pull"),),
        "the fused GDN backward forms each chunk's gate gradient as the row sum of (dA*A) - (dA*A)^T over the gated "
        "pair products, the transposed copy stored through bf16 shared memory: the diagonal's O(1) terms (decay "
        "exp(0) = 1) no longer cancel, and under strong Qwen decay (exp(A_log) up to 16, gate input + dt_bias "
        "about 1: log decay down to -45 a token), where a fast head's true gate gradient is tiny, the rounding "
        "residue is all that is left; A_log's and dt_bias's gradients, its sums over the head's tokens (times "
        "|g_t| for A_log), come out O(1) off while the forward matches", "other (training precision)", "No",
        "gate-gradients", _cls(PG.gated_delta_rule_with_a_bf16_transposed_gate_gradient), "everywhere",
        located=PG.located(),
        gpu_test="suites/gpu-1/test_gate_gradients_gpu1.py::test_gate_gradients_at_strong_decay",
        fidelity="moved", fidelity_note=("the cancellation lived in FlashQLA's fused TileLang backward "
            "(flash_qla/ops/gated_delta_rule/chunk/*/fused_bwd.py: sum((dA*A) - (dA*A)^T) with the transpose "
            "through bf16 shared memory; fixed by moving the float32 bits through as two 16-bit halves); planted in "
            "the test tree (suites/bug_record/plants_gate.py) as linattn's float32 chunked GDN whose intra-chunk "
            "decay exp(G_i - G_j) has a backward of that form, bf16 inputs at the bf16 bound. fla never runs an "
            "in-kernel gate on FlashQLA: the GPU test checks fla's own Triton backward at the same decay, and runs "
            "the plant on CUDA tensors")),
    Bug("fla-871-1138", "21", (gh("fla-org/flash-linear-attention", 871),
                               gh("fla-org/flash-linear-attention", 1138), gh("ggml-org/llama.cpp", 18761)),
        "the conv backward read dy with hard-coded contiguous strides: wrong dx / dh0 for a non-contiguous dy",
        "kernel layout (strides)", "No", "kernel", None, "kernel", suite="fla-interpret",
        kernel_test="suites/fla-interpret/test_conv_backward_record.py::test_strided_dy_into_the_varlen_conv_backward",
        gpu_test="suites/gpu-1/test_bug_record_gpu1.py::test_strided_dy_into_the_varlen_conv_backward",
        fidelity="partial", fidelity_note=("#871's dy read with contiguous strides (fixed in fla 0.6.0), planted on "
            "fla's conv output in the test; the dy is strided with cu_seqlens and an initial state, so #1138's dh0 "
            "kernel runs (fla's fix passes, the plant's dy reaches it: dh0 caught), but #1138's own mechanism (y "
            "addressed with dy's strides) is not planted")),
    Bug("fla-826", "N29", (gh("fla-org/flash-linear-attention", 826, "pull"),
                           gh("fla-org/flash-linear-attention", 640)),
        "Hopper + Triton >= 3.4 miscompiles `tl.trans` of a wgmma-layout tensor in chunk_bwd_kernel_dqkwg: the "
        "gated delta rule's db and dg wrong, the forward right", "kernel (toolchain)", "No", "kernel", None,
        "kernel", suite="fla-interpret",
        kernel_test="suites/fla-interpret/test_gdn_backward_record.py::test_dqkwg_losing_the_transpose_is_caught",
        fidelity="partial", fidelity_note=("the miscompile's effect, not the compiler's bug: dk's product with the "
            "transpose of b_ds lost, in a copy of fla 0.6.0's chunk_o module made at test time and run under "
            "Triton's interpreter on a CPU (fla 0.6.0 refuses this backward on Hopper with Triton in [3.4.0, 3.7.1), "
            "the only GPUs and Triton lent here); caught with dk and dg wrong, the forward right (the report names db "
            "and dg: which transpose miscompiled is not in the thread). The check is the op's gradients against the "
            "float64 reference, which catches the compiled kernel's error the same way where it runs")),
    Bug("transformers-46741", "22", (gh("huggingface/transformers", 46741),),
        "Mamba2 mixers took the 1-token decode branch for any cached forward: one recurrent step on token 0",
        "kernel selection / state carry", "Partly", "continuation", _path(prefill=S.prefill_through_the_decode_step),
        "stateful", located=where.first_wrong_in_prefill(lambda size, offset: 1 if size > 1 else None),
        fidelity="faithful"),
    Bug("vllm-23279", "23", (gh("vllm-project/vllm", 23279, "pull"),),
        "varlen chunked prefill: a sequence starting mid-chunk took its initial state's decay from the chunk start",
        "state carry (chunk/sequence alignment)", "Check", "continuation",
        _path(prefill=S.prefill_decaying_from_the_chunk_start), "stateful",
        # a sequence whose chunk starts off the client's chunk grid in its packed call
        located=where.first_wrong_in_prefill(lambda size, offset: 0 if offset % S.CLIENT_CHUNK else None),
        fidelity="faithful", fidelity_note=("approximated by a wrapper that pre-scales the initial state by the "
            "decay from the chunk start, not vLLM's chunked kernel")),
    Bug("vllm-56196", "26", (gh("vllm-project/vllm", 56196),),
        "with prefix caching a chunk shorter than W-1 wrote its conv state into the shared prefix block it read "
        "from; its own block was never written", "state pool (conv)", "No", "state-pool-prefix",
        _pool(prefill=S.prefill_writing_a_short_chunk_into_the_prefix_block), "stateful", located=where.PREFIX_BLOCK_WRITTEN,
        engine_tests=(f"{ENGINES}test_vllm_56196_short_chunk_writes_the_prefix_block",),
        fidelity="faithful", fidelity_note=("in the project's client (suites/clients/state_pool.py), and in vLLM "
            "0.33.0's align-mode prefix copies around its own kernels (the short chunk's conv run in the prefix "
            "block)")),
    Bug("vllm-37728-padded-slots", "27", (gh("vllm-project/vllm", 37728), gh("vllm-project/vllm", 49757),
                                          gh("vllm-project/vllm", 55178), gh("NVIDIA/TensorRT-LLM", 13151),
                                          gh("vllm-project/vllm", 23035, "pull"),
                                          gh("lightseekorg/tokenspeed", 700, "pull"),
                                          gh("noonghunna/club-3090", 896), gh("sgl-project/sglang", 30974),
                                          gh("sgl-project/sglang", 24955)),
        "CUDA-graph padded rows or DP dummy runs write state through a padding slot equal to a live slot (0)",
        "CUDA graph / decode state pool", "No", "state-pool", _pool(decode=S.decode_writing_padding_rows_through_slot_0),
        "stateful", located=where.POOL_SLOT_0,
        engine_tests=(f"{ENGINES}test_vllm_37728_padding_rows_from_stale_state_indices",
                      f"{ENGINES}test_sglang_padding_rows_clamped_to_live_slot_0"),
        fidelity="faithful", fidelity_note=("in the project's client (suites/clients/state_pool.py); and around the "
            "engines' own kernels: vLLM 0.33.0's CUDA-graph state indices without the padding rows' NULL_BLOCK_ID "
            "fill (stale rows), sglang 0.5.23's PAD_SLOT_ID clamped to 0 (tokenspeed #700)")),
    Bug("sglang-31474", "28", (gh("sgl-project/sglang", 31474),),
        "the KDA backend never wrote mamba track snapshots, so prefix hits restored garbage state",
        "state carry (prefix cache)", "No", "state-pool-prefix", _pool(prefill=S.prefill_without_track_snapshots),
        "stateful", located=where.SNAPSHOT_WRONG,
        fidelity="faithful", fidelity_note=("in the project's client (suites/clients/state_pool.py), not sglang's "
            "code")),
    Bug("llama-cpp-20700", "N18", (gh("ggml-org/llama.cpp", 20700),),
        "Qwen3.5 MTP: the recurrent-state copy_cell used an element count where ggml_view_1d wanted bytes: a partial "
        "state copy", "state pool (copy size)", "No", "state-pool-prefix",
        _pool(prefill=S.prefill_copying_snapshots_by_element_count), "stateful", located=where.SNAPSHOT_PARTIAL,
        fidelity="moved", fidelity_note=("llama.cpp's cell copy between sequences (its MTP draft checkpoints); "
            "planted in the project's client's snapshot copy (suites/clients/state_pool.py's prefix mode), each "
            "field's first numel / element_size elements copied")),
    Bug("vllm-43090", "N15", (gh("vllm-project/vllm", 43090),),
        "the attention group hits the prefix cache, the Mamba group misses; the coordinator keeps one scalar "
        "num_computed_tokens > 0, so has_initial_states is true and the Mamba layer recurs from an empty state "
        "(granite-4.0-tiny, cached vs uncached logits)", "state pool (prefix cache)", "No", "state-pool-prefix",
        _pool(prefill=S.prefill_hit_from_an_empty_state), "stateful", located=where.hit_from_an_empty_state(),
        fidelity="faithful", fidelity_note=("in the project's client (suites/clients/state_pool.py), not vLLM's "
            "KV-cache coordinator: the hit's state is never restored")),
    Bug("vllm-51113", "N11", (gh("vllm-project/vllm", 51113, "pull"),),
        "align-mode prefill chunks were not kept block-aligned past last_cache_position, so a state is published "
        "under a block boundary it does not represent (wrong tokens with HTTP 200)", "state pool (prefix cache)",
        "No", "state-pool-inner",
        _pool(prefill=S.prefill_publishing_the_chunk_end_under_its_last_boundary, inner_snapshots=True), "stateful",
        located=where.inner_snapshot_misplaced(),
        fidelity="faithful", fidelity_note=("in the project's client (suites/clients/state_pool.py), not vLLM's "
            "scheduler: a chunk that does not end on a boundary writes its chunk-end state into its last inner "
            "snapshot; the boundaries before it stay right")),
    Bug("sglang-30938", "N14", (gh("sgl-project/sglang", 30938, "pull"), gh("vllm-project/vllm", 41060, "pull")),
        "snapshot cadence against chunk size: sglang skips the track write when a chunk is shorter than "
        "mamba_cache_chunk_size (a warning only); vLLM's RWKV-7 scatter returns when mamba_block_size < the chunk "
        "size, leaving stale blocks for later hits", "state pool (prefix cache)", "No", "state-pool-inner",
        _pool(prefill=S.prefill_skipping_inner_snapshots_of_short_chunks, inner_snapshots=True), "stateful",
        located=where.inner_snapshot_stale(),
        fidelity="faithful", fidelity_note=("sglang's mechanism in the project's client (suites/clients/"
            "state_pool.py): the inner snapshots of a chunk shorter than the cadence (8 tokens) left unwritten; "
            "vLLM #41060's RWKV-7 scatter is the same observable, not planted apart")),
    Bug("sglang-32555", "N12", (gh("sgl-project/sglang", 32555, "pull"),),
        "decode track-save under CUDA graphs: the replay refills the static track-destination buffer at the front "
        "([:bs]) but the backend slices [-num_decodes:], so the captured kernel writes through the never-refreshed "
        "tail", "state pool (CUDA graph)", "No", "state-pool-captured",
        lambda: dataclasses.replace(checks_captured_path(), capture=S.capture_refilling_the_front_reading_the_tail),
        "stateful", located=where.captured_destination_tail(),
        fidelity="moved", fidelity_note=("sglang's track-save destination (the prefix cache's snapshot slots) in "
            "Nemotron's decode; planted as the destination of the decode's own state write in the project's "
            "captured runner (suites/clients/state_pool.py)"),
        gpu_test="suites/gpu-1/test_captured_decode_gpu1.py::test_the_front_refill_read_at_the_tail_is_caught_on_the_graph"),
    Bug("spec-decode-verify", "29", (gh("sgl-project/sglang", 27658), gh("sgl-project/sglang", 40419),
                                     gh("vllm-project/vllm-ascend", 12255), gh("NVIDIA/TensorRT-LLM", 13782)),
        "spec-decode verify keeps the state advanced by rejected drafts", "MTP / spec decode", "No",
        "spec-decode", _spec(accept=S.accept_keeping_rejected_drafts), "stateful", located=where.SPEC_STATE,
        engine_tests=(f"{ENGINES}test_sglang_27658_verify_keeps_the_rejected_drafts",
                      f"{ENGINES}test_vllm_spec_rows_keep_the_rejected_drafts"),
        fidelity="faithful", fidelity_note=("in the project's client (suites/clients/spec_decode.py); and around the "
            "engines' own kernels: sglang 0.5.23's accept after target_verify taking the buffers' last step, vLLM "
            "0.33.0's next step handed num_accepted_tokens = 1 + K")),
    Bug("vllm-55208", "N1", (gh("vllm-project/vllm", 55208), gh("vllm-project/vllm", 37638),
                             gh("vllm-project/vllm", 37635, "pull")),
        "heterogeneous prefill / decode TP in disaggregated serving: the conv state ([x|B|C] in Mamba2, [q|k|v] in "
        "GDN) moved with a flat split of its channels, so a decode rank's slice crosses the sections",
        "TP (state resharding)", "No", "state-handoff", _handoff(H.handoff_splitting_conv_flat), "stateful",
        located=where.handed_off(H.handoff_splitting_conv_flat, Placement(), Placement(tp=2), 0),
        fidelity="moved", fidelity_note=("Mamba2's conv state (Falcon-H1) in vLLM's NIXL transfer; planted in the "
            "project's handoff client of linattn's GDN layer (suites/clients/state_handoff.py)")),
    Bug("sglang-23746", "N2", (gh("sgl-project/sglang", 23746), gh("sgl-project/sglang", 23744, "pull")),
        "TP 1 prefill to TP 4 decode: dst_heads_per_rank = 2 // 4 = 0, so every decode rank maps to key head 0 "
        "(part b, the GDN conv state [K, K, V] sliced across group boundaries, is vllm-55208's flat split)",
        "TP (state resharding) + key heads", "No", "state-handoff", _handoff(H.handoff_with_heads_per_rank_floored),
        "stateful", located=where.handed_off(H.handoff_with_heads_per_rank_floored, Placement(), Placement(tp=4),
                                        REPLICATED_CONFIG.key_head_replicas(4)),
        fidelity="partial", fidelity_note=("part (a), the heads per rank floored to 0, in the project's handoff "
            "client; part (b) is vllm-55208's plant")),
    Bug("sglang-22060", "N3", (gh("sgl-project/sglang", 22060),),
        "the conv state [layers, size+1, conv_dim/tp, W-1] holds 3 segments; the transfer merged the prefill "
        "ranks' shards in one shot instead of per segment (prefill attn_tp 8 to decode attn_tp 1)",
        "TP (state resharding)", "No", "state-handoff-merge", _handoff(H.handoff_merging_conv_in_one_shot), "stateful",
        located=where.handed_off(H.handoff_merging_conv_in_one_shot, Placement(tp=2), Placement(), 0),
        fidelity="faithful", fidelity_note=("in the project's handoff client (suites/clients/state_handoff.py), TP 2 "
            "to TP 1, not sglang's transfer code")),
    Bug("prismml-llama-cpp-174", "N4", (gh("PrismML-Eng/llama.cpp", 174),),
        "the draft context was built with n_rs_seq = 0 (no recurrent-state checkpoints), so its llama_memory_seq_rm() "
        "of the rejected draft positions silently failed and the drafter kept stale positions into the next round "
        "(every drafter type)", "MTP / spec decode", "No", "spec-decode-drafter",
        functools.partial(drafter_spec_path, rollback=SV.rollback_of_a_context_without_checkpoints), "stateful",
        located=where_serving.drafter_kept_the_rejected_drafts(),
        fidelity="moved", fidelity_note=("llama.cpp's draft context (its recurrent memory built with n_rs_seq = 0, "
            "the failed removal unchecked by the speculative-decoding loop); planted in the project's drafter client "
            "(suites/clients/spec_drafter.py): a draft context that keeps no checkpoint, its rollback's removal "
            "failing wherever a draft was rejected; the report's second part, DRAFT_SIMPLE missing from "
            "need_n_rs_seq(), is the same observable and not planted apart")),
    Bug("vllm-56531", "N5", (gh("vllm-project/vllm", 56531, "pull"), gh("vllm-project/vllm", 40875),
                             gh("vllm-project/vllm", 55504, "pull"), gh("vllm-project/vllm", 39273)),
        "in a batch mixing speculative rows with rows that drafted nothing, the undrafted rows took the non-spec "
        "decode path, which keeps one slot per request (block_table[:, 0]), and read column 0: the state before "
        "the previous step's accepted tokens, not column num_accepted_tokens - 1", "MTP / spec decode", "No",
        "spec-decode-mixed", _row_spec(verify=S.row_verify_reading_column_0_for_undrafted_rows), "stateful",
        located=where.undrafted_after_accepting(),
        engine_tests=(f"{ENGINES}test_vllm_56531_undrafted_rows_on_the_non_spec_path",),
        fidelity="faithful", fidelity_note=("in the project's row client (suites/clients/spec_decode.py), and in "
            "vLLM 0.33.0's glue around its own kernels (the undrafted rows split off to causal_conv1d_update and "
            "fused_sigmoid_gating_delta_rule_update on block_table[:, 0], as before the fix)")),
    Bug("vllm-50272", "N9", (gh("vllm-project/vllm", 50272, "pull"), gh("vllm-project/vllm", 44296, "pull")),
        "LFM2's short_conv under any speculative method: the conv state sized W-1 with no room for the drafts and "
        "num_accepted_tokens never passed to its metadata builder, so the conv window keeps the rejected drafts",
        "MTP / spec decode", "No", "spec-decode-mixed", _row_spec(verify=S.row_verify_keeping_one_conv_window),
        "stateful", located=where.conv_window_of_rejected_drafts(),
        fidelity="moved", fidelity_note=("LFM2's short_conv (a conv-only mixer) in vLLM; planted in the GDN row "
            "client's conv state (suites/clients/spec_decode.py), whose recurrent state keeps its per-token columns")),
    Bug("sglang-38975", "30", (gh("sgl-project/sglang", 38975), gh("vllm-project/vllm", 53877),
                               gh("vllm-project/tpu-inference", 2408)),
        "GDN packed decode rounds sigmoid(beta) through bf16; the error enters the state every token",
        "dtype (state precision)", "No", "continuation", _path(S.DecodeBetaThroughBF16), "stateful",
        # beta enters the recurrence only: the conv state stays right
        located=where.first_wrong_in_decode() + r"[\s\S]*?" + where.final_state_off("recurrent"),
        fidelity="faithful"),
    Bug("trt-model-connect-725", "31", (gh("NVIDIA/TensorRT-Model-Connect", 725, "pull"), gh("ollama/ollama", 15865),
                                        gh("intel/llm-scaler", 559), gh("vllm-project/vllm", 39032),
                                        gh("vllm-project/vllm", 13466)),
        "the persistent DeltaNet state is written back in the storage dtype (bf16) every token",
        "dtype (state storage)", "No", "long-decode", _path(S.DecodeStoringStateInBF16), "stateful",
        located=(r"state dtype: decode step 1 returned field recurrent in torch\.bfloat16, below the contract "
                 r"torch\.float32[\s\S]*?error growth: state field recurrent first exceeds the bound at decode step "
                 r"\d+: error \S+ > \S+"),
        fidelity="faithful"),
    Bug("padding-in-state", "32", (gh("huggingface/transformers", 47086), gh("huggingface/transformers", 48256),
                                   gh("AI-Hypercomputer/maxtext", 5295, "pull")),
        "padding leaks into the conv / recurrent state on continued forwards", "padding masks in the state path",
        "No", "padded", _padded(forward=S.forward_ignoring_the_mask_when_continued), "stateful",
        located=where.PADDED_STATE,
        fidelity="faithful", fidelity_note=("in the project's client (suites/clients/padded.py), not transformers' "
            "or maxtext's code")),
    Bug("megatron-4495", "33", (gh("NVIDIA/Megatron-LM", 4495), gh("verl-project/verl", 6559),
                                gh("modelscope/mcore-bridge", 162), gh("NVIDIA-NeMo/Automodel", 3544),
                                gh("NVIDIA-NeMo/Megatron-Bridge", 4489), gh("NVIDIA/Megatron-LM", 5243)),
        "THD + CP: local chunks indexed with the unpadded cu_seqlens_q instead of cu_seqlens_q_padded",
        "padded THD under CP", "No", "cp-padded", _layer(L.UnpaddedOffsets), "sharded",
        # the first sequence whose padded start differs runs on from the pads before it (rank 0 holds its token 0)
        located=where.first_wrong_per_rank("record/cp2-zigzag-padded/seed44",
                                     where.at_token(checks.CU[where.first_padded_sequence()])),
        fidelity="moved", fidelity_note=("#4495 is the MTP roll's unpadded offsets (verl #6559 the GDN case); "
            "planted in linattn's CP context of GDN's ops")),
    Bug("megatron-098d7d97", "also", (commit("NVIDIA/Megatron-LM", "098d7d97"), gh("ISEEKYAN/Megatron-LM", 111, "pull"),
                                      gh("modelscope/mcore-bridge", 16)),
        "a wrong THD partition in contiguous CP: local boundaries cu_seqlens // cp", "CP layout + packed",
        "also found", "cp-parity", _layer(L.LocalBoundariesDividedByCP), "sharded",
        # no note first (the batch did not run as one sequence: prime-rl #3002's), then rank 0 wrong from the
        # first true boundary the division drops
        located=(r"\Aparity failed for case record/cp2-contiguous/seed44: [\s\S]*?"
                 + where.first_wrong_per_rank("record/cp2-contiguous/seed44", where.at_token(where.first_boundary_lost_by_division()))),
        fidelity="faithful", fidelity_note=("to ISEEKYAN/Megatron-LM #111's account; the commit itself is unverified")),
    Bug("megatron-d749b6c7", "also", (commit("NVIDIA/Megatron-LM", "d749b6c7"),),
        "a hard-coded 4096-token conv pad: the tokens of a longer CP piece past it are convolved from zeros",
        "CP halo / conv", "also found", "cp-parity", _layer(L.ConvPaddedToFixedLength), "sharded",
        # rank 0 right up to the pad length, wrong from it (rank 1 from its first token: its halo is rank 0's
        # zeroed tail)
        located=where.first_wrong_per_rank("record/cp2-contiguous/seed44", where.at_token(L.HARD_CODED_CONV_TOKENS)),
        fidelity="faithful", fidelity_note=("the 4096-token pad scaled to 12 tokens; the commit itself is unverified")),
    Bug("verl-6609", "also", (gh("verl-project/verl", 6609), gh("NVIDIA/Megatron-LM", 3959)),
        "grad_norm blows up at CP > 1: Megatron-Bridge forces calculate_per_token_loss under CP, where megatron-core "
        "expects the loss function to return (loss_sum, num_tokens, metrics) and finalize_model_grads divides by "
        "the all-reduced num_tokens; verl's loss function returned the 2-tuple (loss, metrics), so no count "
        "arrived and the division was skipped: the MoE aux / z-loss gradients, which only Megatron normalises, "
        "came out ~num_tokens too large (verl normalised its policy loss itself)",
        "gradient reduction (trainer)", "also found", "training-cp",
        _training(loss=functools.partial(per_token_loss_step, L.loss_without_token_count)), "trainer",
        # x32: each micro-batch's 32 tokens, the count the division never got
        located=where.loss_without_token_count(),
        fidelity="partial", fidelity_note=("the division by the token count skipped (verl's 2-tuple), in a trainer "
            "on megatron-core's contract (suites/clients/per_token_loss.py), moved from finalize_model_grads into "
            "its loss step; the aux / z-loss terms it hit upstream are not there")),
    Bug("sglang-19411", "also", (gh("sgl-project/sglang", 19411), gh("sgl-project/sglang", 14811)),
        "Qwen3.5 at TP >= 2: its decoder layers did not pass is_last_layer to LayerCommunicator, so every layer, "
        "the last too, skipped its MLP all-reduce for the next layer's fused all-reduce + residual add + RMSNorm; "
        "no layer follows the last, and the final norm added its un-reduced partial sum to the reduced residual "
        "(repetitive output; TP 1 right)",
        "collective (TP)", "also found", "tp-stack", _cls(L.DecoderLayersWithoutIsLastLayer), "sharded",
        # only the last layer is off: the hidden state after layer 1 (reduced by layer 2's input norm) is right
        located=(r"decoder stack of 2 layers at TP 2: off: the hidden state after layer 2 of 2, the output; right: "
                 r"the hidden state after layer 1 of 2\n[\s\S]*?"
                 + where.parity_row("record/stack/output/tp2/seed44 output tp_rank0", where.TOKEN)),
        fidelity="faithful", fidelity_note=("in the project's decoder-stack client (suites/clients/tp_decoder.py), "
            "not sglang's code")),
    Bug("sglang-38622", "also", (gh("sgl-project/sglang", 38622),),
        "the decode conv update reads the first W-1 columns of a wider conv state", "state carry (conv)",
        "also found", "continuation", _path(decode=S.decode_reading_the_first_columns_of_a_wider_state), "stateful",
        # the conv update reads the wrong columns: the conv state goes wrong with the outputs
        located=where.first_wrong_in_decode() + r"[\s\S]*?" + where.final_state_off("conv", count=2),
        fidelity="partial", fidelity_note=("the read of the first W-1 columns of a wider conv state (synthesised W "
            "wide); the ignored cache_seqlens half is not planted")),
    Bug("sparkinfer-1071", "also", (gh("gittensor-ai-lab/sparkinfer", 1071, "pull"), gh("lablup/mlxcel", 1749)),
        "prefill past a chunk limit (a piece at position > 0) restarted from zero state", "state carry",
        "also found", "continuation", _path(prefill=S.prefill_restarting_past_a_chunk_limit), "stateful",
        # the token at the limit: the piece after it restarts
        located=where.first_wrong_in_prefill(lambda size, offset: S.PREFILL_LIMIT if size > S.PREFILL_LIMIT else None),
        fidelity="faithful", fidelity_note=("the client's prefill limit (2048) scaled to 6 tokens")),
    Bug("veomni-1085", "also", (gh("ByteDance-Seed/VeOmni", 1085),),
        "warm-up collectives issued on the first forward and not in the non-reentrant checkpoint's replay: the "
        "replay's collectives differ from the forward's", "activation recompute under CP", "No", "recompute",
        lambda: L.warm_up_layer(CONFIG), "sharded",
        located=r"the replay issued other collectives than the checkpointed forward \(\d+ in the forward, \d+ in "
                r"the replay\); at collective \d+ the forward issued c10d\.allgather_ at [\w/.]+:\d+ "
                r"\(forward_with_warm_up\)",
        fidelity="faithful", fidelity_note=("every rank skips the warm-up alike, so no number changes: only the "
            "collective-trace rule of the recompute check sees it")),
    Bug("automodel-3247", "also", (gh("NVIDIA-NeMo/Automodel", 3247),),
        "state mutated in the forward (a router's balancing bias) is read again by the checkpoint's replay, so "
        "the backward computes on other values than the forward", "activation recompute", "No", "recompute",
        lambda: L.balance_bias_layer(CONFIG), "sharded",
        located=where.replay_on_moved_state(),
        fidelity="moved", fidelity_note=("a MoE router's balancing bias, mutated in forward, becomes an input bias "
            "buffer of the GDN layer")),
    Bug("vllm-backport-63", "N19", (gh("wtdcode/vllm-backport", 63, "pull"),),
        "PP + MTP + prefix caching: under async PP a non-last rank post-processes pp_size steps late with a stale "
        "batch-to-row map and copies GDN state through blocks owned by other requests (14-33% of requests collapse "
        "into a constant-token loop)", "other (PP) + state pool", "No", "pp-decode",
        lambda: record_pipeline_stack(P.StageWithAStaleRowMap), "stateful", located=where.stale_row_map(),
        fidelity="partial", fidelity_note=("the stale batch-to-row map on a non-last stage, in the project's pipeline "
            "stack client (suites/clients/pipeline_stack.py): off the last stage each decode step runs on the map the "
            "step before left, so once a sequence has finished a row reads and writes the slot of the sequence that "
            "held it; the MTP drafts and the prefix-cache block copies around it are not planted")),
    Bug("sglang-39699", "also", (gh("sgl-project/sglang", 39699, "pull"), gh("sgl-project/sglang", 38866)),
        "hybrid cache pools keep global model-layer IDs, but HiCache load-back and the forward's waits use "
        "stage-local IDs: on a non-first pipeline stage the transfer maps match none of its layers, the "
        "host-to-device restores are skipped and the forward reads stale state", "other (PP) + state pool", "No",
        "pp-decode", lambda: record_pipeline_stack(P.StageLookingUpCachesByStageIndex), "stateful",
        located=where.caches_looked_up_by_stage_index(),
        fidelity="moved", fidelity_note=("sglang's HiCache load-back transfer maps (host-to-device restores of a "
            "hybrid stack's cached state), keyed by stage-local IDs against pools of global layer IDs; planted in the "
            "project's pipeline stack client's decode (suites/clients/pipeline_stack.py): its cache lookup by "
            "stage-local index against caches kept under global layer indices, so stage 1 reads entries never written "
            "on that stage and decodes from empty state")),
    Bug("sglang-36722", "N20", (gh("sgl-project/sglang", 36722, "pull"),),
        "a proposed change of the fused GDN decode kernels' key-head index from i_hv // (HV / H) to i_hv % H for "
        "HV = 2H models (Qwen3.5-35B-A3B: 16 key heads, 32 value heads), on the claim that Qwen3.5's weights pair "
        "value heads tiled; transformers' modules and fla's kernels pair them grouped, so decode steps would pair "
        "half the value heads with the wrong key head while prefill (the chunk kernels) stays grouped; closed "
        "unmerged", "key heads (pairing convention)", "No", "head-pairing",
        _path(PH.DecodeIndexingKeyHeadsModuloH), "stateful",
        # prefill right: the first failing check is the decode step's pairing, each rank's heads paired tiled
        located=CH.decode_indexing_modulo_h(),
        fidelity="moved", fidelity_note=("the proposed index in sglang's fused decode kernels (fused_recurrent.py: "
            "decode, packed decode, update); planted in linattn's decode step, whose recurrence then pairs each TP "
            "rank's value heads i % H of its own key heads, as those kernels see the rank's H and HV")),
    Bug("llama-cpp-21732", "N21", (gh("ggml-org/llama.cpp", 21732, "pull"), gh("ggml-org/llama.cpp", 21703)),
        "the tensor-parallel split assumed Qwen3-Next broadcasts K across V as Qwen3.5 does: Qwen3.5's GGUF pairs "
        "value heads tiled (its conversion reorders them; V split on the scale of K), Qwen3-Next's grouped, so "
        "Qwen3-Next's weights and caches split the tiled way paired half of its value heads with the wrong key "
        "head (text still plausible; perplexity 4.32 -> 7.48)", "key heads (pairing convention)", "No",
        "head-pairing-next", lambda: PH.path_split_as_the_other_pairing(CH.NEXT_CONFIG), "sharded",
        located=CH.split_as_the_other_pairing(),
        fidelity="faithful", fidelity_note=("in the project's shard client (linattn's shard_state_dict and "
            "shard_layer_state of the tiled pairing applied to a grouped Qwen3-Next layer, its weights and state), "
            "not llama.cpp's split of GGUF tensors")),
    Bug("deepspeed-8316", "N33", (gh("deepspeedai/DeepSpeed", 8316, "pull"), gh("deepspeedai/DeepSpeed", 8291)),
        "Ulysses' uneven-head all-to-all read a process-wide KV-head count that AutoTP writes at every injection "
        "(and the first uneven all-to-all memoised), so a model was split by another component's count: 12 heads "
        "on sp = 4 as [4, 4, 4, 0] instead of [3, 3, 3, 3]", "process-wide state", "No", "shared-process",
        _cls(PH.KeyHeadCountSharedByTheProcess), "sharded",
        # the layer built first reads the count the second one wrote; each is right alone
        located=CH.process_wide_head_count(),
        fidelity="moved", fidelity_note=("DeepSpeed's sequence-parallel all-to-all (deepspeed/sequence/layer.py) "
            "reading the head count AutoTP writes; planted as a module-level key-head count linattn's GDN layer "
            "writes at every build and reads in its forward to lay out q and k heads "
            "(suites/bug_record/plants_heads.py): two layers of different key-head layouts in one process")),
    Bug("vllm-53505", "N7", (gh("vllm-project/vllm", 53505),),
        "align-mode Mamba with speculative decoding: when a round's accepted tokens land exactly on a block boundary, "
        "the fused postprocess computes a destination block before its source (dest_block_idx < src_block_idx) and "
        "copies the pre-move state back over the one the preprocess had just migrated forward; every later token "
        "decodes from the state before the round (a normal prefix, then per-token degeneration)",
        "MTP / spec decode + state pool", "No", "spec-decode-blocks",
        functools.partial(linattn_block_spec_path, CONFIG, accept=SV.accept_copying_back_on_a_landed_boundary),
        "stateful", located=where_serving.copied_back_on_a_landed_boundary(),
        fidelity="moved", fidelity_note=("the root cause as a commenter on the thread located it in vLLM's "
            "postprocess_mamba_fused_kernel (vllm/v1/worker/mamba_utils.py), where the running state and the "
            "boundary's block are one block of the block table; planted in the project's spec client's accept "
            "(suites/clients/spec_decode.py's block_accept), whose running slot and block are two slots, both left "
            "holding the state the round started from; the KV connector of the report's title is not planted")),
    Bug("vllm-53912", "N8", (gh("vllm-project/vllm", 53912), gh("vllm-project/vllm", 43559),
                             gh("vllm-project/vllm", 47861, "pull"), gh("vllm-project/vllm", 43650, "pull")),
        "MTP + prefix caching: the attention groups drop the final, partially accepted block of a hit, the Mamba / "
        "GDN groups do not, so the hit lengths differ across groups and the recurrent state is restored from a "
        "block past where the engine resumes (over-reused: tokens counted twice)",
        "MTP / spec decode + state pool", "No", "state-pool-blocks",
        _block_pool(prefill=SV.prefill_restoring_the_group_hit), "stateful",
        located=where_serving.restored_the_group_hit(),
        fidelity="moved", fidelity_note=("vLLM's KV-cache coordinator (a hit length per layer group); planted in the "
            "project's block-table client (suites/clients/state_pool.py), whose prefill restores the last block its "
            "group cached instead of the block where the engine resumes; the check's schedule resumes at the "
            "attention group's shorter hit, as the engine does")),
    Bug("vllm-55601", "N10", (gh("vllm-project/vllm", 55601, "pull"), gh("vllm-project/vllm", 55600)),
        "the running Mamba state slot seeded with (num_computed_tokens - 1) // cache_config.block_size after "
        "block_size was reassigned to the smallest prefix-cacheable group's (a 64-token drafter) instead of "
        "mamba_block_size: short hits silently restore the wrong state, long hits fault",
        "state pool (prefix cache)", "No", "state-pool-blocks",
        _block_pool(prefill=SV.prefill_seeding_from_the_drafter_block_size), "stateful",
        located=where_serving.seeded_from_the_drafter_block(),
        fidelity="faithful", fidelity_note=("in the project's block-table client (suites/clients/state_pool.py), "
            "block sizes scaled to a drafter's 2 against the Mamba group's 4; a column past the table (a fault in "
            "vLLM) restores nothing here: the hit runs from its slot's stale state")),
    Bug("sglang-23075", "N16", (gh("sgl-project/sglang", 23075, "pull"), gh("sgl-project/sglang", 22876, "pull")),
        "--enable-mixed-chunk with the extra_buffer Mamba strategy: query_start_loc and mamba_cache_indices carry "
        "the decode rows mixed into the prefill call, and the tracking helpers that write the prefill rows' conv / "
        "SSM snapshots to the radix cache read them as the prefill rows' (GSM8K 93.8% to 87.6% at 16-way "
        "concurrency)", "state pool (prefix cache)", "No", "state-pool-mixed",
        _pool(prefill=SV.prefill_tracking_snapshots_through_the_decode_rows, mixed_calls=True), "stateful",
        located=where_serving.snapshot_of_a_decode_row(),
        fidelity="moved", fidelity_note=("sglang's mixed-batch metadata for its tracking helpers; planted in the "
            "project's client's snapshot write (suites/clients/state_pool.py): each prefill row's snapshot taken "
            "from the row as many places on as the call has decode rows, a decode row's state; the PR names the "
            "pollution, not its index arithmetic")),
    Bug("sglang-30986", "N13", (gh("sgl-project/sglang", 30986, "pull"),),
        "a HiCache load-back allocates the copy-on-write Mamba slot and publishes it on req.mamba_pool_idx before "
        "it knows the load proceeds; when the load aborts (memory quota, eviction) nothing unwinds it and the "
        "request decodes from a slot whose host-to-device copy never ran: uninitialised memory or the previous "
        "occupant's state", "state pool (abort path)", "No", "state-pool-admissions",
        _load_back(admit=SV.admit_publishing_before_the_load), "stateful",
        located=where_serving.rejected_load_read_as_loaded(),
        fidelity="partial", fidelity_note=("the publication before the load, never unwound, in the project's "
            "load-back client's admission (suites/clients/state_pool.py); a rejected load is rolled back to a run "
            "from the sequence's first token; the slot-leak half of the report is not planted")),
    Bug("lmcache-2863", "N17", (gh("LMCache/LMCache", 2863), gh("LMCache/LMCache", 2879, "pull")),
        "an external KV connector stores the attention KV only but reports the full prefix as cached; the scheduler "
        "skips those tokens for every layer type, so the Mamba / GDN layers start from a never-populated block "
        "(about 40% garbled on Qwen3.5-4B)", "state pool (prefix cache)", "No", "state-pool-admissions",
        _load_back(admit=SV.admit_reporting_hits_it_never_restored), "stateful",
        located=where_serving.hit_never_restored(),
        fidelity="moved", fidelity_note=("LMCache's connector and vLLM's scheduler; planted in the project's "
            "load-back client's admission (suites/clients/state_pool.py) standing for a connector: the hit "
            "published as loaded, nothing restored into its slot, so it resumes from the slot's previous "
            "occupant; the observable is vllm-43090's")),
)


@dataclasses.dataclass(frozen=True)
class NotYet:
    """A report of the record's second half not planted yet: what it needs."""

    row: str
    reports: tuple[Report, ...]
    mechanism: str
    needs: str


# the record's second half (2026-12 search) not planted yet, each with the check or the machine it needs
NOT_YET = (
    NotYet("N6", (gh("vllm-project/vllm", 55504, "pull"),), "ROCm AITER's non-spec decode ignored the accepted-token "
           "offset after a spec step", "nothing more: the same observable as vllm-56531, whose entry lists it"),
    NotYet("N25", (gh("state-spaces/mamba", 1015),), "int32 pointer arithmetic in the SSD kernels past ~61K tokens",
           "not an fla family: a client of mamba-ssm's SSD kernels (not installed here) under the at-scale row "
           "check (harness.scale.assert_rows_match takes any op's tensors), on a GPU past 61K tokens"),
    NotYet("N27", (gh("fla-org/flash-linear-attention", 913),), "Blackwell: NaN gradients and out-of-bounds reads",
           "a Blackwell GPU"),
)


def by_key() -> dict[str, Bug]:
    return {b.key: b for b in BUGS}
