"""The captured-decode cases (linattn's layer through the project's CUDA-graph runner,
`clients.state_pool.linattn_captured_pool_path`) shared by suites/gpu-1/test_captured_decode_gpu1.py
(bf16 on fla's kernels, a real torch.cuda.CUDAGraph per size) and
suites/cpu/plugin/test_state_pool_captured.py (float64 on a CPU, the same runner replayed without a
graph), so the GPU file's case table is checked on every CPU run before a GPU ever reads it.

`check(spawn, family, path, name, dtype, rtol)`: `assert_state_pool_parity` of `path` against the
replicated float64 layer on weights rounded to `dtype`, GDN (qwen3_5) or KDA, at padded decode
batch sizes 1, 2 and 4.
"""

import functools

import torch

from cases.layer_parity import gpu_config, random_state_dict
from linattn.layers import build_layer
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity

CONFIGS = {"qwen3_5": gpu_config("qwen3_5"), "kda": gpu_config("kda", gate_lower_bound=-5.0)}
# each sequence: its prefill chunks, then its decode steps (a chunk crossing fla's 64-token chunk,
# 1-token first chunks); up to 3 sequences decoding at once, so decode calls of 1, 2 and 3 rows pad
# to the captured sizes 1, 2 and 4
PLANS = [SequencePlan((1, 4), 6), SequencePlan((3,), 3), SequencePlan((30, 40), 4), SequencePlan((2,), 7),
         SequencePlan((5,), 5)]
CU = torch.tensor([0, *(p.length for p in PLANS)]).cumsum(0).to(torch.int32)  # 11, 6, 74, 9, 10 tokens
CAPTURE_SIZES = (1, 2, 4)


@functools.lru_cache(maxsize=4)
def reference(family, dtype, seed=61):
    layer = build_layer(CONFIGS[family], dtype=torch.float64)
    layer.load_state_dict(random_state_dict(CONFIGS[family], seed, round_to=dtype))
    return layer


def check(spawn, family, path, name, dtype, rtol):
    config = CONFIGS[family]
    assert_state_pool_parity(spawn, path, reference(family, dtype), [Placement()], CU, plans=PLANS,
                             hidden_size=config.hidden_size, seed=62, rtol=rtol, max_live=3,
                             capture_sizes=CAPTURE_SIZES, dtype=dtype, name=name)
