"""The live bugs: what a check of the project flags in a pinned release (DESIGN.md, "Real code over
look-alikes"), one `LiveBug` each; docs/live-bugs.md is the page `write_live_bugs_md.py` makes from
a run of their repros.

Each entry names the release (`package==version`, the version this environment pins), the kernel
or layer (file:line in the release), what the project's check reports (one line) and the check
(`found_by`, a test id), the standalone repro (`repro`, a script in this folder, run as
`python <path>`: it prints the versions, what it compares and the error, and exits 0; it
demonstrates, it does not assert), the pattern its output must match for the bug to count as
shown (`shows`; the generator stops where a repro no longer shows it), the verdict the evidence
supports (one of `VERDICTS`, `verdict_why` the evidence) and the upstream report (`upstream`, a
URL, with `upstream_state`: "open" or "none found").

An entry without a repro (`repro=""`) is one whose demonstration needs a GPU: `gpu_evidence` then
names the row of docs/results.md that measured it (a phrase of its result cell), and the page quotes
that row's sentence, date, machine, commit and command; it never claims a repro. An entry with a
repro may name one too: the repro's run on a GPU (compiled kernels), quoted beside the CPU run.
"""

from __future__ import annotations

import dataclasses

VERDICTS = (
    "wrong result on a path callers use",
    "wrong result outside the callers' contract",
    "latent (no caller)",
)
UPSTREAM_STATES = ("open", "none found")


@dataclasses.dataclass(frozen=True)
class LiveBug:
    key: str
    release: str  # "package==version" as pip names the distribution
    where: str  # the kernel or layer: file:line in the release
    finding: str  # what the check reports, one line
    found_by: str  # the project's test that flags it ("suites/<suite>/<file>.py::<function>[...]")
    verdict: str
    verdict_why: str
    upstream: str = ""
    upstream_state: str = "none found"
    repro: str = ""  # "suites/live_bugs/<name>.py"; "" where the demonstration needs a GPU
    shows: str = ""  # a regex the repro's output must match (the bug shown)
    gpu_evidence: str = ""  # a phrase of the docs/results.md row of its GPU run (the repro's, or the test's)
    repro_note: str = ""  # how the repro runs the release's code on a CPU, where it is not plain
    line: str = ""  # a regex picking the output line the table shows; "" = the line where `shows` ends
    timeout: int = 300  # seconds the repro may run


LIVE_BUGS = (
    LiveBug(
        "fla-955", "flash-linear-attention==0.6.0",
        "`causal_conv1d` backward: `fla/modules/causal_conv1d/ops.py:758` (`dw` sized B*NT rows), `:204` "
        "(the varlen branch writes rows `i_tg = i_t` < NT), `:797` (`dw.sum(0)` adds all)",
        "causal_conv1d with cu_seqlens and B = 2 rows: dweight NaN against the float64 reference (y and dx right)",
        "suites/fla-interpret/test_conv_backward_record.py::test_varlen_batch_of_two_rows_dweight",
        "wrong result on a path callers use",
        "the report's author hit it in training (Qwen3.5-style hybrid GDN models under CP with batch size > 1, "
        "grad_norm ~16x too large at step 1); fla's docstring allows x [B, T, D] with cu_seqlens",
        upstream="https://github.com/fla-org/flash-linear-attention/pull/955", upstream_state="open",
        repro="suites/live_bugs/fla_955_causal_conv1d_varlen_batch.py",
        shows=r"x \[2, 24, 32\], uninitialized memory NaN: nan",
        gpu_evidence="The repro: 2 rows with cu_seqlens, dweight 1.00e+00",
        repro_note="fla's kernel under Triton's interpreter on a CPU (compiled on CUDA); on a CPU the unwritten rows "
                   "show with PyTorch's NaN fill of uninitialized memory"),
    LiveBug(
        "transformers-48256", "transformers==5.17.0",
        "`LinearAttentionLayer.update_conv_state` (`transformers/cache_utils.py:1083`: the call's last W conv "
        "columns, pads included); `Qwen3NextGatedDeltaNet.forward` (`models/qwen3_next/modeling_qwen3_next.py:719`, "
        "`:721`: beta and g of the zeroed pads)",
        "right-padded prefill: row 3's conv and recurrent states wrong after its one token in call 0 (errors ~1), "
        "then every row's decode outputs",
        "suites/cpu/library/test_hf_padded_continuation.py::test_right_padded_continuation[qwen3_next]",
        "wrong result outside the callers' contract",
        "generate() asks decoder-only callers for left padding (`generation/utils.py:2679`: \"right-padding was "
        "detected! For correct generation results, please set padding_side='left'\"); left padding is right "
        "(the repro's control, the project's left-padded test passes); the layer takes the right-padded mask and "
        "cache without a refusal",
        upstream="https://github.com/huggingface/transformers/issues/48256", upstream_state="open",
        repro="suites/live_bugs/transformers_48256_right_padded_prefill_cache.py",
        repro_note="transformers' torch path (fla kept from its import)",
        shows=r"decode step's output: relative error [1-9]\.\d+e(\+\d\d|-0[0-2])"),
    LiveBug(
        "transformers-kimi-cu-seqlens", "transformers==5.17.0",
        "`KimiLinearDeltaAttention.forward` (`models/kimi_linear/modeling_kimi_linear.py:694`: its kwargs to "
        "`chunk_kimi_delta_attention` unrenamed); the wrapper keeps fla's parameter names only "
        "(`integrations/hub_kernels.py:884`)",
        "packed documents fed the flash kwargs (cu_seq_lens_q), the conv given the boundaries: \"perturbing document "
        "0 token 4 (global 4): document 1's outputs changed from its token 0 (global 5) on\"",
        "suites/cpu/library/test_hf_document_isolation.py::test_kimi_linear_flash_kwargs_never_reach_chunk_kda",
        "wrong result on a path callers use",
        "padding-free training: DataCollatorWithFlattening(return_flash_attn_kwargs=True) hands the model "
        "cu_seq_lens_q (the project's test_flash_kwargs_feed_is_the_flattening_collators), the decoder layer passes "
        "it to the linear attention (modeling_kimi_linear.py:816), and with fla installed chunk_kda runs the "
        "recurrence across the documents, silently",
        repro="suites/live_bugs/transformers_kimi_linear_cu_seqlens_dropped.py",
        repro_note="a recorder with fla's chunk_kda signature in its place (fla's kernels need a GPU), computing fla's "
                   "contract with transformers' torch KDA",
        shows=r"received cu_seqlens=None[\s\S]*relative error [1-9]\.\d+e(\+\d\d|-0[0-2])"),
    LiveBug(
        "fla-rwkv7-zigzag-backward", "flash-linear-attention==0.6.0",
        "`ChunkDPLRDeltaRuleFunction.backward` (`fla/ops/generalized_delta_rule/dplr/chunk.py:293`: `expand_h0` only "
        "when the saved CP initial state has one row) after zigzag's `compress_h0` (`fla/ops/cp/chunk_delta_h.py:274`: "
        "rows [0, front_num_seqs]); its recompute `chunk_dplr_fwd_h` reads row i for local sequence i "
        "(`dplr/chunk_h_fwd.py:77`), past the 2-row buffer for i >= 2",
        "chunk_rwkv7 at CP 2 in fla's zigzag layout, fla's kernels interpreted, against one rank without CP: outputs "
        "right, dr / dw / da / db NaN, Inf or ~1e5 on both ranks (4 sequence pieces each: the bytes past the buffer), "
        "local sequence 1's dr 0.6 off; with compress_h0 the identity all within 1e-4. On GPUs the RWKV-7 client in "
        "fla's zigzag layout (CP 4; TP 2 x CP 2): dx and 13 to 16 of 26 parameter gradients off, in float32 too "
        "(dx 0.75, x_w 1.81 against 5e-3)",
        "suites/fla-interpret/test_rwkv7_zigzag_cp.py::test_rwkv7_zigzag_cp2_matches_one_rank",
        "latent (no caller)",
        "fla 0.6.0's own RWKV7Attention passes chunk_rwkv7 no CP context; only a client that shards RWKV-7 over "
        "fla's CP (the project's, suites/clients/rwkv7.py, written as a team would) reaches this backward, and only "
        "in the zigzag layout on a rank holding more than two sequence pieces; disable_recompute=True avoids it",
        repro="suites/live_bugs/fla_rwkv7_zigzag_cp_backward.py",
        repro_note="fla's kernels under Triton's interpreter on a CPU, with linattn's interpreter patches (compiled "
                   "on CUDA), 2 ranks over gloo with fla's CP all-gather staged through host memory; the reads past "
                   "the buffer give NaN / Inf here, other tensors' values on a GPU",
        shows=r"rank 0, local cu_seqlens \[0, 5, 9, 16, 32\], front piece 3 sequences: o \d\.\d+e-0[5-9], "
              r"dr (nan|inf|[1-9]\.\d+e(\+\d\d|-0[0-2]))[\s\S]*?backward \[2, 1, 16, 16\]; dr per local sequence: "
              r"0 \d\.\d+e[-+]\d\d, 1 [1-9]\.\d+e-0[1-2][\s\S]*?the full state saved\):\n  rank 0: o "
              r"\d\.\d+e-0[5-9], dr \d\.\d+e-0[5-9]",
        line=r"rank 0, local cu_seqlens",
        gpu_evidence="dr per local sequence on rank 0: 0 0.00e+00, 1 5.95e-01, 2 2.64e-01"),
    LiveBug(
        "fla-fused-recurrent-kda-ssm-state-indices", "flash-linear-attention==0.6.0",
        "public `fused_recurrent_kda` (`fla/ops/kda/fused_recurrent.py:338`): no `ssm_state_indices` parameter, "
        "`**kwargs` (`:356`), calls `fused_recurrent_kda_fwd` (`:470`) without it",
        "the emulation refuses what fla drops: \"public fused_recurrent_kda drops the indices\" (ssm_state_indices "
        "lands in **kwargs, unread)",
        "suites/cpu/library/test_emulation_serving.py::test_refusals_name_the_argument"
        "[public fused_recurrent_kda drops the indices]",
        "wrong result outside the callers' contract",
        "the public entry neither names nor documents ssm_state_indices (its forward, fused_recurrent_kda_fwd, "
        "does); no caller in fla 0.6.0 or transformers 5.17.0 passes it; a caller that does gets slot 0 read and "
        "no slot written, without an error",
        repro="suites/live_bugs/fla_fused_recurrent_kda_drops_ssm_state_indices.py",
        repro_note="fla's kernels under Triton's interpreter on a CPU (compiled on CUDA)",
        shows=r"with the indices vs without them: output 0\.00e\+00[\s\S]*given the same indices: output "
              r"[1-9]\.\d+e(\+\d\d|-0[0-2])",
        line=r"with the indices vs without them"),
    LiveBug(
        "vllm-spec-zero-accepted-previous-row", "vllm==0.33.0",
        "`fused_sigmoid_gating_delta_rule_update`'s kernel "
        "(`vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:106-110`) and "
        "`fused_recurrent_gated_delta_rule`'s (`ops/fused_recurrent.py:107-111`): the first state's slot is "
        "`ssm_state_indices[n * stride_indices_seq + num_accepted_tokens[n] - 1]`",
        "verify call with `[N, 1 + K]` state indices: a row given num_accepted_tokens = 0 starts from the previous "
        "row's last slot (row 0: the int before the tensor), without an error; its output and slots change with "
        "row 0's slots",
        "suites/engines/test_engine_contracts.py::test_a_verify_row_reads_only_its_own_slots"
        "[accepted-1-0-fused_sigmoid_gating]",
        "wrong result outside the callers' contract",
        "vLLM's callers pass >= 1: the runner counts each row's sampled tokens (`v1/worker/gpu_model_runner.py:1566`; "
        "the rejection sampler writes every row's first token, `v1/sample/rejection_sampler.py:821-845`, `:926-966`), "
        "sets 1 for new and unused rows (`gpu_model_runner.py:2086`, `:2095`, `:2100-2101`), and the GDN builder "
        "pads with 1 (`v1/attention/backends/gdn_attn.py:655`) before Qwen3-Next's call "
        "(`model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:1760`) and OLMo-hybrid's "
        "(`olmo_gdn_linear_attn.py:443`); the kernels' docstring (`fused_recurrent.py:578`) states no lower "
        "bound and nothing refuses 0",
        repro="suites/live_bugs/vllm_spec_decode_zero_accepted_reads_previous_row.py",
        repro_note="vLLM's kernel files from the pinned wheel (`clients.engines.loader`) under Triton's interpreter "
                   "on a CPU (compiled on CUDA); the interpreter runs row 0's programs first, on a GPU row 1's load "
                   "races row 0's store",
        shows=r"vs the loop from its first slot 3: output [1-9]\.\d+e(\+\d\d|-0[0-2])[\s\S]*?vs the loop from "
              r"row 0's last state \(slot 2\): output \d\.\d+e-0[6-9], slot 4 \d\.\d+e-0[6-9]",
        line=r"vs the loop from its first slot 3"),
    LiveBug(
        "vllm-flat-indices-multi-token-store", "vllm==0.33.0",
        "`fused_sigmoid_gating_delta_rule_update`'s in-place store "
        "(`vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:157-166`: the state after token t "
        "at slot `ssm_state_indices[n * stride_indices_seq + t]`; `stride_indices_tok`, `:237`, passed at `:271`, "
        "never read) and `fused_recurrent_gated_delta_rule`'s (`ops/fused_recurrent.py:153-162`)",
        "1-D ssm_state_indices (one slot per sequence), sequences of 2 and 1 tokens: sequence 0's slot keeps its "
        "state after token 0, its final state lands in sequence 1's slot, and sequence 1 runs from it",
        "suites/engines/test_engine_contracts.py::test_flat_state_indices_keep_each_sequence_in_its_slot"
        "[tokens-2-1-fused_sigmoid_gating]",
        "wrong result outside the callers' contract",
        "the docstring covers the case (`fused_recurrent.py:576`: the indices \"map the input sequences to the "
        "initial/final states\"), but vLLM's callers pass 1-D indices with one token per sequence only: the GDN "
        "builder's decodes are 1-token rows (`v1/attention/backends/gdn_attn.py:375`, `:410`), longer rows go the "
        "speculative path with `[N, 1 + K]` indices (`qwen_gdn_linear_attn.py:1760`, `olmo_gdn_linear_attn.py:443`) "
        "or the chunked prefill",
        repro="suites/live_bugs/vllm_flat_state_indices_multi_token_store.py",
        repro_note="vLLM's kernel files from the pinned wheel (`clients.engines.loader`) under Triton's interpreter "
                   "on a CPU (compiled on CUDA); the interpreter runs sequence 0's programs first, on a GPU the two "
                   "race on slot 4",
        shows=r"sequence 1 \(1 token, slot 4\): output [1-9]\.\d+e(\+\d\d|-0[0-2]), slot 4 "
              r"[1-9]\.\d+e(\+\d\d|-0[0-2]); as if started from sequence 0's final state: output \d\.\d+e-0[6-9]"),
    LiveBug(
        "vllm-sigmoid-gating-kda-gate-stride", "vllm==0.33.0",
        "`fused_sigmoid_gating_delta_rule_update(is_kda=True)` "
        "(`vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:92`: KDA's gate pointer "
        "`a + (bos * HV + i_hv) * K + o_k`; `:178`: `p_a += HV` after each token)",
        "is_kda=True, one sequence of 3 tokens against linattn's float64 KDA: token 0 right, tokens 1 and 2 off "
        "(errors ~0.5 to 0.7): they read the gate HV values on, not HV * K",
        "suites/engines/test_engine_contracts.py::test_fused_sigmoid_gating_kda_matches_the_float64_kda[tokens-3]",
        "latent (no caller)",
        "no caller in vLLM 0.33.0 passes is_kda=True: Qwen3-Next's layer keeps the default False "
        "(`qwen_gdn_linear_attn.py:1760`, `:1787`, `:1882`), the Triton warm-up passes False "
        "(`model_executor/warmup/qwen_triton_warmup.py:279`), and the KDA models run their own KDA kernels "
        "(`models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py`); with one token per sequence (decode) "
        "the kernel is right, so only a multi-token KDA call (a verify) reaches it",
        repro="suites/live_bugs/vllm_fused_sigmoid_gating_kda_gate_stride.py",
        repro_note="vLLM's kernel files from the pinned wheel (`clients.engines.loader`) under Triton's interpreter "
                   "on a CPU (compiled on CUDA)",
        shows=r"vs the loop \(token t's gate at a\[t\]\): output per token \d\.\d+e-0[6-9], "
              r"[1-9]\.\d+e(\+\d\d|-0[0-2])[\s\S]*?vs the loop given the gate read HV on per token: output per "
              r"token \d\.\d+e-0[6-9], \d\.\d+e-0[6-9], \d\.\d+e-0[6-9]",
        line=r"vs the loop \(token t's gate at a\[t\]\)"),
    LiveBug(
        "vllm-conv-update-slot-minus-1", "vllm==0.33.0",
        "`causal_conv1d_update`'s kernel (`vllm/model_executor/layers/mamba/ops/causal_conv1d.py:698-704`: skips a "
        "row only at slot `== null_block_id`; `:785`: the load mask checks `slot < num_cache_lines`, nothing below "
        "0; `:808-816`: the store, no bound on the slot)",
        "a decode row at slot -1 (sglang's and older vLLM's PAD_SLOT_ID): its output is the conv of the W - 1 "
        "columns before the pool, and its shifted window is stored there, out of bounds, without an error",
        "suites/engines/test_engine_contracts.py::test_conv_update_padding_row_touches_nothing_outside_its_rows"
        "[pad-slot-minus-1]",
        "wrong result outside the callers' contract",
        "vLLM 0.33.0 pads with NULL_BLOCK_ID = 0 (`v1/attention/backends/utils.py:55`): the builders of every layer "
        "that calls the conv fill padding rows with it (GDN `gdn_attn.py:623`, `:664`; Mamba `mamba_attn.py:656`; "
        "short conv `short_conv_attn.py:450`), and the function documents null_block_id as the padding mark "
        "(`causal_conv1d.py:994-996`); PAD_SLOT_ID = -1 pads only the Bailing linear-attention backend's indices "
        "(`v1/attention/backends/linear_attn.py:247-271`), whose layers call no conv",
        repro="suites/live_bugs/vllm_causal_conv1d_update_negative_slot.py",
        repro_note="vLLM's kernel files from the pinned wheel (`clients.engines.loader`) under Triton's interpreter "
                   "on a CPU (compiled on CUDA); the pool a view of a larger buffer, so the write before it lands in "
                   "memory the script owns and is seen (the interpreter raises no bounds error)",
        shows=r"row 1 \(slot -1\): output vs the loop from the row before the pool \(buffer\[0\]\): "
              r"\d\.\d+e-0[6-9][\s\S]*?the row before the pool, which no slot names: max \|change\| "
              r"[1-9]\.\d+e(\+\d\d|-0[0-2])"),
    LiveBug(
        "fla-varlen-padded-tail", "flash-linear-attention==0.6.0",
        "`chunk_gated_delta_rule` (`fla/ops/gated_delta_rule/chunk.py`): its chunk kernels run the chunks "
        "`prepare_chunk_indices(cu_seqlens)` lists (`fla/ops/utils/index.py`), none past cu_seqlens[-1]; the output "
        "and gradient buffers are allocated uninitialized for all T tokens",
        "a packed batch padded past its last boundary (T = 40, cu_seqlens [0, 10, 30]): the real tokens' outputs "
        "and gradients right, the padding tail's outputs and q / k / v / g / beta gradients never written "
        "(reported in QwenLM/FlashQLA #28, closed there; no report in fla's tracker found)",
        "suites/fla-interpret/test_padded_tail_gradients.py::test_padded_tail_outputs_and_gradients_are_zeros",
        "wrong result outside the callers' contract",
        "fla's API takes cu_seqlens with any T and raises nothing when cu_seqlens[-1] < T, but no caller in the "
        "pinned releases the project runs passes a tail (linattn, transformers' and megatron-core's GDN hand fla "
        "cu_seqlens[-1] = T); the report's trainer padded its packed batch and got the tail's garbage summed into "
        "its projections' weight gradients",
        repro="suites/live_bugs/fla_varlen_padded_tail_unwritten.py",
        repro_note="fla's kernels under Triton's interpreter on a CPU, with linattn's two interpreter patches "
                   "(compiled on CUDA); PyTorch's fill of uninitialized memory makes the unwritten tail NaN",
        shows=r"real tokens against the float64 loop: o \d\.\d+e-0[5-9][\s\S]*?padding tail \(unwritten memory "
              r"NaN\): o 320 of 320 NaN, dq 320 of 320 NaN",
        line=r"padding tail"),
    LiveBug(
        "causal-conv1d-uint32-offsets", "causal-conv1d==1.7.0",
        "`csrc/causal_conv1d.h:10` (`using index_t = uint32_t` for every stride), "
        "`csrc/causal_conv1d_fwd.cu:229-230` (the channel-last kernel's offset `(chunk_l_id * kChunkSizeL + l_idx) "
        "* params.x_l_stride` in 32 bits); reached through fla 0.6.0's `causal_conv1d(backend='cuda')` "
        "(`fla/modules/causal_conv1d/ops.py:1101`)",
        "x [1, 528384, 8192] bf16 (4.33e9 elements): y and dx NaN against the float64 reference, or an illegal "
        "memory access; 258,048 tokens (2.11e9) right",
        "suites/scale/test_delta_rule_at_scale.py::test_causal_conv1d_cuda_backend_past_int32",
        "wrong result on a path callers use",
        "fla's ShortConvolution and linattn's layers took causal-conv1d's kernels by default wherever it imports "
        "(linattn now takes fla's Triton kernel past 2**31 elements and refuses 'cuda' there); a GDN layer's conv "
        "of Qwen3.5-4B's width over 524,288 packed tokens, a length fla #1080's report trained at, reaches 2**32 elements",
        gpu_evidence="528,384 tokens: y NaN, dx NaN"),
)
