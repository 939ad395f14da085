"""Captured decode steps on one GPU, a real torch.cuda.CUDAGraph per padded batch size, replayed
with its static buffers refilled (`StatePoolPath.capture`), through `assert_state_pool_parity`
against the float64 layer on the same bf16 weights, at BF16_RTOL:

- vLLM 0.33.0's GDN decode as its CUDA-graph runner replays it (`clients.engines.vllm_gdn`
  `vllm_pool_capture`: causal_conv1d_update and fused_sigmoid_gating_delta_rule_update on the
  slots, padding rows at the null block);
- linattn's own layer (`clients.state_pool.linattn_captured_pool_path`): its decode step on CUDA
  runs fla's causal_conv1d with cu_seqlens, whose prepare_chunk_indices syncs with the host, so
  it cannot be captured (measured on an H100, 2026-12-06: "operation not permitted when stream
  is capturing" from fla/ops/utils/index.py:128): a strict xfail saying so.
"""

import dataclasses
import functools

import pytest
import torch

from cases.gpu import BF16_RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import gpu_config, random_state_dict  # noqa: E402
from clients.engines.fetch import VLLM  # noqa: E402
from clients.engines.layout import engine_reference_forward  # noqa: E402
from clients.engines.loader import missing_reason  # noqa: E402
from clients.state_pool import linattn_captured_pool_path  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

CONFIG = gpu_config("qwen3_5")
CU = torch.tensor([0, 70, 6, 40, 9]).cumsum(0).to(torch.int32)
PLANS = [SequencePlan((1, 65), 4), SequencePlan((3,), 3), SequencePlan((30, 7), 3), SequencePlan((1, 5), 3)]
# the layer returns its recurrent state in float32 (fla's kernels): a float32 recurrent pool
STATE_DTYPES = {"recurrent": torch.float32}


@functools.lru_cache(maxsize=1)
def reference():
    layer = build_layer(CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(CONFIG, 61, round_to=torch.bfloat16))
    return layer


def check(spawn, path, name, **options):
    assert_state_pool_parity(spawn, dataclasses.replace(path, state_dtypes=STATE_DTYPES), reference(), [Placement()],
                             CU, plans=PLANS, hidden_size=CONFIG.hidden_size, seed=62, rtol=BF16_RTOL, max_live=3,
                             capture_sizes=(1, 2, 4), dtype=torch.bfloat16, name=name, **options)


@pytest.mark.skipif(missing_reason(VLLM) is not None, reason=str(missing_reason(VLLM)))
def test_vllm_captured_decode_replays_with_refilled_buffers(spawn):
    from clients.engines.vllm_gdn import vllm_pool_capture, vllm_pool_path

    check(spawn, vllm_pool_path(CONFIG, capture=vllm_pool_capture), "vllm-captured-bf16",
          reference_forward=engine_reference_forward)


@pytest.mark.xfail(strict=True, reason="linattn's decode step on CUDA runs fla's causal_conv1d with cu_seqlens, whose "
                   "prepare_chunk_indices syncs with the host: not capturable into a CUDA graph")
def test_linattn_captured_decode_replays_with_refilled_buffers(spawn):
    check(spawn, linattn_captured_pool_path(CONFIG), "captured-bf16")
