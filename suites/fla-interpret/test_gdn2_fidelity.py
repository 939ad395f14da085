"""The emulated GDN-2 entries against fla's own kernels, interpreted, bound fidelity.RTOL.

chunk_gdn2: one packed case (a length-1 sequence, initial and final states, the in-kernel l2norm,
a scale), forward and backward. fused_recurrent_gdn2 (fla's has no backward: forward only): a
packed GVA case (two value heads read one key head) with the in-kernel gate and states.
"""

import pytest

from fidelity import Case, check_case

CU = [0, 1, 17, 24]
T, N, H, K, V = CU[-1], len(CU) - 1, 2, 16, 16

CASES = {
    "chunk_gdn2": Case(
        "fla.ops.gdn2:chunk_gdn2",
        {"q": ((1, T, H, K), "normal"), "k": ((1, T, H, K), "unit_vector"), "v": ((1, T, H, V), "normal"),
         "g": ((1, T, H, K), "logdecay"), "b": ((1, T, H, K), "unit"), "w": ((1, T, H, V), "unit"),
         "initial_state": ((N, H, K, V), "normal")},
        dict(scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True), cu_seqlens=CU),
    "fused_recurrent_gdn2": Case(
        "fla.ops.gdn2:fused_recurrent_gdn2",
        {"q": ((1, T, 1, K), "normal"), "k": ((1, T, 1, K), "unit_vector"), "v": ((1, T, H, V), "normal"),
         "g": ((1, T, H, K), "raw_gate"), "b": ((1, T, H, K), "unit"), "w": ((1, T, H, V), "unit"),
         "A_log": ((H,), "A_log"), "initial_state": ((N, H, K, V), "normal")},
        dict(output_final_state=True, use_gate_in_kernel=True), cu_seqlens=CU, grads=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gdn2_matches_fla_interpreted(name):
    check_case(CASES, name, first_seed=4200)
