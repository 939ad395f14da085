"""Captured decode steps on one GPU: linattn's layer in bf16 (fla's kernels) through the project's
CUDA-graph runner (suites/clients/state_pool.py, `linattn_captured_pool_path`: static buffers of 4
rows, each padded batch size captured once into a torch.cuda.CUDAGraph and replayed with its
buffers refilled), through `assert_state_pool_parity` against the float64 layer on the same
bf16 weights, at BF16_RTOL; the recurrent pool in float32, as the layer returns that state."""

import dataclasses
import functools

import pytest
import torch

from cases.gpu import BF16_RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import gpu_config, random_state_dict  # noqa: E402
from clients.state_pool import linattn_captured_pool_path  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

CONFIG = gpu_config("qwen3_5")
CU = torch.tensor([0, 70, 6, 40, 9]).cumsum(0).to(torch.int32)
PLANS = [SequencePlan((1, 65), 4), SequencePlan((3,), 3), SequencePlan((30, 7), 3), SequencePlan((1, 5), 3)]


@functools.lru_cache(maxsize=1)
def reference():
    layer = build_layer(CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(CONFIG, 61, round_to=torch.bfloat16))
    return layer


def test_captured_decode_replays_with_refilled_buffers(spawn):
    # the layer returns its recurrent state in float32 (fla's kernels): a float32 recurrent pool
    path = dataclasses.replace(linattn_captured_pool_path(CONFIG), state_dtypes={"recurrent": torch.float32})
    assert_state_pool_parity(spawn, path, reference(), [Placement()], CU, plans=PLANS,
                             hidden_size=CONFIG.hidden_size, seed=62, rtol=BF16_RTOL, max_live=3,
                             capture_sizes=(1, 2, 4), dtype=torch.bfloat16, name="captured-bf16")
