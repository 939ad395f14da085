"""gpu-1's schedule over its test processes (suites.toml: `-n 4 --dist loadgroup`).

On a fresh machine most of gpu-1's time is Triton compiling fla's kernels, on the CPU, once per
test process and per variant (op, gate form, state layout, head count: compile-time constants).
Tests that compile the same variants share an xdist group, so one process compiles them while
the other groups compile side by side (with `--dist loadfile` two processes compiled chunk_kda's
kernels at once). It pays only because each worker computes on its share of the cores
(pytest_linattn.ranks.pool.thread_share): 67-71 s on a fresh H200, 133 s in one process
(2026-12-01, nvidia-h200; current figures: docs/results.md).
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# group: the test ids (substrings) that compile its kernels; a test in none runs in "other"
COMPILE_GROUPS = {
    # chunk_kda with a precomputed per-channel decay, fwd + bwd (GDN's kda route expands to it)
    "chunk_kda": ("test_kda_matches_reference", "[chunk_kda-decay-h0-l2norm]"),
    "gdn_kda_route": ("test_gdn_kda_route_matches_reference", "test_gdn_default_route_runs_backward"),
    "chunk_kda_gate_in_kernel": ("[chunk_kda-gate_in_kernel-beta_sigmoid-v_first]", "[kda-gva2-low_rank_gate]"),
    "chunk_kda_safe_gate": ("[chunk_kda-safe_gate-lower_bound-scale]", "[chunk_kda-precomputed_safe_gate]",
                            "[kda-gva2-lower_bound]", "test_captured_decode_gpu1.py::test_linattn_kda_decode"),
    "gdn_layers": ("[qwen3_next-gva2]", "[qwen3_5-gva2]", "test_captured_decode_gpu1.py::test_linattn_gdn_decode",
                   "test_captured_decode_gpu1.py::test_the_front_refill"),
    "chunk_gdn": ("test_gdn_direct_route_matches_reference", "test_gdn_direct_backward_is_refused",
                  "[chunk_gdn-", "test_gate_gradients_at_strong_decay"),
    "fused_recurrent": ("[fused_recurrent_",),
    # the engines' own kernels (test_engines_gpu1.py), which no fla test compiles: vLLM's, sglang's
    "vllm_engine": ("test_engines_gpu1.py::test_vllm_",),
    "sglang_engine": ("test_engines_gpu1.py::test_sglang_",),
}


def compile_group(nodeid: str) -> str:
    return next((group for group, ids in COMPILE_GROUPS.items() if any(i in nodeid for i in ids)), "other")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:  # the hook sees the whole session's items
            item.add_marker(pytest.mark.xdist_group(compile_group(item.nodeid)))
