"""The emulated delta-rule ops, their gates and l2norm against fla's own kernels, interpreted.

Every option the emulation accepts appears in at least one case (fidelity.py says how a case
runs and why the bound is 1e-4): chunk_kda and chunk_gated_delta_rule forward and backward,
fla's fused_recurrent ops forward (fla has no backward for them), the gate functions and l2norm
forward and backward. Packed cases hold a length-1 sequence, a full 16-token one and a partial
one; unpacked ones a batch of two. GVA: two value heads share one key head.
"""

import pytest
import torch

from fidelity import LOWER_BOUND, Case, check_case

CU = [0, 1, 17, 24]  # packed: lengths 1, 16, 7
BATCH = (2, 12)  # unpacked: B, T
H, HV, K, V = 1, 2, 16, 16

KDA, KDA_REC = "fla.ops.kda:chunk_kda", "fla.ops.kda:fused_recurrent_kda"
GDN, GDN_REC = "fla.ops.gated_delta_rule:chunk_gated_delta_rule", "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule"


def delta(kda=True, gate="decay", dt_bias=True, raw_beta=False, state=None, batch=None, beta=True, heads=(H, HV)):
    """q, k, v, g, beta (+ A_log, dt_bias for gate="raw"; + initial_state "kv" or "vk")."""
    B, T = batch or (1, CU[-1])
    N = B if batch else len(CU) - 1
    h, hv = heads
    g_shape = (B, T, hv, K) if kda else (B, T, hv)
    raw = "normal" if dt_bias else "raw_gate"
    t = {"q": ((B, T, h, K), "normal"), "k": ((B, T, h, K), "unit_vector"), "v": ((B, T, hv, V), "normal"),
         "g": (g_shape, {"decay": "logdecay", "raw": raw, "bounded": "bounded"}[gate]),
         "beta": ((B, T, hv), "normal" if raw_beta else "unit") if beta else None}
    if gate == "raw":
        t["A_log"] = ((hv,), "A_log")
        if dt_bias:
            t["dt_bias"] = ((hv * K,) if kda else (hv,), "dt_bias")
    if state:
        t["initial_state"] = ((N, hv, K, V) if state == "kv" else (N, hv, V, K), "normal")
    return t


def cpu_copy(cu):
    return cu.clone()


def chunk_indices(cu):
    """fla's precomputed per-chunk (sequence, chunk) index, which the emulation accepts and ignores."""
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu, 64)


CASES = {
    # --- chunk_kda
    "chunk_kda-decay-h0-l2norm-scale": Case(
        KDA, delta(state="kv"), dict(output_final_state=True, use_qk_l2norm_in_kernel=True, scale=0.3),
        cu_seqlens=CU, extra={"cu_seqlens_cpu": cpu_copy}),
    "chunk_kda-gate_in_kernel-beta_sigmoid-neg_eigval-v_first": Case(
        KDA, delta(gate="raw", raw_beta=True, state="vk"),
        dict(output_final_state=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
             state_v_first=True), cu_seqlens=CU),
    "chunk_kda-bounded_gate-safe_gate-unpacked-chunk32-old_layout_name": Case(
        KDA, delta(gate="raw", state="vk", batch=BATCH),
        dict(output_final_state=True, use_gate_in_kernel=True, lower_bound=-3.0, safe_gate=True, chunk_size=32,
             disable_recompute=True, transpose_state_layout=True)),
    "chunk_kda-bounded_gate_without_A_log-use_graph": Case(
        KDA, {**delta(gate="raw"), "A_log": None},
        dict(use_gate_in_kernel=True, lower_bound=LOWER_BOUND, use_qk_l2norm_in_kernel=True, use_graph=True,
             max_num_seqs=len(CU) - 1), cu_seqlens=CU),
    "chunk_kda-precomputed_safe_gate": Case(
        KDA, delta(gate="bounded"), dict(safe_gate=True, lower_bound=LOWER_BOUND), cu_seqlens=CU),
    # --- fused_recurrent_kda (forward)
    "fused_recurrent_kda-gate_in_kernel-beta_sigmoid-neg_eigval-v_first-l2norm-scale": Case(
        KDA_REC, delta(gate="raw", raw_beta=True, state="vk"),
        dict(output_final_state=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
             state_v_first=True, use_qk_l2norm_in_kernel=True, scale=0.3), cu_seqlens=CU, grads=False),
    "fused_recurrent_kda-bounded_gate_without_A_log-unpacked": Case(
        KDA_REC, {**delta(gate="raw", state="kv", batch=BATCH), "A_log": None},
        dict(output_final_state=True, use_gate_in_kernel=True, lower_bound=-2.0), grads=False),
    "fused_recurrent_kda-decay-h0": Case(
        KDA_REC, delta(state="kv"), dict(output_final_state=True), cu_seqlens=CU, grads=False),
    # --- chunk_gated_delta_rule
    "chunk_gdn-decay-h0-l2norm-scale-chunk_indices": Case(
        GDN, delta(kda=False, state="kv"), dict(output_final_state=True, use_qk_l2norm_in_kernel=True, scale=0.3),
        cu_seqlens=CU, extra={"cu_seqlens_cpu": cpu_copy, "chunk_indices": chunk_indices}),
    "chunk_gdn-gate_in_kernel-beta_sigmoid-neg_eigval-v_first-unpacked-chunk32": Case(
        GDN, delta(kda=False, gate="raw", raw_beta=True, state="vk", batch=BATCH),
        dict(output_final_state=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
             state_v_first=True, chunk_size=32)),
    "chunk_gdn_alias-gate_in_kernel_without_dt_bias": Case(
        "fla.ops.gated_delta_rule:chunk_gdn", delta(kda=False, gate="raw", dt_bias=False, state="kv"),
        dict(output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True), cu_seqlens=CU),
    # --- fused_recurrent_gated_delta_rule (forward)
    # beta=None without GVA: fla's default beta, ones_like(q[..., 0]), has the key heads' count, so
    # with more value heads its kernel reads past it (NaN); the emulation's is one per value head
    "fused_recurrent_gdn-g_and_gk-beta_none-h0-scale": Case(
        GDN_REC, {**delta(kda=False, state="kv", beta=False, heads=(HV, HV)), "gk": ((1, CU[-1], HV, K), "logdecay")},
        dict(output_final_state=True, scale=0.3), cu_seqlens=CU, grads=False),
    "fused_recurrent_gdn-gate_in_kernel_without_dt_bias-beta_sigmoid-neg_eigval-v_first-l2norm-unpacked": Case(
        GDN_REC, delta(kda=False, gate="raw", dt_bias=False, raw_beta=True, state="vk", batch=BATCH),
        dict(output_final_state=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
             state_v_first=True, use_qk_l2norm_in_kernel=True), grads=False),
    "fused_recurrent_gdn_alias-gk_only": Case(
        "fla.ops.gated_delta_rule:fused_recurrent_gdn",
        {**delta(kda=False), "g": None, "gk": ((1, CU[-1], HV, K), "logdecay")}, cu_seqlens=CU, grads=False),
    "fused_recurrent_gdn-no_decay": Case(GDN_REC, {**delta(kda=False), "g": None}, cu_seqlens=CU, grads=False),
    # --- gates and l2norm
    "fused_kda_gate": Case(
        "fla.ops.kda.gate:fused_kda_gate",
        {"g": ((1, CU[-1], HV, K), "normal"), "A_log": ((HV,), "A_log"), "dt_bias": ((HV * K,), "dt_bias")}),
    "fused_kda_gate-lower_bound": Case(
        "fla.ops.kda.gate:fused_kda_gate",
        {"g": ((1, CU[-1], HV, K), "normal"), "A_log": ((HV,), "A_log"), "dt_bias": ((HV * K,), "dt_bias")},
        dict(lower_bound=LOWER_BOUND)),
    "fused_kda_gate-lower_bound_without_A_log-no_dt_bias-output_dtype": Case(
        "fla.ops.kda.gate:fused_kda_gate", {"g": ((1, CU[-1], HV, K), "normal")},
        dict(lower_bound=-2.0, output_dtype=torch.float32)),
    "fused_gdn_gate": Case(
        "fla.ops.gated_delta_rule.gate:fused_gdn_gate",
        {"g": ((1, CU[-1], HV), "normal"), "A_log": ((HV,), "A_log"), "dt_bias": ((HV,), "dt_bias")}),
    "fused_gdn_gate-no_dt_bias": Case(
        "fla.ops.gated_delta_rule.gate:fused_gdn_gate", {"g": ((1, CU[-1], HV), "raw_gate"), "A_log": ((HV,), "A_log")}),
    "l2norm-eps-output_dtype": Case(
        "fla.modules.norm.l2norm:l2norm", {"x": ((1, CU[-1], HV, K), "normal")},
        dict(eps=1e-5, output_dtype=torch.float32)),
    "l2_norm_alias": Case("fla.modules.norm.l2norm:l2_norm", {"x": ((1, CU[-1], HV, K), "normal")}),
}


@pytest.mark.parametrize("name", CASES)
def test_emulated_op_matches_fla_interpreted(name):
    check_case(CASES, name, 3000)
