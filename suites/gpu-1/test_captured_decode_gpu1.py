"""Captured decode steps on a real torch.cuda.CUDAGraph: linattn's layer through the project's
CUDA-graph runner (suites/clients/state_pool.py, `linattn_captured_pool_path`), bf16 on one GPU,
through `assert_state_pool_parity` against the replicated float64 layer on the same bf16-rounded
weights, at BF16_RTOL: every token's output, every final state, every live slot a call did not
schedule bitwise unchanged.

Each padded decode batch size (1, 2 and 4 rows) is captured once (a warm-up on a side stream with
every row at the null slot, then the capture) and replayed with the runner's static input and
slot buffers refilled per step while the batch's sequences, slots and padding change. The step is
linattn's `step` under no_grad: `kernels.short_conv_step` and fla's fused_recurrent kernels, no
host synchronisation (fla's causal_conv1d with cu_seqlens reads the boundaries on the host, which
a capture refuses). The record's sglang #32555 (the replay refills the front of the destination
buffer, the graph writes through its tail) is planted in the same runner and must be caught on
the real graph with the first wrong token located, as on a CPU.
"""

import dataclasses
import functools

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from bug_record.located import captured_destination_tail  # noqa: E402
from bug_record.plants_state import capture_refilling_the_front_reading_the_tail  # noqa: E402
from cases.layer_parity import gpu_config, random_state_dict  # noqa: E402
from clients.state_pool import linattn_captured_pool_path  # noqa: E402
from linattn.layers import build_layer  # noqa: E402
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

CONFIGS = {"qwen3_5": gpu_config("qwen3_5"), "kda": gpu_config("kda", gate_lower_bound=-5.0)}
# each sequence: its prefill chunks, then its decode steps (a chunk crossing fla's 64-token chunk,
# 1-token first chunks); up to 3 sequences decoding at once, so decode calls of 1, 2 and 3 rows pad
# to the captured sizes 1, 2 and 4
PLANS = [SequencePlan((1, 4), 6), SequencePlan((3,), 3), SequencePlan((30, 40), 4), SequencePlan((2,), 7),
         SequencePlan((5,), 5)]
SEQLENS = (11, 6, 74, 9, 10)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
CAPTURE_SIZES = (1, 2, 4)


@functools.lru_cache(maxsize=4)
def reference(family, seed=61):
    layer = build_layer(CONFIGS[family], dtype=torch.float64)
    layer.load_state_dict(random_state_dict(CONFIGS[family], seed, round_to=torch.bfloat16))
    return layer


def check(spawn, family, path, name):
    config = CONFIGS[family]
    assert_state_pool_parity(spawn, path, reference(family), [Placement()], CU, plans=PLANS,
                             hidden_size=config.hidden_size, seed=62, rtol=RTOL, max_live=3,
                             capture_sizes=CAPTURE_SIZES, dtype=torch.bfloat16, name=name)


def test_linattn_gdn_decode_replayed_from_a_cuda_graph(spawn):
    check(spawn, "qwen3_5", linattn_captured_pool_path(CONFIGS["qwen3_5"]), "captured-qwen3_5")


def test_linattn_kda_decode_replayed_from_a_cuda_graph(spawn):
    check(spawn, "kda", linattn_captured_pool_path(CONFIGS["kda"]), "captured-kda")


def test_the_front_refill_read_at_the_tail_is_caught_on_the_graph(spawn):
    path = dataclasses.replace(linattn_captured_pool_path(CONFIGS["qwen3_5"]),
                               capture=capture_refilling_the_front_reading_the_tail)
    with pytest.raises(AssertionError, match=captured_destination_tail()):
        check(spawn, "qwen3_5", path, "captured-sglang-32555")
