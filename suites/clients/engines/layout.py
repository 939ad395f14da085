"""The engines' state layout: both vLLM and sglang keep a slot's recurrent state as `[HV, dv, dk]`
(vLLM third_party/flash_linear_attention/ops/fused_recurrent.py:119, sglang
kernels/ops/attention/fla/fused_recurrent.py), the transpose of linattn's `[HV, dk, dv]`; the conv
state as linattn does, `[dim, W-1]`. The engine clients' pools are in the engines' layout, and the
reference's states are given so (`engine_reference_forward`, the harness's reference_forward).
`call_with_pool`: how every engine client hands a call's pool and slots to its layer's kernels;
`gdn_packed_decode`: the GDN packed decode both engines carry with fla's signature."""

from __future__ import annotations

import types

from linattn.layers import LayerState, shard_layer_state, unshard_layer_state

__all__ = ["call_with_pool", "engine_reference_forward", "gdn_packed_decode", "engine_shard_state", "engine_unshard_state",
           "from_engine_state", "to_engine_state"]


def to_engine_state(state) -> LayerState:
    """linattn's LayerState in the engines' layout (recurrent `[.., dv, dk]`)."""
    return LayerState(state.conv, state.recurrent.transpose(-1, -2).contiguous())


def from_engine_state(state) -> LayerState:
    return LayerState(state.conv, state.recurrent.transpose(-1, -2).contiguous())


def engine_reference_forward(reference, x, cu_seqlens, state):
    """The reference layer with its states in the engines' layout."""
    y, final = reference(x, cu_seqlens, None if state is None else from_engine_state(state), output_final_state=True)
    return y, to_engine_state(final)


def engine_shard_state(config, state, placement, tp_rank) -> LayerState:
    """The TP rank's part of a state in the engines' layout (`config` the replicated layer's): its
    heads, as linattn's layer shards its own (`linattn.layers.shard_layer_state`)."""
    return to_engine_state(shard_layer_state(from_engine_state(state), config, tp_rank, placement.tp))


def engine_unshard_state(config, states, placement) -> LayerState:
    return to_engine_state(unshard_layer_state([from_engine_state(s) for s in states], config))


def call_with_pool(module, x, cu_seqlens, **call):
    """module(x, cu_seqlens) with `module.pool_call` set to this call (its kind, pool, slots, ...), which
    the layer's conv and recurrence read, and cleared after."""
    module.pool_call = types.SimpleNamespace(**call)
    try:
        return module(x, cu_seqlens)
    finally:
        module.pool_call = None


def gdn_packed_decode(recurrent, call, q, v, g, beta, gate, scale):
    """One token per row through an engine's `fused_recurrent_gated_delta_rule_packed_decode`
    (`recurrent`: the vLLM or sglang module holding it; both keep fla's signature) on the call's
    packed conv output, its pool's recurrent state updated in place: `[1, B, HV, dv]`. g, beta:
    the gate and beta projections a, b (the kernel computes the gate and beta from them)."""
    out = q.new_empty(q.shape[1], 1, v.shape[2], v.shape[3])
    recurrent.fused_recurrent_gated_delta_rule_packed_decode(
        mixed_qkv=call.mixed.contiguous(), a=g[0].contiguous(), b=beta[0].contiguous(), A_log=gate["A_log"],
        dt_bias=gate["dt_bias"], scale=scale, initial_state=call.pool.recurrent, out=out,
        ssm_state_indices=call.slots, use_qk_l2norm_in_kernel=True)
    return out.transpose(0, 1)
