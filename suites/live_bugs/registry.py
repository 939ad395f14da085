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
that row's sentence, date, machine, commit and command; it never claims a repro.
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
    gpu_evidence: str = ""  # without a repro: a phrase of the docs/results.md row that measured it
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
        "`chunk_rwkv7` with a CP context (`fla/ops/rwkv7/chunk.py:14`), its backward in fla's zigzag layout: not "
        "located between the DPLR state's CP path (`fla/ops/generalized_delta_rule/dplr/chunk.py:100`) and the "
        "conv's zigzag CP backward (`fla/modules/causal_conv1d/cp.py:132`)",
        "RWKV-7 client in fla's zigzag layout (CP 4; TP 2 x CP 2): outputs right, dx and 13 to 16 of 26 parameter "
        "gradients off in bf16, in float32 too (dx 0.75, x_w 1.81 against 5e-3); TP 4 and the contiguous layouts "
        "pass; under the emulation the same client matches at 1e-15",
        "suites/gpu-4/test_fla_families_gpu4.py::test_fla_family_float32_matches_float64[rwkv7-tp2/cp2-fla-zigzag]",
        "latent (no caller)",
        "fla 0.6.0's own RWKV7Attention passes chunk_rwkv7 no CP context; only a client that shards RWKV-7 over "
        "fla's CP (the project's, suites/clients/rwkv7.py, written as a team would) reaches this backward",
        gpu_evidence="RWKV-7 at TP 2 x CP 2 fla-zigzag in float32 fails too"),
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
)
