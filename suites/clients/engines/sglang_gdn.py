"""sglang 0.5.23's GDN serving kernels on a state pool, for `pytest_linattn.harness.assert_state_pool_parity`:
linattn's Gated DeltaNet layer (projections, gate, output norm) whose short conv and recurrence
run on sglang's own kernels (the pinned release's files, `clients.engines.loader`), called as
sglang's GDN backend calls them (sglang/srt/layers/attention/linear/gdn_backend.py) with its
conventions: no reserved slot, padding rows at PAD_SLOT_ID = -1, which the kernels skip; a newly
allocated slot zeroed before the batch runs (`MambaPool.clear_slots`,
srt/mem_cache/memory_pool.py:1147-1161, on `mamba_needs_clear`: srt/managers/schedule_batch.py:3251).

- prefill: `causal_conv1d_fn` on the conv pool with `cache_indices` = the slots and
  `has_initial_state` = not fresh (gdn_backend.py:929-939); the recurrence reads and writes the
  slots itself, either
  - "recurrent": `fused_recurrent_gated_delta_rule_update` with `initial_state_indices` over
    the packed chunks (kernels/ops/attention/fla/fused_recurrent.py:1211, as sglang's
    JetNemotron layer calls it for extend and decode, srt/models/jet_nemotron.py:316-326), or
  - "chunk": `chunk_gated_delta_rule` with `initial_state_indices`, in place (the Qwen3-Next
    extend, srt/layers/attention/linear/kernels/gdn_triton.py:169-213; it refuses float32, so
    its autograd Function is called with the same arguments). Its kernels use
    `tl.make_block_ptr`, which Triton 3.9 removed: not on this CPU's Triton;
- decode: `causal_conv1d_update` with `conv_state_indices` (gdn_backend.py:855-862), then
  `fused_sigmoid_gating_delta_rule_update` with `initial_state_indices`, the gate and beta in the
  kernel (gdn_triton.py:138-167, TritonGDNKernel.decode), or (`decode_kernel="packed"`)
  `fused_recurrent_gated_delta_rule_packed_decode` on the packed conv output
  (TritonGDNKernel.packed_decode, gdn_triton.py:121-136).

The pool is in the engines' layout (`clients.engines.layout`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cases.layer_parity import linattn_layer
from clients.engines.layout import call_with_pool, gdn_packed_decode
from clients.engines.loader import load_sglang
from linattn.layers import GatedDeltaNet
from pytest_linattn.harness import SpecDecodePath, StatePoolPath

__all__ = ["SglangGDN", "chunk_unavailable_reason", "sglang_accept", "sglang_short_conv", "sglang_pool_decode", "sglang_pool_path",
           "sglang_pool_prefill", "sglang_spec_path", "sglang_verify"]

FLA_OPS = "sglang.kernels.ops.attention.fla"
CONV_OPS = "sglang.kernels.ops.mamba.causal_conv1d_triton"
GATING_OPS = "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent"
PAD_SLOT_ID = -1


def sglang_short_conv(call, xs, weights, cu_seqlens, conv_view=None):
    """The short conv of a pool call on sglang's kernels over the q | k | v blocks `xs` (`[1, T, D_i]`)
    with their weights, the call's conv pool and window buffer as `conv_view` hands them to the kernels
    (`[slots, dim, W-1]`; KDA's pool is `[slots, W-1, dim]`, given transposed): `causal_conv1d_fn`
    (prefill), `causal_conv1d_update` (decode; verify with every token's window saved). Keeps the
    packed output on the call (the packed decodes read it)."""
    view = conv_view or (lambda t: t)
    conv_states = view(call.pool.conv)
    conv = load_sglang(CONV_OPS)
    mixed = torch.cat(xs, dim=-1)[0]
    weight = torch.cat(weights, dim=0)
    if call.kind == "prefill":
        y = conv.causal_conv1d_fn(mixed.transpose(0, 1), weight, None, conv_states=conv_states,
                                  query_start_loc=cu_seqlens.to(torch.int32), seq_lens_cpu=cu_seqlens.diff().tolist(),
                                  cache_indices=call.slots, has_initial_state=call.has_initial_state,
                                  activation="silu", pad_slot_id=PAD_SLOT_ID).transpose(0, 1)
    elif call.kind == "decode":
        y = conv.causal_conv1d_update(mixed, conv_states, weight, None, "silu", conv_state_indices=call.slots,
                                      pad_slot_id=PAD_SLOT_ID)
    else:  # verify: [N, dim, 1 + K], every token's window saved
        rows = mixed.view(call.slots.shape[0], call.steps, -1).transpose(1, 2)
        y = conv.causal_conv1d_update(rows, conv_states, weight, None, "silu", conv_state_indices=call.slots,
                                      intermediate_conv_window=view(call.buffers[0]), intermediate_state_indices=call.rows,
                                      pad_slot_id=PAD_SLOT_ID).transpose(1, 2).reshape(mixed.shape)
    call.mixed = y
    return list(y.unsqueeze(0).split([x.shape[-1] for x in xs], dim=-1))


class SglangGDN(GatedDeltaNet):
    """linattn's GDN layer whose conv and recurrence run on sglang's kernels, on the pool of the
    call in progress (`pool_call`)."""

    pool_call = None
    prefill_recurrence = "recurrent"  # or "chunk" (module docstring)
    decode_kernel = "fused_sigmoid_gating"  # or "packed"

    def _fuses_gate(self, x, cp_context):
        return self.pool_call is not None and self.pool_call.kind in ("decode", "verify")

    def _short_conv(self, xs, weights, cu_seqlens, cp_context=None, carry=None):
        if self.pool_call is None or cp_context is not None:
            raise ValueError("SglangGDN runs in a pool call only (sglang_pool_prefill / sglang_pool_decode), "
                             "without CP")
        return sglang_short_conv(self.pool_call, xs, weights, cu_seqlens)

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        call = self.pool_call
        scale = self.config.head_k_dim ** -0.5
        q, k, v = (t.contiguous() for t in (q, k, v))
        cu = cu_seqlens.to(torch.int32)
        if call.kind == "decode" and self.decode_kernel == "packed":  # g, beta: the projections a, b
            return gdn_packed_decode(load_sglang(f"{FLA_OPS}.fused_recurrent"), call, q, v, g, beta, gate, scale)
        if call.kind in ("decode", "verify"):  # g, beta: the projections a, b
            gating = load_sglang(GATING_OPS)
            verify = {} if call.kind == "decode" else dict(
                disable_state_update=True, intermediate_states_buffer=call.buffers[1],
                intermediate_state_indices=call.rows, cache_steps=call.steps)
            return gating.fused_sigmoid_gating_delta_rule_update(
                A_log=gate["A_log"], dt_bias=gate["dt_bias"], q=q, k=k, v=v, a=g[0].contiguous(),
                b=beta[0].contiguous(), initial_state_source=call.pool.recurrent, initial_state_indices=call.slots,
                scale=scale, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0,
                **verify)
        g, beta = g.float().contiguous(), beta.float().contiguous()
        if self.prefill_recurrence == "chunk":
            chunk = load_sglang(f"{FLA_OPS}.chunk")
            o, _ = chunk.ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, call.pool.recurrent, call.slots,
                                                           cu, True, True)
            return o
        recurrent = load_sglang(f"{FLA_OPS}.fused_recurrent")
        return recurrent.fused_recurrent_gated_delta_rule_update(
            q, k, v, g, beta, scale=scale, initial_state_source=call.pool.recurrent, initial_state_indices=call.slots,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


def sglang_pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement):
    """One chunk of each sequence from its slot, a fresh sequence's slot zeroed first (sglang's
    clear_slots on a newly allocated slot)."""
    fresh = fresh.to(slots.device)
    for f in pool:
        f.index_fill_(0, slots[fresh], 0)
    return call_with_pool(module, x, cu_seqlens, kind="prefill", pool=pool, slots=slots.to(torch.int32),
                          has_initial_state=~fresh)


def sglang_pool_decode(module, x, pool, slots, num_valid, placement):
    """Every row of the padded batch in one call, one token each; padding rows at PAD_SLOT_ID."""
    return call_with_pool(module, x, torch.arange(x.shape[1] + 1, dtype=torch.int32),
                          kind="decode", pool=pool, slots=slots.to(torch.int32))


def _build(config, prefill_recurrence, decode_kernel, placement, groups, dtype, device):
    tp_group, _ = groups
    module = SglangGDN(config, tp_group=tp_group, dtype=dtype, device=device)
    module.prefill_recurrence, module.decode_kernel = prefill_recurrence, decode_kernel
    return module


def sglang_pool_path(config, prefill_recurrence="recurrent", decode_kernel="fused_sigmoid_gating",
                     prefill=sglang_pool_prefill, decode=sglang_pool_decode) -> StatePoolPath:
    """SglangGDN for a GDN `config` (TP 1), its prefill recurrence and decode kernel as named (the
    module docstring), with sglang's slot conventions: padding rows at -1."""
    if prefill_recurrence not in ("recurrent", "chunk"):
        raise ValueError(f"prefill_recurrence must be 'recurrent' or 'chunk', got {prefill_recurrence!r}")
    if decode_kernel not in ("fused_sigmoid_gating", "packed"):
        raise ValueError(f"decode_kernel must be 'fused_sigmoid_gating' or 'packed', got {decode_kernel!r}")
    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(_build, config, prefill_recurrence,
                                                                                 decode_kernel))
    return StatePoolPath(layer, prefill=prefill, decode=decode, padding_slot=PAD_SLOT_ID)


def chunk_unavailable_reason() -> str | None:
    """Why sglang's chunk kernels cannot run with this Triton (None where they can): they build
    block pointers (fla/chunk_delta_h.py, chunk_o.py, cumsum.py, wy_fast.py, l2norm.py, ...), which
    Triton 3.9 removed (`tl.make_block_ptr` raises NotImplementedError, at the language level)."""
    import triton
    import triton.language as tl

    if "removed" in (getattr(tl.make_block_ptr, "__doc__", None) or ""):
        return (f"sglang 0.5.23's chunk kernels (kernels/ops/attention/fla/chunk_delta_h.py and the rest) use "
                f"tl.make_block_ptr, which Triton {triton.__version__} removed")
    return None


# ---- speculative decoding: sglang's target_verify (EAGLE chain) ----
#
# A verify call runs each sequence's last accepted token and K drafts (draft_token_num = 1 + K)
# from its slot: the conv update saves the window after every token in an intermediate buffer
# (`intermediate_conv_window`, causal_conv1d_triton.py:980-994; it also shifts the slot's own
# window), the recurrence the state after every token (`intermediate_states_buffer`, without
# updating the slot: `disable_state_update`) (gdn_backend.py:1041-1059 and :1138-1162). Accepting
# copies the buffers' step accept_len - 1 into the slot (`scatter_mamba_states_after_mtp_verify`,
# kernels/ops/mamba/mamba_state_scatter_triton.py:781, from
# srt/layers/attention/hybrid_linear_attn_backend.py:1514; its fused scatter kernels run on CUDA,
# so torch indexing does it here). The buffers have one row per request of the call.


def sglang_verify(module, x, cu_seqlens, pool, slots, placement):
    """1 + K tokens of each sequence from its slot, each token's states kept in the buffers."""
    N, steps = slots.shape[0], x.shape[1] // slots.shape[0]
    module.verify_buffers = (pool.conv.new_zeros((N, steps) + tuple(pool.conv.shape[1:])),
                             pool.recurrent.new_zeros((N, steps) + tuple(pool.recurrent.shape[1:])))
    return call_with_pool(module, x, cu_seqlens, kind="verify", pool=pool, slots=slots.to(torch.int32), steps=steps,
                          rows=torch.arange(N, dtype=torch.int32, device=slots.device), buffers=module.verify_buffers)


def sglang_accept(module, pool, slots, num_accepted_tokens, placement):
    """Each slot takes its request's buffered states at step accept_len - 1."""
    rows = torch.arange(slots.shape[0], device=slots.device)
    for f, buffer in zip(pool, module.verify_buffers):
        f[slots] = buffer[rows, num_accepted_tokens - 1]
    module.verify_buffers = None


def sglang_spec_path(config, accept=sglang_accept) -> SpecDecodePath:
    """SglangGDN (SglangKDA for a KDA config, its pool in sglang's KDA layout) with sglang's
    target_verify and accept (a slot per sequence, the last accepted token first in every verify
    call; a planted bug replaces accept)."""
    if config.op == "kda":
        from clients.engines.sglang_kda import _build as build_kda

        layer = dataclasses.replace(linattn_layer(config), build=functools.partial(build_kda, config, "packed"))
        return SpecDecodePath(layer, prefill=sglang_pool_prefill, verify=sglang_verify, accept=accept,
                              bonus_token=True)
    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(_build, config, "recurrent",
                                                                                 "fused_sigmoid_gating"))
    return SpecDecodePath(layer, prefill=sglang_pool_prefill, verify=sglang_verify, accept=accept,
                          bonus_token=True)
