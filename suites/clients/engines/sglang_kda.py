"""sglang 0.5.23's KDA (Kimi Linear) serving kernels on a state pool, for
`pytest_linattn.harness.assert_state_pool_parity`: linattn's KDA layer (projections, gate
projections, output norm) whose short conv and recurrence run on sglang's own kernels, called as
sglang's `KDAAttnBackend` calls them (sglang/srt/layers/attention/linear/kda_backend.py) through
its Triton kernel set (`TritonKDAKernel`, srt/layers/attention/linear/kernels/kda_triton.py):

- prefill (`forward_extend`, kda_backend.py:1043-1160): `causal_conv1d_fn` on the conv pool with
  `cache_indices` and `has_initial_state` (`_convolve_prefill`, :1031), then `chunk_kda` with
  `initial_state_indices` = the slots, reading and writing the pool in place, the gate and beta
  in the kernel (`A_log`, `dt_bias`, `lower_bound`, `beta_is_raw=True`; kda_triton.py:223-275);
  a newly allocated slot zeroed first (`MambaPool.clear_slots`: the GDN client's
  `sglang_pool_prefill`, the same glue);
- decode (`forward_decode`, :770-1000): `causal_conv1d_update` with `conv_state_indices`
  (:955-962), then `fused_recurrent_kda_packed_decode` on the packed conv output (the packed
  path, :964-990; kda_triton.py:37-127) or, where the packed path is off (sglang's CPU / NPU /
  XPU fallback), `fused_sigmoid_gating_delta_rule_update(is_kda=True)` (kda_triton.py:129-160).
  Padding rows at PAD_SLOT_ID = -1, which the kernels skip;
- speculative decoding (`clients.engines.sglang_gdn.sglang_spec_path` on a KDA config): target_verify
  as `_forward_target_verify` runs its reference kernels (kda_backend.py:1394-1450): the conv update
  with every token's window saved (the window buffer transposed as the pool), then
  `fused_sigmoid_gating_delta_rule_update(is_kda=True)` into intermediate state buffers, the slot
  left as it was; accepting copies the accepted step into the slot.

The pool is in sglang's KDA layout: the conv state `[W-1, dim]` per slot ("The KDA pool stores
conv states as [kernel-1, dim]", kda_backend.py:1094; the kernels get it transposed, as
`mamba_cache_params.conv[0].transpose(-1, -2)` at :1083), the recurrent state `[HV, dv, dk]`
(the engines' layout, `clients.engines.layout`). linattn's layer adds dt_bias to the gate
projection before the kernel, so the kernels get that sum as the raw gate and a zero dt_bias
(as `clients.engines.vllm_kda`). sglang's chunk kernels use `tl.make_block_ptr`, which Triton 3.9
removed: they run compiled on a GPU (Triton 3.6), not under this CPU's interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cases.layer_parity import linattn_layer
from clients.engines.layout import engine_shard_state, engine_unshard_state
from clients.engines.loader import load_sglang
from clients.engines.sglang_gdn import (FLA_OPS, GATING_OPS, PAD_SLOT_ID, sglang_pool_decode, sglang_pool_prefill,
                                        sglang_short_conv)
from linattn.layers import KimiDeltaAttention, LayerState
from pytest_linattn.harness import StatePoolPath

__all__ = ["SglangKDA", "kda_pool_reference_forward", "sglang_kda_pool_path"]


def _kda_pool_layout(state) -> LayerState:
    """The engines' state (conv `[dim, W-1]`) in sglang's KDA pool layout (conv `[W-1, dim]`) and
    back: the transpose is its own inverse."""
    return LayerState(state.conv.transpose(-1, -2).contiguous(), state.recurrent)


def kda_pool_reference_forward(reference, x, cu_seqlens, state):
    """The reference layer with its states in sglang's KDA pool layout."""
    from clients.engines.layout import engine_reference_forward

    y, final = engine_reference_forward(reference, x, cu_seqlens, None if state is None else _kda_pool_layout(state))
    return y, _kda_pool_layout(final)


def _shard(config, state, placement, tp_rank):
    return _kda_pool_layout(engine_shard_state(config, _kda_pool_layout(state), placement, tp_rank))


def _unshard(config, states, placement):
    return _kda_pool_layout(engine_unshard_state(config, [_kda_pool_layout(s) for s in states], placement))


class SglangKDA(KimiDeltaAttention):
    """linattn's KDA layer whose conv and recurrence run on sglang's kernels, on the pool of the call
    in progress (`pool_call`, as `clients.engines.sglang_gdn`'s). decode_kernel: "packed" (sglang's
    CUDA default) or "fused_sigmoid_gating" (its fallback)."""

    pool_call = None
    decode_kernel = "packed"

    def _fuses_gate(self, x, cp_context):
        return self.pool_call is not None

    def _short_conv(self, xs, weights, cu_seqlens, cp_context=None, carry=None):
        if self.pool_call is None or cp_context is not None:
            raise ValueError("SglangKDA runs in a pool call only (sglang_pool_prefill / sglang_pool_decode), "
                             "without CP")
        # kda_backend.py:1083: the kernels get the [W-1, dim] pool as a [dim, W-1] view
        return sglang_short_conv(self.pool_call, xs, weights, cu_seqlens, conv_view=lambda t: t.transpose(-1, -2))

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        call = self.pool_call
        scale = self.config.head_k_dim ** -0.5
        A_log = gate["A_log"].reshape(-1).contiguous()
        zero_bias = torch.zeros_like(g[0, 0]).reshape(-1)  # dt_bias is in g already (module docstring)
        if call.kind == "decode" and self.decode_kernel == "packed":
            recurrent = load_sglang(f"{FLA_OPS}.fused_recurrent")
            out = q.new_empty(q.shape[1], 1, v.shape[2], v.shape[3])
            recurrent.fused_recurrent_kda_packed_decode(
                mixed_qkv=call.mixed.contiguous(), a=g[0].reshape(q.shape[1], -1).contiguous(),
                b=beta[0].contiguous(), A_log=A_log, dt_bias=zero_bias, scale=scale,
                initial_state=call.pool.recurrent, out=out, ssm_state_indices=call.slots,
                use_qk_l2norm_in_kernel=True, lower_bound=gate["lower_bound"])
            return out.transpose(0, 1)
        if call.kind in ("decode", "verify"):  # verify: kda_triton.py:162-220, target_verify
            gating = load_sglang(GATING_OPS)
            verify = {} if call.kind == "decode" else dict(
                disable_state_update=True, intermediate_states_buffer=call.buffers[1],
                intermediate_state_indices=call.rows, cache_steps=call.steps)
            return gating.fused_sigmoid_gating_delta_rule_update(
                A_log=A_log, a=g.contiguous(), dt_bias=zero_bias, softplus_beta=1.0, softplus_threshold=20.0,
                q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), b=beta.contiguous(),
                initial_state_source=call.pool.recurrent, initial_state_indices=call.slots, scale=scale,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.to(torch.int32), is_kda=True,
                lower_bound=gate["lower_bound"], **verify)
        kda = load_sglang(f"{FLA_OPS}.kda")
        return kda.chunk_kda(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous().clone(), g=g.contiguous(), beta=beta.contiguous(),
            scale=scale, initial_state=call.pool.recurrent, initial_state_indices=call.slots,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.to(torch.int32), A_log=A_log, dt_bias=zero_bias,
            lower_bound=gate["lower_bound"], beta_is_raw=True)


def _build(config, decode_kernel, placement, groups, dtype, device):
    tp_group, _ = groups
    module = SglangKDA(config, tp_group=tp_group, dtype=dtype, device=device)
    module.decode_kernel = decode_kernel
    return module


def sglang_kda_pool_path(config, decode_kernel="packed", prefill=sglang_pool_prefill,
                         decode=sglang_pool_decode) -> StatePoolPath:
    """SglangKDA for a KDA `config`, its decode on `decode_kernel` ("packed" or
    "fused_sigmoid_gating"), with sglang's slot conventions (padding rows at -1) and its KDA pool
    layout (`kda_pool_reference_forward` gives the reference's states so)."""
    if decode_kernel not in ("packed", "fused_sigmoid_gating"):
        raise ValueError(f"decode_kernel must be 'packed' or 'fused_sigmoid_gating', got {decode_kernel!r}")
    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(_build, config, decode_kernel))
    return StatePoolPath(layer, prefill=prefill, decode=decode, padding_slot=PAD_SLOT_ID,
                         shard_state=functools.partial(_shard, config), unshard_state=functools.partial(_unshard, config))
