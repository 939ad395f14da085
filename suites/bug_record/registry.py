"""The bug record: the public reports (2025-2026) of bugs in sharded or stateful linear-attention
and SSM layers, grouped by mechanism (docs/bugs.md is the table made from a run), one `Bug` each:
its upstream report(s), its mechanism in one sentence, its class, the check that must catch it,
the plant (`plants_layer`, `plants_state`) and where the plant runs.

Adding a bug is one entry here and one plant. `caught`: the check must fail on the plant with a
report matching `located` (a line naming the tensor and the sequence, token, head, call or rank
where it is off); otherwise `missing` names the check not built yet, and the closest check runs
on the plant as a strict xfail (when the missing check is built, it turns into XPASS).

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

from bug_record import plants_layer as L
from bug_record import plants_state as S
from bug_record.checks import CONFIG, MAX_NORM, REPLICATED_CONFIG, state_path
from clients.isolation import IgnoresPositionIds
from pytest_linattn.harness import TrainingStep
from clients.padded import linattn_padded_path
from clients.spec_decode import linattn_spec_path
from clients.state_pool import linattn_pool_path

__all__ = ["BUGS", "Bug", "Report", "by_key"]


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
    plant: Callable  # () -> the check's subject
    runs: str  # sharded | stateful | trainer | everywhere
    located: str = ""  # regex over the check's report (caught rows)
    missing: str = ""  # the check not built yet (strict xfail rows)
    suite: str = "cpu"  # "gpu-1": a kernel bug only fla's GPU kernels have; the CPU row is its xfail
    gpu_test: str = ""  # the GPU suite's test that catches it (suites/<suite>/test_bug_record_gpu1.py)

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


def _padded(**fields):
    return functools.partial(linattn_padded_path, CONFIG, **fields)


def _training(cls=None, layer_fields=None, **step):
    def make():
        return (L.planted_layer(CONFIG, cls, **(layer_fields or {})), TrainingStep(steps=2, max_norm=MAX_NORM, **step))
    return make

FIRST_BACKWARD = (r"first call whose backward is wrong [^:]*: sequence \d+ \(chunks [\d+]+(, then \d decode steps)?\), "
                  r"(chunk|decode step) \d of \d \([^)]*\)(, token \d+)?")


def _cls(cls):
    return lambda: cls


def parity_row(name, where):
    """A failing tensor's row in an assert_parity table: its name, error, rtol, max|diff| and the
    worst element's location (`where`, a regex)."""
    return re.escape(name) + r"\s+\S+\s+\S+\s+\S+\s+" + where


TOKEN = r"seq \d+ token \d+ \(global \d+\)"
FIRST_WRONG = r"first wrong token: sequence \d+ \(chunks [\d+]+(, then \d decode steps)?\), "
POOL_CALL = r"call \d+ \((decode|prefill) of sequences \[[\d, ]+\] in slots \[[\d, ]+\][^)]*\)"
# a padding row's write to live slot 0 (the call, the slot, its sequence), then the first token it spoils
POOL_SLOT_0 = (POOL_CALL + r" changed live slot 0 \(sequence \d+, [^)]*\), which it did not schedule: field \w+"
               r"[\s\S]*?first wrong token: sequence \d+ \([^)]*\) token \d+, " + POOL_CALL + r", its slot 0")
PREFIX_CALL = (r"call \d+ \(prefill of sequences \[[\d, ]+\] in slots \[[\d, ]+\](, snapshots to slots \[[-\d, ]+\])?"
               r"(, from prefix slots \[[-\d, ]+\])?\)")
# a prefix hit's call writing the block it read from
PREFIX_BLOCK_WRITTEN = (PREFIX_CALL + r" changed prefix block slot \d+ \(the snapshot of sequence \d+ at token \d+\), "
                        r"which it read from: field conv, max \|change\| \S+ \(rank \d\)")
# a snapshot slot left as it was: not the state at its block boundary
SNAPSHOT_WRONG = (PREFIX_CALL + r": the snapshot of sequence \d+ \([^)]*\) at token \d+ in slot \d+ is not the state "
                  r"there: field \w+ error \S+")
# a verify call's slot left holding a state past its accepted drafts
SPEC_STATE = (r"call \d+ \(verify round \d+: 3 drafts each of sequences \[[\d, ]+\] in slots \[[\d, ]+\], accepted "
              r"\[[\d, ]+\]\): slot \d+, sequence \d+ \([^)]*\), state after token \d+, [012] of 3 drafts accepted: "
              r"field \w+ error \S+")
# a row whose pads straddle into a continued call: its state after that call is off, then its first token
PADDED_STATE = (r"call [12] \(prefill of columns \d+\.\.\d+, pads per row \[[\d, ]+\]\): row \d \(a \d-token prompt\), "
                r"state before its first token \(zeros\): field \w+ error \S+")

BUGS = (
    Bug("megatron-7452", "1", (gh("NVIDIA/Megatron-LM", 7452),),
        "GDN's out_norm is replicated over TP; its gradient, a per-rank partial sum, is all-reduced only when "
        "sequence parallel is on", "gradient reduction (TP)", "Yes", "tp-parity", _layer(L.NormGradUnreducedWithoutSP),
        "sharded", located=r"grad norm\.weight: TP-replicated parameter, but TP ranks 0 and 1 hold different gradients"),
    Bug("transformers-tp-plan-grad-allreduce", "2",
        (Report("huggingface/transformers", "TP plan replicated_with_grad_allreduce (project finding)",
                "https://github.com/huggingface/transformers/blob/main/src/transformers/integrations/tensor_parallel.py"),
         gh("NVIDIA-NeMo/RL", 3788), gh("NVIDIA-NeMo/RL", 3716), gh("ROCm/TransformerEngine", 715)),
        "a replicated weight's gradient is all-reduced after every micro-batch's backward, so under accumulation "
        "the earlier micro-batches are counted again", "gradient reduction (trainer)", "Yes", "training-tp",
        _training(L.NormGradUnreducedWithoutSP, dict(after_backward=L.all_reduce_replicated_grads)), "trainer",
        located=r"step 1/2 \(2 micro-batches\) grad: 1 of 9 tensor\(s\) off.*\n.*\n\s+" + parity_row("norm.weight", r"index \(\d\)")),
    Bug("transformers-45513", "3", (gh("huggingface/transformers", 45513),),
        "a multi-token cached forward called the chunk kernel with initial_state=None, restarting from zero",
        "state carry", "Yes", "continuation", _path(prefill=S.prefill_restarting_multi_token_chunks), "stateful",
        located=FIRST_WRONG + r"chunk 1 of \d \(tokens 0\.\.\d+, a \d+-token chunk from the initial state\), token 0"),
    Bug("vllm-51483", "4", (gh("vllm-project/vllm", 51483), gh("vllm-project/vllm", 51562),
                            gh("vllm-project/vllm", 51565)),
        "a stateless 1-token first chunk was classified as a decode and read a reused, unzeroed state page",
        "state carry / kernel selection", "Yes", "continuation",
        _path(prefill=S.prefill_reading_a_stale_state_for_1_token_chunks), "stateful",
        located=FIRST_WRONG + r"chunk 1 of \d \(tokens 0\.\.0, a 1-token chunk from the initial state\), token 0"),
    Bug("fla-conv-dht-column-0", "5",
        (Report("fla-org/flash-linear-attention", "causal_conv1d backward (project finding)",
                "https://github.com/fla-org/flash-linear-attention/tree/main/fla/modules"),),
        "the conv backward masks tokens before T-(W-1), so the final conv state's column 0 passes no gradient "
        "back to dx", "state carry (gradient)", "Yes", "continuation",
        _path(prefill=S.prefill_dropping_the_oldest_conv_column_gradient,
              decode=S.decode_dropping_the_oldest_conv_column_gradient), "stateful",
        located=parity_row("record/tp2/seed44 dx tp_rank0", TOKEN) + r".*\n" + FIRST_BACKWARD),
    Bug("megatron-pr-1989", "6", (gh("NVIDIA/Megatron-LM", 1989, "pull"),),
        "the packed in_proj [Q_all|K_all|V_all|...] is split evenly by a column-parallel linear, so rank 0 gets "
        "Q|K|part of V instead of its heads of each", "TP sharding", "Check", "tp-parity",
        _layer(shard=functools.partial(L.shard_fused_in_proj_evenly, CONFIG)), "sharded",
        located=parity_row("record/tp2/seed44 output tp_rank0", TOKEN)),
    Bug("tp-beyond-key-heads", "9", (gh("vllm-project/vllm", 13660), gh("sgl-project/sglang", 20967),
                                     gh("radixark/miles", 972)),
        "with TP > key heads the key heads are replicated and the norm / gate shards become fractional or unsliced",
        "TP > key heads (GQA/GVA replication)", "No", "tp-replicated",
        functools.partial(L.planted_layer, REPLICATED_CONFIG, None,
                          shard=functools.partial(L.shard_gate_unsliced_beyond_key_heads, REPLICATED_CONFIG)),
        "sharded", located=parity_row("record/tp4/seed44 output tp_rank0", TOKEN) + r"[\s\S]*?"
                           + parity_row("in_proj_z.weight", r"value head \d+, channel \d+, col \d+ \(TP rank [13]\)")),
    Bug("slime-1686", "10", (gh("THUDM/slime", 1686),),
        "cu_seqlens reached the short conv but not chunk_gated_delta_rule, so the recurrence ran through the "
        "packed samples", "packed boundaries", "Check", "oracle", _cls(L.DeltaRuleWithoutBoundaries), "everywhere",
        located=parity_row("qwen3_5-gva2 output", r"seq [1-9]\d* token \d+ \(global \d+\)")),
    Bug("miles-2213", "12", (gh("radixark/miles", 2213),),
        "packing metadata kept across calls: the next micro-batch reused stale cu_seqlens", 
        "packed boundaries / stale metadata across calls", "Partly", "training-tp",
        _training(L.MetadataCachedByTokenCount), "trainer",
        located=parity_row("record/tp2/seed44 step 1/2 (2 micro-batches) loss", r"index \(\)")),
    Bug("model-level-packing", "13", (gh("hiyouga/LlamaFactory", 10787), gh("huggingface/transformers", 46851),
                                      gh("modelscope/ms-swift", 9565), gh("verl-project/verl", 6660),
                                      gh("pytorch/torchtitan", 3892)),
        "the GDN layer never gets the boundaries: the decoder passes position_ids it does not turn into cu_seqlens",
        "model-level packing plumbing", "No", "isolation", lambda: IgnoresPositionIds, "everywhere",
        located=r"perturbing document \d+ token \d+ \(global \d+\): document \d+'s outputs changed from its "
                r"token \d+ \(global \d+\) on"),
    Bug("accelerate-4177", "14", (gh("huggingface/accelerate", 4177),),
        "Ulysses CP wrapped only attention, so GDN ran on local shards and every rank restarted the state at zero",
        "CP (state not passed)", "Check", "cp-parity", _layer(L.StateNotPassedOverCP), "sharded",
        located=parity_row("record/cp2-contiguous/seed44 output", TOKEN + " on CP rank 1")),
    Bug("prime-rl-3002", "15", (gh("PrimeIntellect-ai/prime-rl", 3002), gh("PrimeIntellect-ai/prime-rl", 3003)),
        "Ulysses CP built fla's CP context from a made-up [0, global_len], so state leaked across packed documents",
        "CP layout + packed", "Check", "cp-parity", _layer(L.ContextFromWholeBatch), "sharded",
        located=parity_row("record/cp2-contiguous/seed44 output", r"seq [1-9] token \d+ \(global \d+\) on CP rank \d")),
    Bug("fla-774", "18", (gh("fla-org/flash-linear-attention", 774, "pull"),),
        "the CP conv took a rank's halo as if the previous rank held all W-1 tokens; a piece shorter than W-1 "
        "read the wrong tokens", "CP halo", "No", "cp-short", _layer(L.HaloFromPreviousRankOnly), "sharded",
        located=parity_row("record/cp4-contiguous/seed44 output", r"seq 1 token \d+ \(global \d+\) on CP rank [23]")),
    Bug("fla-955", "19", (gh("fla-org/flash-linear-attention", 955, "pull"),),
        "causal_conv1d_bwd with B > 1 corrupts dweight (dx right)", "gradient (kernel, batch shape)", "No",
        "tp-parity", _layer(L.ConvWeightGradFromFirstRow), "sharded", suite="gpu-1",
        gpu_test="test_batch_of_two_rows_through_the_conv_backward",
        missing="the B > 1 kernel check (suites/gpu-1/test_bug_record_gpu1.py: fla's conv on a batch of 2 rows; "
                "the harness packs B = 1)"),
    Bug("fla-871-1138", "21", (gh("fla-org/flash-linear-attention", 871), gh("fla-org/flash-linear-attention", 1138)),
        "the conv backward read dy with hard-coded contiguous strides: wrong dx / dh0 for a non-contiguous dy",
        "kernel layout (strides)", "No", "tp-parity", _layer(L.ConvReadingDyAsContiguous), "sharded", suite="gpu-1",
        gpu_test="test_strided_dy_into_the_conv_backward",
        missing="the strided-dy kernel check (suites/gpu-1/test_bug_record_gpu1.py: a split of a fused gradient "
                "into fla's conv backward; linattn's conv gradients arrive contiguous)"),
    Bug("transformers-46741", "22", (gh("huggingface/transformers", 46741),),
        "Mamba2 mixers took the 1-token decode branch for any cached forward: one recurrent step on token 0",
        "kernel selection / state carry", "Partly", "continuation", _path(prefill=S.prefill_through_the_decode_step),
        "stateful", located=FIRST_WRONG + r"chunk \d of \d \(tokens \d+\.\.\d+, a \d+-token chunk from [^)]*\), "
                                         r"token [1-9]\d*"),
    Bug("vllm-23279", "23", (gh("vllm-project/vllm", 23279, "pull"),),
        "varlen chunked prefill: a sequence starting mid-chunk took its initial state's decay from the chunk start",
        "state carry (chunk/sequence alignment)", "Check", "continuation",
        _path(prefill=S.prefill_decaying_from_the_chunk_start), "stateful",
        located=FIRST_WRONG + r"chunk 1 of \d \(tokens 0\.\.\d+, a \d+-token chunk from the initial state\), token 0"),
    Bug("vllm-56196", "26", (gh("vllm-project/vllm", 56196),),
        "with prefix caching a chunk shorter than W-1 wrote its conv state into the shared prefix block it read "
        "from; its own block was never written", "state pool (conv)", "No", "state-pool-prefix",
        _pool(prefill=S.prefill_writing_a_short_chunk_into_the_prefix_block), "stateful", located=PREFIX_BLOCK_WRITTEN),
    Bug("vllm-37728-padded-slots", "27", (gh("vllm-project/vllm", 37728), gh("vllm-project/vllm", 49757),
                                          gh("vllm-project/vllm", 55178), gh("NVIDIA/TensorRT-LLM", 13151)),
        "CUDA-graph padded rows or DP dummy runs write state through a padding slot equal to a live slot (0)",
        "CUDA graph / decode state pool", "No", "state-pool", _pool(decode=S.decode_writing_padding_rows_through_slot_0),
        "stateful", located=POOL_SLOT_0),
    Bug("sglang-31474", "28", (gh("sgl-project/sglang", 31474),),
        "the KDA backend never wrote mamba track snapshots, so prefix hits restored garbage state",
        "state carry (prefix cache)", "No", "state-pool-prefix", _pool(prefill=S.prefill_without_track_snapshots),
        "stateful", located=SNAPSHOT_WRONG),
    Bug("spec-decode-verify", "29", (gh("sgl-project/sglang", 27658), gh("sgl-project/sglang", 40419),
                                     gh("vllm-project/vllm-ascend", 12255)),
        "spec-decode verify keeps the state advanced by rejected drafts", "MTP / spec decode", "No",
        "spec-decode", _spec(accept=S.accept_keeping_rejected_drafts), "stateful", located=SPEC_STATE),
    Bug("sglang-38975", "30", (gh("sgl-project/sglang", 38975),),
        "GDN packed decode rounds sigmoid(beta) through bf16; the error enters the state every token",
        "dtype (state precision)", "No", "continuation", _path(S.DecodeBetaThroughBF16), "stateful",
        located=FIRST_WRONG + r"decode step 1 of 2 \(token \d+\)"),
    Bug("trt-model-connect-725", "31", (gh("NVIDIA/TensorRT-Model-Connect", 725, "pull"), gh("ollama/ollama", 15865),
                                        gh("intel/llm-scaler", 559)),
        "the persistent DeltaNet state is written back in the storage dtype (bf16) every token",
        "dtype (state storage)", "No", "long-decode", _path(S.DecodeStoringStateInBF16), "stateful",
        located=(r"state dtype: decode step 1 returned field recurrent in torch\.bfloat16, below the contract "
                 r"torch\.float32[\s\S]*?error growth: state field recurrent first exceeds the bound at decode step "
                 r"\d+: error \S+ > \S+")),
    Bug("padding-in-state", "32", (gh("huggingface/transformers", 47086), gh("huggingface/transformers", 48256),
                                   gh("AI-Hypercomputer/maxtext", 5295, "pull")),
        "padding leaks into the conv / recurrent state on continued forwards", "padding masks in the state path",
        "No", "padded", _padded(forward=S.forward_ignoring_the_mask_when_continued), "stateful",
        located=PADDED_STATE),
    Bug("megatron-4495", "33", (gh("NVIDIA/Megatron-LM", 4495), gh("verl-project/verl", 6559),
                                gh("modelscope/mcore-bridge", 162)),
        "THD + CP: local chunks indexed with the unpadded cu_seqlens_q instead of cu_seqlens_q_padded",
        "padded THD under CP", "No", "cp-padded", _layer(L.UnpaddedOffsets), "sharded",
        located=parity_row("record/cp2-zigzag-padded/seed44 output", TOKEN + " on CP rank \\d")),
    Bug("megatron-098d7d97", "also", (commit("NVIDIA/Megatron-LM", "098d7d97"), gh("ISEEKYAN/Megatron-LM", 111, "pull")),
        "a wrong THD partition in contiguous CP: local boundaries cu_seqlens // cp", "CP layout + packed",
        "also found", "cp-parity", _layer(L.LocalBoundariesDividedByCP), "sharded",
        located=parity_row("record/cp2-contiguous/seed44 output", TOKEN + r" on CP rank \d")),
    Bug("megatron-d749b6c7", "also", (commit("NVIDIA/Megatron-LM", "d749b6c7"),),
        "a hard-coded 4096-token conv pad: the tokens of a longer CP piece past it are convolved from zeros",
        "CP halo / conv", "also found", "cp-parity", _layer(L.ConvPaddedToFixedLength), "sharded",
        located=parity_row("record/cp2-contiguous/seed44 output", TOKEN + r" on CP rank \d")),
    Bug("verl-6609", "also", (gh("verl-project/verl", 6609),),
        "grad_norm blows up at CP > 1: the loss normalised per CP rank's tokens", "gradient reduction (trainer)",
        "also found", "training-cp", _training(loss=L.loss_averaged_per_rank), "trainer",
        located=(r"step 1/2 \(2 micro-batches\) grad norm: the reference's is \S+ \(rtol 1e-10\); off on 2 of 2 "
                 r"rank\(s\):\n\s+TP rank 0, CP rank 0: \S+ \(relative error 1\.00e\+00\)")),
    Bug("sglang-19411", "also", (gh("sgl-project/sglang", 19411),),
        "at TP >= 2 the last layer's deferred all-reduce was lost", "collective (TP)", "also found", "tp-parity",
        _layer(L.OutputPartialSumNotReduced), "sharded",
        located=parity_row("record/tp2/seed44 output tp_rank0", TOKEN)),
    Bug("sglang-38622", "also", (gh("sgl-project/sglang", 38622),),
        "the decode conv update reads the first W-1 columns of a wider conv state", "state carry (conv)",
        "also found", "continuation", _path(decode=S.decode_reading_the_first_columns_of_a_wider_state), "stateful",
        located=FIRST_WRONG + r"decode step 1 of 2 \(token \d+\)"),
    Bug("sparkinfer-1071", "also", (gh("gittensor-ai-lab/sparkinfer", 1071, "pull"), gh("lablup/mlxcel", 1749)),
        "prefill past a chunk limit (a piece at position > 0) restarted from zero state", "state carry",
        "also found", "continuation", _path(prefill=S.prefill_restarting_past_a_chunk_limit), "stateful",
        located=FIRST_WRONG + r"chunk \d of \d \(tokens \d+\.\.\d+, a \d+-token chunk from the \w+[^)]*\), token \d+"),
    Bug("veomni-1085", "also", (gh("ByteDance-Seed/VeOmni", 1085),),
        "warm-up collectives issued on the first forward and not in the non-reentrant checkpoint's replay: the "
        "replay's collectives differ from the forward's", "activation recompute under CP", "No", "recompute",
        lambda: L.warm_up_layer(CONFIG), "sharded",
        located=r"the replay issued other collectives than the checkpointed forward \(\d+ in the forward, \d+ in "
                r"the replay\); at collective \d+ the forward issued c10d\.allgather_ at [\w/.]+:\d+ "
                r"\(forward_with_warm_up\)"),
    Bug("automodel-3247", "also", (gh("NVIDIA-NeMo/Automodel", 3247),),
        "state mutated in the forward (a router's balancing bias) is read again by the checkpoint's replay, so "
        "the backward computes on other values than the forward", "activation recompute", "No", "recompute",
        lambda: L.balance_bias_layer(CONFIG), "sharded",
        located=r"\d+ of \d+ tensors are not bitwise equal to the same run without recompute"),
)


def by_key() -> dict[str, Bug]:
    return {b.key: b for b in BUGS}
