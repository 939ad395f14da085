"""vLLM 0.33.0's KDA (Kimi Linear) serving kernels on a state pool, for
`pytest_linattn.harness.assert_state_pool_parity`: linattn's KDA layer (projections, gate
projections, output norm) whose short conv and recurrence run on vLLM's own kernels, called as
vLLM's `KimiGatedDeltaNetAttention._forward` calls them
(vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py:380-625), the gate and beta
activations inside the kernels (raw gate, raw beta, A_log, the lower bound):

- prefill: `causal_conv1d_fn` on the conv pool with `cache_indices` and `has_initial_state`
  (:543-562: vLLM calls it once per q, k, v block on views of one conv state, here once over the
  three blocks: a depthwise conv, the same per channel), then `chunk_kda_with_fused_gate`
  (models/kimi_k3/nvidia/ops/third_party/kda/chunk.py:681) from the slots' states gathered, a
  fresh sequence's zero (:570-574; vLLM's gather_initial_states kernel asserts CUDA, so torch
  indexing does it), the final states written back (:578-593);
- decode: `causal_conv1d_update` with `conv_state_indices` (:600-616), then
  `fused_recurrent_kda_packed_decode` on the packed conv output with `state_indices`, in place
  (:618-627; kda/fused_recurrent.py:582). Padding rows at the null block, slot 0 (skipped; their
  output is zero);
- speculative decoding (`clients.engines.vllm_gdn.vllm_spec_path` on a KDA config): the conv
  update with num_accepted_tokens as GDN's, then `fused_recurrent_kda` with the rows' slots
  `[N, 1 + K]` and num_accepted_tokens (:489-527).

linattn's layer adds dt_bias to the gate projection before the kernel (its float32 projection
with bias), so the kernels get that sum as the raw gate and a zero dt_bias. The pool is in the
engines' layout (`clients.engines.layout`); slot 0 is reserved.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cases.layer_parity import linattn_layer
from clients.engines.loader import load_vllm
from clients.engines.vllm_gdn import NULL_BLOCK_ID, vllm_short_conv
from linattn.layers import KimiDeltaAttention
from pytest_linattn.harness import StatePoolPath

__all__ = ["VllmKDA", "vllm_kda_pool_path"]

KDA_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"


class VllmKDA(KimiDeltaAttention):
    """linattn's KDA layer whose conv and recurrence run on vLLM's kernels, on the pool of the call
    in progress (`pool_call`, as `clients.engines.vllm_gdn`'s)."""

    pool_call = None

    def _fuses_gate(self, x, cp_context):
        return self.pool_call is not None

    def _short_conv(self, xs, weights, cu_seqlens, cp_context=None, carry=None):
        if self.pool_call is None or cp_context is not None:
            raise ValueError("VllmKDA runs in a pool call only (vllm_pool_prefill / vllm_pool_decode / "
                             "vllm_row_verify), without CP")
        return vllm_short_conv(self.pool_call, xs, weights, cu_seqlens)

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        call = self.pool_call
        kda = load_vllm(KDA_OPS)
        zero_bias = torch.zeros_like(g[0, 0]).reshape(-1)  # dt_bias is in g already (module docstring)
        if call.kind == "verify":  # kimi_gdn_linear_attn.py:513-527, the rows' slots `[N, 1 + K]`
            # q, k and v as the layer hands them: views of one fused qkv (the kernel asserts one token
            # stride for the three, fused_recurrent.py:358; with head_v_dim != head_k_dim only views pass)
            mixed = torch.cat([t.flatten(2) for t in (q, k, v)], -1)
            ends = torch.tensor([0, q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()]).cumsum(0).tolist()
            q, k, v = (mixed[..., a:b].unflatten(-1, t.shape[2:]) for a, b, t in zip(ends, ends[1:], (q, k, v)))
            o, _ = kda.fused_recurrent_kda(
                q=q, k=k, v=v, raw_g=g.contiguous(), raw_beta=beta.contiguous(),
                A_log=gate["A_log"].reshape(-1).contiguous(), dt_bias=zero_bias, lower_bound=gate["lower_bound"],
                initial_state=call.pool.recurrent, cu_seqlens=cu_seqlens.to(torch.int32), ssm_state_indices=call.slots,
                num_accepted_tokens=call.num_accepted)
            return o
        if call.kind == "decode":
            o, _ = kda.fused_recurrent_kda_packed_decode(
                mixed_qkv=call.mixed.contiguous(), raw_g=g.contiguous(), raw_beta=beta.contiguous(),
                A_log=gate["A_log"].reshape(-1).contiguous(), dt_bias=zero_bias, lower_bound=gate["lower_bound"],
                initial_state=call.pool.recurrent, state_indices=call.slots)
            return o.view(1, q.shape[1], *o.shape[-2:])
        initial = call.pool.recurrent[call.slots.long()]
        initial[~call.has_initial_state] = 0
        o, final = kda.chunk_kda_with_fused_gate(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), raw_g=g.contiguous(), raw_beta=beta.contiguous(),
            A_log=gate["A_log"].reshape(-1).contiguous(), g_bias=None, lower_bound=gate["lower_bound"],
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens.to(torch.int32))
        call.pool.recurrent[call.slots.long()] = final.to(call.pool.recurrent.dtype)
        return o


def _build(config, placement, groups, dtype, device):
    tp_group, _ = groups
    return VllmKDA(config, tp_group=tp_group, dtype=dtype, device=device)


def vllm_kda_pool_path(config) -> StatePoolPath:
    """VllmKDA for a KDA `config` (TP 1) through the GDN client's prefill and decode calls, with
    vLLM's slot conventions (slot 0 reserved, the padding rows' slot)."""
    from clients.engines.vllm_gdn import vllm_pool_decode, vllm_pool_prefill

    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(_build, config))
    return StatePoolPath(layer, prefill=vllm_pool_prefill, decode=vllm_pool_decode, padding_slot=NULL_BLOCK_ID,
                         reserved_slots=(NULL_BLOCK_ID,))
