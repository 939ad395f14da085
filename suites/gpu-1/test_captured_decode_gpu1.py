"""Captured decode steps on a real torch.cuda.CUDAGraph: linattn's layer through the project's
CUDA-graph runner (suites/clients/state_pool.py, `linattn_captured_pool_path`), bf16 on one GPU,
through `assert_state_pool_parity` against the replicated float64 layer on the same bf16-rounded
weights, at BF16_RTOL (KDA at KDA_BF16_RTOL; the pool in bf16, for GDN once more with float32
recurrent slots): every token's output, every final state, every live slot a call did not schedule
bitwise unchanged. The cases (suites/cases/captured_decode.py) run on a CPU in float64 too
(suites/cpu/plugin/test_state_pool_captured.py).

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

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, KDA_BF16_RTOL, require_cuda_and_fla

require_cuda_and_fla()

from bug_record.located import captured_destination_tail  # noqa: E402
from bug_record.plants_state import capture_refilling_the_front_reading_the_tail  # noqa: E402
from cases.captured_decode import CONFIGS, check  # noqa: E402
from clients.state_pool import linattn_captured_pool_path  # noqa: E402

pytestmark = pytest.mark.gpus(1)
BF16 = torch.bfloat16


def test_linattn_gdn_decode_replayed_from_a_cuda_graph(spawn):
    check(spawn, "qwen3_5", linattn_captured_pool_path(CONFIGS["qwen3_5"]), "captured-qwen3_5", BF16, RTOL)


def test_linattn_gdn_decode_replayed_with_a_float32_recurrent_pool(spawn):
    """vLLM's mamba_ssm_cache_dtype=float32: the recurrent slots in float32 under a bf16 layer."""
    path = dataclasses.replace(linattn_captured_pool_path(CONFIGS["qwen3_5"]), state_dtypes={"recurrent": torch.float32})
    check(spawn, "qwen3_5", path, "captured-qwen3_5-f32-pool", BF16, RTOL)


def test_linattn_kda_decode_replayed_from_a_cuda_graph(spawn):
    # KDA_BF16_RTOL, as the engines' KDA checks: at BF16_RTOL one prefill token was off by 2.2e-2 (an H100,
    # 2026-12-06; the final states 4.8e-3)
    check(spawn, "kda", linattn_captured_pool_path(CONFIGS["kda"]), "captured-kda", BF16, KDA_BF16_RTOL)


def test_the_front_refill_read_at_the_tail_is_caught_on_the_graph(spawn):
    path = dataclasses.replace(linattn_captured_pool_path(CONFIGS["qwen3_5"]),
                               capture=capture_refilling_the_front_reading_the_tail)
    with pytest.raises(AssertionError, match=captured_destination_tail()):
        check(spawn, "qwen3_5", path, "captured-sglang-32555", BF16, RTOL)
