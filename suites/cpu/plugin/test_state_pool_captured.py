"""Captured steps in the state-pool check (`StatePoolPath.capture`): a CUDA-graph runner's decode,
each padded batch size captured once and replayed with its static buffers refilled. linattn's
layer through the project's runner (suites/clients/state_pool.py, `linattn_captured_pool_path`)
passes at TP 1 with batches padded to 1, 2 and 4 rows (the 4-row graph uses the whole static
buffer), and on gpu-1's captured-decode cases in float64 (on a GPU the same runner replays real
CUDA graphs); the record runs it at TP 2 with sglang #32555's refill planted (bug_record.registry)."""

import pytest
import torch

from cases.layer_parity import linattn_layer, make_config, replicated_layer
from clients.state_pool import linattn_captured_pool_path, pool_capture, pool_decode, pool_prefill
from pytest_linattn.harness import Placement, SequencePlan, StatePoolPath, assert_state_pool_parity

CONFIG = make_config("qwen3_5", 2)
CU = torch.tensor([0, 7, 6, 5, 8]).cumsum(0).to(torch.int32)
PLANS = [SequencePlan((1, 4), 2), SequencePlan((3,), 3), SequencePlan((2, 1), 2), SequencePlan((5,), 3)]


def test_a_captured_runner_passes_with_batches_of_every_size(spawn):
    assert_state_pool_parity(spawn, linattn_captured_pool_path(CONFIG), replicated_layer(CONFIG, 41), [Placement()],
                             CU, plans=PLANS, hidden_size=CONFIG.hidden_size, seed=42, rtol=1e-10, max_live=3,
                             capture_sizes=(1, 2, 4), name="captured")


@pytest.mark.parametrize("family", ["qwen3_5", "kda"])
def test_the_gpu_files_captured_cases_in_float64(spawn, family):
    """gpu-1's captured-decode cases (cases.captured_decode: GPU_HEADS, sizes 1, 2 and 4) through the
    same runner in float64 on a CPU: the case table is sound before a GPU reads it."""
    from cases.captured_decode import CONFIGS, check

    check(spawn, family, linattn_captured_pool_path(CONFIGS[family]), f"gpu-cases-{family}", torch.float64, 1e-10)


def test_decode_or_capture_one_of_them():
    layer = linattn_layer(CONFIG)
    with pytest.raises(ValueError, match="takes decode or capture .*, one of them: got both"):
        StatePoolPath(layer, prefill=pool_prefill, decode=pool_decode, capture=pool_capture)
    with pytest.raises(ValueError, match="takes decode or capture .*, one of them: got neither"):
        StatePoolPath(layer, prefill=pool_prefill, decode=None)
    with pytest.raises(ValueError, match="StatePoolPath.capture must be callable"):
        StatePoolPath(layer, prefill=pool_prefill, decode=None, capture="graph")
