"""The engines' own GDN and KDA serving kernels through the serving checks, under Triton's
interpreter in float32, against linattn's replicated float64 layer (float32 bound 1e-5).
`assert_state_pool_parity`: prefill calls of chunks from the slots (a fresh sequence from zero),
decode calls padded to a captured size, slots freed and reused, a spare pool and a full one;
in prefix mode (vLLM's align-mode copies around its kernels) snapshots at block boundaries and
prefix hits.
`assert_spec_decode_parity`: verify calls of the last accepted token and 2 drafts, 0 to 2 of
them accepted.

- vLLM 0.33.0, slot 0 the null block (reserved) and every padding row at it:
  GDN (`clients.engines.vllm_gdn`): causal_conv1d_fn with cache_indices and has_initial_state,
  the chunked recurrence from the gathered slots, written back; decode through
  causal_conv1d_update and fused_sigmoid_gating_delta_rule_update on the slots in place, or the
  decode-only fast path fused_recurrent_gated_delta_rule_packed_decode; speculative decoding
  with `[N, 1 + K]` indices and num_accepted_tokens. KDA (`clients.engines.vllm_kda`):
  chunk_kda_with_fused_gate, fused_recurrent_kda_packed_decode, fused_recurrent_kda for verify.
- sglang 0.5.23, padding rows at -1 (`clients.engines.sglang_gdn`): GDN's causal_conv1d_fn, then
  the recurrence reading and writing the slots itself (fused_recurrent_gated_delta_rule_update;
  or the chunked kernel, which Triton 3.9 cannot run); decode through causal_conv1d_update and
  fused_sigmoid_gating_delta_rule_update, or fused_recurrent_gated_delta_rule_packed_decode;
  target_verify with intermediate buffers, the accepted step copied into the slot.
"""

import functools

import pytest
import torch

from cases.layer_parity import replicated_layer
from clients.engines.fetch import SGLANG, VLLM
from clients.engines.loader import missing_reason
from linattn.layers import LinearAttentionConfig
from pytest_linattn.harness import (Placement, SequencePlan, SpecPlan, assert_spec_decode_parity,
                                   assert_state_pool_parity)

# two key heads, two value heads per key head (GVA, as Qwen3-Next)
CONFIG = LinearAttentionConfig("qwen3_5", hidden_size=16, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                               conv_size=4, norm_eps=1e-5)
SEQLENS = (7, 6, 5, 8)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
# a 1-token first chunk, chunks from a state, decode runs of several lengths; 2 live at once:
# sequences 2 and 3 take the slots freed
PLANS = [SequencePlan((1, 4), 2), SequencePlan((3,), 3), SequencePlan((2, 1), 2), SequencePlan((5,), 3)]
# vLLM's causal_conv1d_update asserts a pool of at least the batch's rows (causal_conv1d.py:1052):
# the full pool holds 2 sequences' slots and the null block, so decode calls are padded to 3
CAPTURE_SIZES = (3,)
RTOL = 1e-5
# KDA as Kimi Linear serves it: as many value heads as key heads, the bounded (safe) gate
KDA_CONFIG = LinearAttentionConfig("kda", hidden_size=16, num_k_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                                   conv_size=4, norm_eps=1e-5, gate_lower_bound=-5.0)


def needs(release):
    reason = missing_reason(release)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


def check(spawn, path, name, config=CONFIG, placements=(Placement(),)):
    from clients.engines.layout import engine_reference_forward

    assert_state_pool_parity(spawn, path, replicated_layer(config, 41), placements, CU, plans=PLANS,
                             hidden_size=config.hidden_size, seed=42, rtol=RTOL, max_live=2,
                             capture_sizes=CAPTURE_SIZES, dtype=torch.float32,
                             reference_forward=engine_reference_forward, name=name)


@needs(VLLM)
@pytest.mark.parametrize("decode_kernel", ["fused_sigmoid_gating", "packed"])
def test_vllm_gdn_pool_matches_the_float64_layer(spawn, decode_kernel):
    from clients.engines.vllm_gdn import vllm_pool_path

    check(spawn, vllm_pool_path(CONFIG, decode_kernel), f"vllm-gdn-{decode_kernel}")


@needs(VLLM)
def test_vllm_gdn_captured_decode_steps(spawn):
    """vLLM's decode as its CUDA-graph runner replays it (`vllm_pool_capture`): each padded batch size
    set up once, its static buffers refilled per step while the batch's rows change."""
    from clients.engines.vllm_gdn import vllm_pool_capture, vllm_pool_path

    check(spawn, vllm_pool_path(CONFIG, capture=vllm_pool_capture), "vllm-gdn-captured")


@needs(VLLM)
def test_vllm_gdn_pool_at_tp2(spawn):
    """Each TP rank's kernels on its pool of its heads' states (one key head, two value heads)."""
    from clients.engines.vllm_gdn import vllm_pool_path

    check(spawn, vllm_pool_path(CONFIG), "vllm-gdn-tp2", placements=(Placement(tp=2),))


def prefix_check(spawn, path, name):
    """The pool check in prefix mode, at the record's prefix plans (bug_record.checks): blocks of 4
    tokens, sequence 1 hitting sequence 0's first 8 with a 2-token chunk (< W-1), sequence 2 its
    first 4."""
    from bug_record.checks import PREFIX_BLOCK, PREFIX_CU, PREFIX_HITS, PREFIX_PLANS
    from clients.engines.layout import engine_reference_forward

    assert_state_pool_parity(spawn, path, replicated_layer(CONFIG, 41), [Placement()], PREFIX_CU, plans=PREFIX_PLANS,
                             hidden_size=CONFIG.hidden_size, seed=42, rtol=RTOL, max_live=2,
                             capture_sizes=CAPTURE_SIZES, block_size=PREFIX_BLOCK, prefix_hits=PREFIX_HITS,
                             dtype=torch.float32, reference_forward=engine_reference_forward, name=name)


@needs(VLLM)
def test_vllm_gdn_prefix_caching_matches_the_float64_layer(spawn):
    """vLLM's align mode around its kernels (`vllm_prefix_prefill`): a hit's state copied into the
    block it writes, the kernels in place there, the block-boundary states kept."""
    from clients.engines.vllm_gdn import vllm_pool_path, vllm_prefix_prefill

    prefix_check(spawn, vllm_pool_path(CONFIG, prefill=vllm_prefix_prefill), "vllm-gdn-prefix")


@needs(VLLM)
def test_vllm_kda_pool_matches_the_float64_layer(spawn):
    from clients.engines.vllm_kda import vllm_kda_pool_path

    check(spawn, vllm_kda_pool_path(KDA_CONFIG), "vllm-kda", KDA_CONFIG)


@needs(SGLANG)
@pytest.mark.parametrize("decode_kernel", ["fused_sigmoid_gating", "packed"])
def test_sglang_gdn_pool_matches_the_float64_layer(spawn, decode_kernel):
    from clients.engines.sglang_gdn import sglang_pool_path

    check(spawn, sglang_pool_path(CONFIG, decode_kernel=decode_kernel), f"sglang-gdn-{decode_kernel}")


@needs(SGLANG)
def test_sglang_gdn_pool_with_chunked_prefill(spawn):
    from clients.engines.sglang_gdn import chunk_unavailable_reason, sglang_pool_path

    if chunk_unavailable_reason():  # Triton's language: compiled kernels too
        pytest.skip(chunk_unavailable_reason())
    check(spawn, sglang_pool_path(CONFIG, prefill_recurrence="chunk"), "sglang-gdn-chunk")


@needs(SGLANG)
@pytest.mark.parametrize("decode_kernel", ["packed", "fused_sigmoid_gating"])
def test_sglang_kda_pool_matches_the_float64_layer(spawn, decode_kernel):
    from clients.engines.sglang_gdn import chunk_unavailable_reason
    from clients.engines.sglang_kda import kda_pool_reference_forward, sglang_kda_pool_path

    if chunk_unavailable_reason():  # its prefill is chunk_kda: runs compiled on a GPU (suites/gpu-1)
        pytest.skip(chunk_unavailable_reason())
    assert_state_pool_parity(spawn, sglang_kda_pool_path(KDA_CONFIG, decode_kernel), replicated_layer(KDA_CONFIG, 41),
                             [Placement()], CU, plans=PLANS, hidden_size=KDA_CONFIG.hidden_size, seed=42, rtol=RTOL,
                             max_live=2, capture_sizes=CAPTURE_SIZES, dtype=torch.float32,
                             reference_forward=kda_pool_reference_forward, name=f"sglang-kda-{decode_kernel}")


@needs(SGLANG)
@pytest.mark.parametrize("decode_kernel", ["packed", "fused_sigmoid_gating"])
def test_sglang_kda_decode_from_slots_matches_the_float64_step(decode_kernel):
    """sglang's KDA decode kernels where its chunked prefill cannot run (this CPU's Triton): one
    decode call of 3 rows from random slot states in sglang's KDA pool layout (conv `[W-1, dim]`)
    and a padding row at -1, against the float64 layer's decode step; the padding row's slot (the
    pool's last, -1's) bitwise unchanged."""
    from clients.engines.layout import call_with_pool, to_engine_state
    from clients.engines.sglang_kda import SglangKDA, _kda_pool_layout
    from linattn.layers import LayerState
    from pytest_linattn.parity import assert_parity

    reference = replicated_layer(KDA_CONFIG, 41)
    module = SglangKDA(KDA_CONFIG, dtype=torch.float32)
    module.load_state_dict(reference.state_dict())
    module.decode_kernel = decode_kernel
    gen = torch.Generator().manual_seed(44)
    rows = 3
    state = LayerState(torch.randn(rows, KDA_CONFIG.conv_dim, KDA_CONFIG.conv_size - 1, generator=gen, dtype=torch.float64),
                       0.3 * torch.randn(rows, KDA_CONFIG.num_v_heads, KDA_CONFIG.head_k_dim, KDA_CONFIG.head_v_dim,
                                         generator=gen, dtype=torch.float64))
    x = torch.randn(1, rows + 1, KDA_CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    y_ref, new_ref = reference.step(x[:, :rows], state)
    slots = torch.tensor([2, 0, 1, -1], dtype=torch.int32)  # row i in slot slots[i], then a padding row
    rows_state = _kda_pool_layout(to_engine_state(state))
    # a 4th slot of large values: the pool's last, where -1 would land
    pool = LayerState(*(torch.cat([torch.empty_like(f), 100 + f[:1]]).float() for f in rows_state))
    for f, r in zip(pool, rows_state):
        f[slots[:rows].long()] = r.float()
    untouched = [f[-1].clone() for f in pool]
    with torch.no_grad():
        y = call_with_pool(module, x.float(), torch.arange(rows + 2, dtype=torch.int32), kind="decode", pool=pool,
                           slots=slots)
    got = _kda_pool_layout(LayerState(*(f[slots[:rows].long()].double() for f in pool)))
    assert_parity({"output": y[:, :rows].double(), "conv": got.conv, "recurrent": got.recurrent.transpose(-1, -2)},
                  {"output": y_ref, "conv": new_ref.conv, "recurrent": new_ref.recurrent}, rtol=RTOL,
                  name=f"sglang-kda-decode-{decode_kernel}")
    assert all(torch.equal(f[-1], u) for f, u in zip(pool, untouched)), "the padding row (-1) changed the last slot"


# speculative decoding: a bonus token and 2 drafts per verify call, drafts accepted 0, 1 or 2
NUM_DRAFT = 2
SPEC_PLANS = [SpecPlan((3,), (2, 0)), SpecPlan((1, 2), (1, 2)), SpecPlan((4,), (0,))]


@needs(VLLM)
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_vllm_spec_decode_matches_the_serial_run(spawn, op):
    from clients.engines.vllm_gdn import spec_reference_forward, vllm_spec_path

    config = KDA_CONFIG if op == "kda" else CONFIG
    assert_spec_decode_parity(spawn, vllm_spec_path(config, NUM_DRAFT), replicated_layer(config, 41), [Placement()],
                              SPEC_PLANS, num_draft=NUM_DRAFT, hidden_size=config.hidden_size, seed=43, rtol=RTOL,
                              dtype=torch.float32,
                              reference_forward=functools.partial(spec_reference_forward, NUM_DRAFT),
                              name=f"vllm-{op}-spec")


def mixed_spec_check(spawn, path, name):
    """Mixed verify calls (vLLM batches rows that drafted nothing with rows that did), at the record's
    plans (bug_record.checks.SPEC_MIXED_PLANS, K = 2)."""
    from bug_record.checks import SPEC_MIXED_PLANS
    from clients.engines.vllm_gdn import spec_reference_forward

    assert_spec_decode_parity(spawn, path, replicated_layer(CONFIG, 41), [Placement()], SPEC_MIXED_PLANS,
                              num_draft=NUM_DRAFT, hidden_size=CONFIG.hidden_size, seed=43, rtol=RTOL,
                              dtype=torch.float32, reference_forward=functools.partial(spec_reference_forward, NUM_DRAFT),
                              name=name)


@needs(VLLM)
def test_vllm_spec_decode_with_mixed_rows(spawn):
    """Rows that drafted nothing (their bonus token alone) in the spec path beside rows that did, as
    vLLM 0.33.0 runs them (gdn_attn.py:340-348): each from column num_accepted_tokens - 1."""
    from clients.engines.vllm_gdn import vllm_spec_path

    mixed_spec_check(spawn, vllm_spec_path(CONFIG, NUM_DRAFT), "vllm-gdn-spec-mixed")


@needs(SGLANG)
def test_sglang_gdn_spec_decode_matches_the_serial_run(spawn):
    from clients.engines.layout import engine_reference_forward
    from clients.engines.sglang_gdn import sglang_spec_path

    assert_spec_decode_parity(spawn, sglang_spec_path(CONFIG), replicated_layer(CONFIG, 41), [Placement()],
                              SPEC_PLANS, num_draft=NUM_DRAFT, hidden_size=CONFIG.hidden_size, seed=43, rtol=RTOL,
                              dtype=torch.float32, reference_forward=engine_reference_forward, name="sglang-gdn-spec")
