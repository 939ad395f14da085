"""The engine clients (suites/clients/engines/: vLLM 0.33.0's and sglang 0.5.23's own GDN and KDA
serving kernels, the pinned releases' files) on one GPU with the kernels compiled by Triton (the
engines suite runs the same clients interpreted, float32, on a CPU), through
`assert_state_pool_parity` and `assert_spec_decode_parity` against linattn's replicated float64
layer with the reference's states in the engines' layout, as the CPU tests compute it
(`engine_reference_forward`; vLLM's spec layout: `spec_reference_forward`), its weights rounded to
the checked dtype first.

The kernel files come from the carried folder .engines/ (the GPU machine has no network, so
fetch.py cannot run there): the loader checks them against the hashes fetch recorded and a test
whose release is not there skips, saying so.

Cases (each in bf16 and in float32 where the engine takes float32):
- vLLM GDN pool: causal_conv1d_fn / causal_conv1d_update on the conv pool, the chunked prefill
  from the gathered slots, decode on fused_sigmoid_gating_delta_rule_update or the decode-only
  fused_recurrent_gated_delta_rule_packed_decode; slot 0 the null block, padding rows at it; the
  decode also captured into a real CUDA graph and replayed (bf16);
- vLLM GDN prefix caching: the align mode's copies around the same kernels (snapshots, hits);
- vLLM KDA pool: chunk_kda_with_fused_gate, fused_recurrent_kda_packed_decode;
- vLLM GDN and KDA speculative decoding: `[N, 1 + K]` slot rows and num_accepted_tokens;
- sglang GDN pool: causal_conv1d_fn, prefill on fused_recurrent_gated_delta_rule_update or the
  chunked kernel (its tl.make_block_ptr exists in Triton 3.6; chunk_unavailable_reason says
  where not), decode on fused_sigmoid_gating_delta_rule_update or the packed decode; padding
  rows at -1;
- sglang GDN speculative decoding: target_verify with intermediate buffers, the accepted step
  copied into the slot;
- sglang KDA pool: causal_conv1d_fn / causal_conv1d_update on its `[W-1, dim]` conv pool,
  chunk_kda from the slots in place (its tl.make_block_ptr runs on Triton 3.6), decode on the
  packed kernel or fused_sigmoid_gating_delta_rule_update(is_kda=True).

Bounds (relative Frobenius error per tensor, as every check of the harness):
- bf16: BF16_RTOL (cases.gpu), the bound of the fla serving and spec-decode GPU tests: the same
  check (every token's output, every final state, untouched slots bitwise) of bf16 kernels on a
  bf16 pool against the float64 layer on the same bf16 weights; KDA's tokens KDA_BF16_RTOL (cases.gpu:
  measured on every bf16 path, fla's and torch's too);
- float32, GDN paths: F32_RTOL = 1e-5, the engines suite's bound: no kernel on these paths
  (the convs, fused_recurrent*, fused_sigmoid_gating*) has a tl.dot, so compiled they compute
  in float32 throughout, as interpreted;
- float32, KDA: TF32_RTOL. chunk_kda_with_fused_gate's tl.dot calls take float32 operands in
  tf32 (Triton's default input precision; solve_tril asks for tf32 itself on sm80+,
  kda/chunk_intra.py:571-574): 10 mantissa bits to bf16's 7, so BF16_RTOL / 8, doubled.
- float32 where the engine refuses it: vLLM's chunk_gated_delta_rule asserts q is not float32
  (third_party/flash_linear_attention/ops/chunk.py:213), sglang's too
  (kernels/ops/attention/fla/chunk.py:216): the vLLM GDN prefill (pool and spec decode) and
  sglang's chunked prefill are bf16 only here (the CPU suite calls their autograd Functions in
  float32 under the interpreter).
"""

import functools

import pytest
import torch

from cases.gpu import BF16_RTOL, KDA_BF16_RTOL

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the engines' kernels compiled need one (suites/engines runs them "
                "interpreted on a CPU)", allow_module_level=True)

from cases.layer_parity import gpu_config, random_state_dict  # noqa: E402
from clients.engines.fetch import SGLANG, VLLM  # noqa: E402
from clients.engines.layout import engine_reference_forward  # noqa: E402
from clients.engines.loader import missing_reason  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.harness import (Placement, SequencePlan, SpecPlan, assert_spec_decode_parity,  # noqa: E402
                                   assert_state_pool_parity)

pytestmark = pytest.mark.gpus(1)

F32_RTOL = 1e-5
TF32_RTOL = 2 * BF16_RTOL / 8

# the GPU suites' heads (4 key heads, head dims 64 and 128): GDN with two value heads per key head
# (GVA, as Qwen3-Next); KDA as Kimi Linear serves it, as many value heads as key heads, the bounded gate
CONFIG = gpu_config("qwen3_5")
KDA_CONFIG = gpu_config("kda", ratio=1, gate_lower_bound=-5.0)
SEQLENS = (70, 6, 40, 9)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
# a chunk crossing the kernels' 64-token chunk, 1-token first chunks, decode runs; 2 live at once
PLANS = [SequencePlan((1, 65), 4), SequencePlan((3,), 3), SequencePlan((30, 7), 3), SequencePlan((1, 5), 3)]
# vLLM's causal_conv1d_update asserts a pool of at least the batch's rows (causal_conv1d.py:1052):
# the full pool holds 2 sequences' slots and the null block, so decode calls are padded to 3
CAPTURE_SIZES = (3,)
# speculative decoding: a bonus token and 2 drafts per verify call, 0 to 2 accepted, a different
# count per sequence in one call
NUM_DRAFT = 2
SPEC_PLANS = [SpecPlan((1, 65), (2, 0, 1)), SpecPlan((3,), (0, 1, 2)), SpecPlan((30, 7), (1, 2, 0))]

DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}
VLLM_GDN_F32 = ("vLLM 0.33.0's chunk_gated_delta_rule refuses float32 (third_party/flash_linear_attention/ops/"
                "chunk.py:213: 'does not support float32. Please use bfloat16'): its GDN prefill runs bf16 only")
SGLANG_CHUNK_F32 = ("sglang 0.5.23's chunk_gated_delta_rule refuses float32 (kernels/ops/attention/fla/chunk.py:216): "
                    "its chunked prefill runs bf16 only")


def dtypes(float32_refused=None):
    """bf16, and float32 unless the engine refuses it (then a skip that says why)."""
    marks = [pytest.mark.skip(reason=float32_refused)] if float32_refused else []
    return [pytest.param("bf16", id="bf16"), pytest.param("float32", id="float32", marks=marks)]


def needs(release):
    reason = missing_reason(release)
    if reason is not None:
        reason = (f"{reason}. The GPU machine has no network: fetch on a machine with one and carry .engines/ "
                  f"(suites/clients/engines/fetch.py never runs here)")
    return pytest.mark.skipif(reason is not None, reason=str(reason))


def rtol(config, dtype):
    if dtype == "bf16":
        return KDA_BF16_RTOL if config.op == "kda" else BF16_RTOL
    return TF32_RTOL if config.op == "kda" else F32_RTOL


@functools.lru_cache(maxsize=8)
def reference(config, dtype, seed=41):
    """The replicated float64 layer on weights rounded to `dtype` (what the client's layer holds)."""
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(config, seed, round_to=DTYPES[dtype]))
    return layer


def check_pool(spawn, path, name, dtype, config=CONFIG):
    assert_state_pool_parity(spawn, path, reference(config, dtype), [Placement()], CU, plans=PLANS,
                             hidden_size=config.hidden_size, seed=42, rtol=rtol(config, dtype), max_live=2,
                             capture_sizes=CAPTURE_SIZES, dtype=DTYPES[dtype],
                             reference_forward=engine_reference_forward, name=f"{name}-{dtype}")


def check_spec(spawn, path, reference_forward, name, dtype, config=CONFIG):
    assert_spec_decode_parity(spawn, path, reference(config, dtype), [Placement()], SPEC_PLANS, num_draft=NUM_DRAFT,
                              hidden_size=config.hidden_size, seed=43, rtol=rtol(config, dtype), dtype=DTYPES[dtype],
                              reference_forward=reference_forward, name=f"{name}-{dtype}")


@needs(VLLM)
@pytest.mark.parametrize("dtype", dtypes(VLLM_GDN_F32))
@pytest.mark.parametrize("decode_kernel", ["fused_sigmoid_gating", "packed"])
def test_vllm_gdn_pool_matches_the_float64_layer(spawn, decode_kernel, dtype):
    from clients.engines.vllm_gdn import vllm_pool_path

    check_pool(spawn, vllm_pool_path(CONFIG, decode_kernel), f"vllm-gdn-{decode_kernel}", dtype)


@needs(VLLM)
def test_vllm_gdn_decode_replayed_from_a_cuda_graph(spawn):
    """vLLM's decode as its CUDA-graph runner replays it (`vllm_pool_capture`: the static state-index
    buffer refilled per step, gdn_attn.py:648-671), captured into a real torch.cuda.CUDAGraph, bf16."""
    from clients.engines.vllm_gdn import vllm_pool_capture, vllm_pool_path

    check_pool(spawn, vllm_pool_path(CONFIG, capture=vllm_pool_capture), "vllm-gdn-captured", "bf16")


# prefix mode: blocks of 16 tokens; sequence 0 snapshots at 16 and 32, sequence 1 hits its first 32
# and runs a 2-token chunk (< W-1), sequence 2 hits its first 16
PREFIX_CU = torch.tensor([0, 43, 36, 22]).cumsum(0).to(torch.int32)  # chunks (a hit's prefix too), decode steps
PREFIX_PLANS = [SequencePlan((16, 16, 8), 3), SequencePlan((2,), 2), SequencePlan((4,), 2)]
PREFIX_HITS = {1: (0, 32), 2: (0, 16)}


@needs(VLLM)
@pytest.mark.parametrize("dtype", dtypes(VLLM_GDN_F32))
def test_vllm_gdn_prefix_caching_matches_the_float64_layer(spawn, dtype):
    """vLLM's align-mode copies around its kernels (`vllm_prefix_prefill`), the prefix mode's snapshots and hits."""
    from clients.engines.vllm_gdn import vllm_pool_path, vllm_prefix_prefill

    assert_state_pool_parity(spawn, vllm_pool_path(CONFIG, prefill=vllm_prefix_prefill), reference(CONFIG, dtype),
                             [Placement()], PREFIX_CU, plans=PREFIX_PLANS, hidden_size=CONFIG.hidden_size, seed=42,
                             rtol=rtol(CONFIG, dtype), max_live=2, capture_sizes=CAPTURE_SIZES, block_size=16,
                             prefix_hits=PREFIX_HITS, dtype=DTYPES[dtype], reference_forward=engine_reference_forward,
                             name=f"vllm-gdn-prefix-{dtype}")


@needs(VLLM)
@pytest.mark.parametrize("dtype", dtypes())
def test_vllm_kda_pool_matches_the_float64_layer(spawn, dtype):
    from clients.engines.vllm_kda import vllm_kda_pool_path

    check_pool(spawn, vllm_kda_pool_path(KDA_CONFIG), "vllm-kda", dtype, KDA_CONFIG)


@needs(VLLM)
@pytest.mark.parametrize("op, dtype", [pytest.param("gdn", *p.values, id=f"gdn-{p.id}", marks=p.marks)
                                       for p in dtypes(VLLM_GDN_F32)]
                         + [pytest.param("kda", *p.values, id=f"kda-{p.id}", marks=p.marks)
                            for p in dtypes()])
def test_vllm_spec_decode_matches_the_serial_run(spawn, op, dtype):
    from clients.engines.vllm_gdn import spec_reference_forward, vllm_spec_path

    config = KDA_CONFIG if op == "kda" else CONFIG
    check_spec(spawn, vllm_spec_path(config, NUM_DRAFT), functools.partial(spec_reference_forward, NUM_DRAFT),
               f"vllm-{op}-spec", dtype, config)


@needs(SGLANG)
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("decode_kernel", ["fused_sigmoid_gating", "packed"])
def test_sglang_gdn_pool_matches_the_float64_layer(spawn, decode_kernel, dtype):
    from clients.engines.sglang_gdn import sglang_pool_path

    check_pool(spawn, sglang_pool_path(CONFIG, decode_kernel=decode_kernel), f"sglang-gdn-{decode_kernel}", dtype)


@needs(SGLANG)
@pytest.mark.parametrize("dtype", dtypes(SGLANG_CHUNK_F32))
def test_sglang_gdn_pool_with_chunked_prefill(spawn, dtype):
    from clients.engines.sglang_gdn import chunk_unavailable_reason, sglang_pool_path

    if chunk_unavailable_reason():  # Triton's language: compiled kernels too
        pytest.skip(chunk_unavailable_reason())
    check_pool(spawn, sglang_pool_path(CONFIG, prefill_recurrence="chunk"), "sglang-gdn-chunk", dtype)


@needs(SGLANG)
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("decode_kernel", ["packed", "fused_sigmoid_gating"])
def test_sglang_kda_pool_matches_the_float64_layer(spawn, decode_kernel, dtype):
    from clients.engines.sglang_kda import kda_pool_reference_forward, sglang_kda_pool_path

    assert_state_pool_parity(spawn, sglang_kda_pool_path(KDA_CONFIG, decode_kernel), reference(KDA_CONFIG, dtype),
                             [Placement()], CU, plans=PLANS, hidden_size=KDA_CONFIG.hidden_size, seed=42,
                             rtol=rtol(KDA_CONFIG, dtype), max_live=2, capture_sizes=CAPTURE_SIZES, dtype=DTYPES[dtype],
                             reference_forward=kda_pool_reference_forward, name=f"sglang-kda-{decode_kernel}-{dtype}")


@needs(SGLANG)
@pytest.mark.parametrize("dtype", dtypes())
def test_sglang_kda_spec_decode_matches_the_serial_run(spawn, dtype):
    from clients.engines.sglang_gdn import sglang_spec_path
    from clients.engines.sglang_kda import kda_pool_reference_forward

    check_spec(spawn, sglang_spec_path(KDA_CONFIG), kda_pool_reference_forward, "sglang-kda-spec", dtype, KDA_CONFIG)


@needs(SGLANG)
@pytest.mark.parametrize("dtype", dtypes())
def test_sglang_gdn_spec_decode_matches_the_serial_run(spawn, dtype):
    from clients.engines.sglang_gdn import sglang_spec_path

    check_spec(spawn, sglang_spec_path(CONFIG), engine_reference_forward, "sglang-gdn-spec", dtype)
