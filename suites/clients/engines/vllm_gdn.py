"""vLLM 0.33.0's GDN serving path on a state pool, for `pytest_linattn.harness.assert_state_pool_parity`:
linattn's Gated DeltaNet layer (its projections, gate, output norm) whose short conv and
recurrence run on vLLM's own kernels (the pinned release's files, `clients.engines.loader`), called
as vLLM's `QwenGatedDeltaNetAttention._forward_core` calls them
(vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:1556-1910):

- prefill: `causal_conv1d_fn` on the conv pool with `cache_indices` = the slots and
  `has_initial_state` = not fresh (:1665-1678; the conv metadata as
  vllm/v1/attention/backends/utils.py:1117 `compute_causal_conv1d_metadata` builds it), then the
  chunked recurrence from the slots' states gathered, a fresh sequence's zeroed, and the final
  states scattered back (:1813-1872). vLLM's `chunk_gated_delta_rule` refuses float32
  (third_party/flash_linear_attention/ops/chunk.py:213), so its autograd Function is called, with
  the same arguments;
- decode: `causal_conv1d_update` with `conv_state_indices` (:1680-1690), then
  `fused_sigmoid_gating_delta_rule_update` with `ssm_state_indices`, the gate and beta computed in
  the kernel, the state updated in place (:1877-1897). Padding rows point at the null block,
  slot 0 (vllm/v1/attention/backends/gdn_attn.py:655-671), which both kernels skip. Or the
  decode-only fast path (`decode_kernel="packed"`, :1981-2031): the same conv update, then
  `fused_recurrent_gated_delta_rule_packed_decode` on the packed conv output;
- speculative decoding (`vllm_spec_path`, below): a verify call of the next token and K drafts
  with `[N, 1 + K]` state indices and `num_accepted_tokens` (:1642-1657, :1757-1777).

The pool is in vLLM's layout (`clients.engines.layout`: recurrent `[slots, HV, dv, dk]`, the
reference's states given so by `engine_reference_forward`). Slot 0 is vLLM's null block:
reserved, never a sequence's.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import torch

from cases.layer_parity import linattn_layer
from clients.engines.loader import load_vllm
from clients.engines.layout import (call_with_pool, engine_reference_forward, engine_shard_state, engine_unshard_state,
                                     gdn_packed_decode)
from clients.spec_decode import current_slots, num_accepted, row_accept, row_prefill_slots
from linattn.layers import GatedDeltaNet, LayerState
from pytest_linattn.harness import SpecDecodePath, StatePoolPath

__all__ = ["VllmGDN", "conv_metadata", "spec_reference_forward", "vllm_pool_decode", "vllm_pool_path",
           "vllm_pool_capture", "vllm_pool_prefill", "vllm_prefix_prefill", "vllm_row_prefill", "vllm_row_state", "vllm_row_verify", "vllm_short_conv",
           "vllm_spec_path"]

FLA_OPS = "vllm.third_party.flash_linear_attention.ops"
CONV_OPS = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
NULL_BLOCK_ID = 0  # vllm/v1/attention/backends/utils.py:55


def conv_metadata(query_start_loc: torch.Tensor):
    """What vllm/v1/attention/backends/utils.py:1117 `compute_causal_conv1d_metadata` gives
    `causal_conv1d_fn` (BLOCK_M 8): the programs' sequence and chunk, padded with PAD_SLOT_ID."""
    block_m, pad = 8, -1
    nums = -(-query_start_loc.diff().cpu() // block_m)
    mlist = torch.repeat_interleave(torch.arange(len(nums)), nums).to(torch.int32)
    offsets = torch.cat([torch.arange(int(n)) for n in nums]).to(torch.int32)
    size = max(1024, len(mlist)) * 2
    batch_ptr = torch.full((size,), pad, dtype=torch.int32, device=query_start_loc.device)
    chunk_ptr = torch.full((size,), pad, dtype=torch.int32, device=query_start_loc.device)
    batch_ptr[:len(mlist)] = mlist
    chunk_ptr[:len(offsets)] = offsets
    nums_dict = {block_m: dict(nums=nums, tot=int(nums.sum()), mlist=mlist, mlist_len=len(mlist), offsetlist=offsets,
                               batch_ptr=batch_ptr, token_chunk_offset_ptr=chunk_ptr)}
    return types.SimpleNamespace(nums_dict=nums_dict, batch_ptr=batch_ptr, token_chunk_offset_ptr=chunk_ptr)


def vllm_short_conv(call, xs, weights, cu_seqlens):
    """The short conv of a pool call on vLLM's kernels, over the q | k | v blocks `xs` (`[1, T, D_i]`)
    with their weights: `causal_conv1d_fn` (prefill), `causal_conv1d_update` (decode; verify with
    num_accepted_tokens). Keeps the packed output on the call (the packed decodes read it)."""
    conv = load_vllm(CONV_OPS)
    mixed = torch.cat(xs, dim=-1)[0]  # [T, q | k | v channels], vLLM's mixed_qkv
    weight = torch.cat(weights, dim=0)
    if call.kind == "prefill":
        qsl = cu_seqlens.to(torch.int32)
        y = conv.causal_conv1d_fn(mixed.transpose(0, 1), weight, None, conv_states=call.pool.conv,
                                  query_start_loc=qsl, cache_indices=getattr(call, "conv_slots", call.slots),
                                  has_initial_state=call.has_initial_state, activation="silu",
                                  metadata=conv_metadata(qsl)).transpose(0, 1)
    elif call.kind == "decode":
        y = conv.causal_conv1d_update(mixed, call.pool.conv, weight, None, "silu", conv_state_indices=call.slots,
                                      validate_data=True)
    else:  # verify: the conv state of a row lives in its first slot, read at num_accepted_tokens - 1
        y = conv.causal_conv1d_update(mixed, call.pool.conv, weight, None, "silu",
                                      conv_state_indices=call.slots[:, 0], num_accepted_tokens=call.num_accepted,
                                      query_start_loc=cu_seqlens.to(torch.int32), max_query_len=call.slots.shape[1],
                                      validate_data=False)
    call.mixed = y
    return list(y.unsqueeze(0).split([x.shape[-1] for x in xs], dim=-1))


class VllmGDN(GatedDeltaNet):
    """linattn's GDN layer whose conv and recurrence run on vLLM's kernels, on the pool of the call
    in progress (`pool_call`: the pool, the slots as int32, and has_initial_state for a prefill).
    decode_kernel: "fused_sigmoid_gating" (`_forward_core`) or "packed" (the decode-only fast
    path `_forward_core_decode_non_spec`, qwen_gdn_linear_attn.py:1981-2031:
    `fused_recurrent_gated_delta_rule_packed_decode` on the packed conv output)."""

    pool_call = None
    decode_kernel = "fused_sigmoid_gating"

    def _fuses_gate(self, x, cp_context):
        # decode: the gate and beta inside vLLM's fused_sigmoid_gating kernel, as its decode does
        return self.pool_call is not None and self.pool_call.kind in ("decode", "verify")

    def _short_conv(self, xs, weights, cu_seqlens, cp_context=None, carry=None):
        if self.pool_call is None or cp_context is not None:
            raise ValueError(f"{type(self).__name__} runs in a pool call only (vllm_pool_prefill / vllm_pool_decode / "
                             f"vllm_row_verify), without CP")
        return vllm_short_conv(self.pool_call, xs, weights, cu_seqlens)

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        call = self.pool_call
        scale = self.config.head_k_dim ** -0.5
        q, k, v = (t.contiguous() for t in (q, k, v))
        if call.kind == "decode" and self.decode_kernel == "packed":  # g, beta: the projections a, b
            return gdn_packed_decode(load_vllm(f"{FLA_OPS}.fused_recurrent"), call, q, v, g, beta, gate, scale)
        if call.kind in ("decode", "verify"):  # g, beta: the projections a, b (gate["A_log"], gate["dt_bias"] beside)
            gating = load_vllm(f"{FLA_OPS}.fused_sigmoid_gating")
            o, _ = gating.fused_sigmoid_gating_delta_rule_update(
                A_log=gate["A_log"], a=g[0].contiguous(), b=beta[0].contiguous(), dt_bias=gate["dt_bias"], q=q, k=k,
                v=v, scale=scale, initial_state=call.pool.recurrent, inplace_final_state=True,
                cu_seqlens=cu_seqlens.to(torch.int32), ssm_state_indices=call.slots,
                num_accepted_tokens=getattr(call, "num_accepted", None), use_qk_l2norm_in_kernel=True)
            return o
        chunk = load_vllm(f"{FLA_OPS}.chunk")
        initial = call.pool.recurrent[call.slots.long()]
        initial[~call.has_initial_state] = 0
        o, final = chunk.ChunkGatedDeltaRuleFunction.apply(
            q, k, v, g.float().contiguous(), beta.float().contiguous(), scale, initial, True,
            cu_seqlens.to(torch.int32), None, None, True, None)
        call.pool.recurrent[call.slots.long()] = final.to(call.pool.recurrent.dtype)
        return o


def vllm_pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement):
    """One chunk of each sequence from its slot (zeros when fresh), written back to it."""
    return call_with_pool(module, x, cu_seqlens, kind="prefill", pool=pool, slots=slots.to(torch.int32),
                          has_initial_state=~fresh.to(slots.device))


def vllm_prefix_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix_slots):
    """Prefix caching as vLLM's align mode runs it around the same kernels (a sequence's state in the
    block of its last computed token, chunks ending on block boundaries): before the forward a prefix
    hit's state is copied from the prefix block into the block it writes (`precopy_mamba_align_fused_kernel`,
    vllm/v1/worker/mamba_utils.py:549-620: "so the kernels read the initial state from the
    write-side block"), the kernels run in place there (`vllm_pool_prefill`), and the state at a
    block boundary is kept as that block's (here copied to the snapshot slot the check names)."""
    hit = prefix_slots >= 0
    for f in pool:
        f[slots[hit]] = f[prefix_slots[hit]]
    y = vllm_pool_prefill(module, x, cu_seqlens, pool, slots, fresh & ~hit.to(fresh.device), placement)
    taken = snapshot_slots >= 0
    for f in pool:
        f[snapshot_slots[taken]] = f[slots[taken]]
    return y


def vllm_pool_decode(module, x, pool, slots, num_valid, placement):
    """Every row of the padded batch in one call, one token each; padding rows at the null block."""
    return call_with_pool(module, x, torch.arange(x.shape[1] + 1, dtype=torch.int32),
                          kind="decode", pool=pool, slots=slots.to(torch.int32))


def vllm_pool_capture(module, pool, batch_size, placement):
    """StatePoolPath.capture: vLLM's decode of `batch_size` rows as its CUDA-graph runner replays it
    (its static state-index buffer refilled per step, gdn_attn.py:648-671): the conv update and the
    recurrence on the slots in place, the padding rows at the null block (skipped by the kernels),
    the step run on the static buffers (`clients.state_pool.replayed`: on CUDA a real CUDA graph)."""
    from clients.state_pool import captured_buffers, replayed

    x_buf, slot_buf = captured_buffers(module, module.config.hidden_size, pool)
    x_rows, slot_rows = x_buf[:, :batch_size], slot_buf[:batch_size]
    cu = torch.arange(batch_size + 1, dtype=torch.int32, device=x_buf.device)

    def step(out):
        out["y"] = call_with_pool(module, x_rows, cu, kind="decode", pool=pool, slots=slot_rows.to(torch.int32))

    def refill(x, slots):
        x_rows.copy_(x)
        slot_rows.copy_(slots)

    return replayed(step, pool, refill, x_rows)


def _build(config, placement, groups, dtype, device, decode_kernel="fused_sigmoid_gating"):
    tp_group, _ = groups
    module = VllmGDN(config, tp_group=tp_group, dtype=dtype, device=device)
    module.decode_kernel = decode_kernel
    return module


def vllm_pool_path(config, decode_kernel="fused_sigmoid_gating", prefill=vllm_pool_prefill,
                   decode=vllm_pool_decode, capture=None) -> StatePoolPath:
    """VllmGDN for a GDN `config`, its decode on `decode_kernel` (VllmGDN's), with vLLM's slot
    conventions: slot 0 reserved (the null block) and the padding rows' slot. Under TP each rank's
    pool holds its heads' states, as vLLM's does. capture: captured decode steps instead of decode
    (`vllm_pool_capture`: vLLM's CUDA-graph runner)."""
    if decode_kernel not in ("fused_sigmoid_gating", "packed"):
        raise ValueError(f"decode_kernel must be 'fused_sigmoid_gating' or 'packed', got {decode_kernel!r}")
    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(_build, config,
                                                                                 decode_kernel=decode_kernel))
    return StatePoolPath(layer, prefill=prefill, decode=None if capture else decode, capture=capture,
                         padding_slot=NULL_BLOCK_ID,
                         reserved_slots=(NULL_BLOCK_ID,), shard_state=functools.partial(engine_shard_state, config),
                         unshard_state=functools.partial(engine_unshard_state, config))


# ---- speculative decoding: vLLM's spec-decode metadata (a row of 1 + K slots per sequence) ----
#
# The recurrent state after every token t of a verify call goes to slot row[t]; the next call starts
# from row[num_accepted_tokens - 1] (fused_sigmoid_gating.py, ssm_state_indices `[N, 1 + K]`). The
# conv state stays in row[0], K columns wider (W - 1 + K: vllm/model_executor/layers/mamba/
# mamba_utils.py:204), a sliding window: a verify call keeps W - 2 columns of the window and appends
# its 1 + K tokens; the next call's window starts at column num_accepted_tokens - 1
# (causal_conv1d.py:725-740). The checks compare a sequence's window, put first, the K columns
# after it zero (`spec_reference_forward`, `vllm_row_state`).


def _window(conv, start, width):
    """Each row's W-1 conv columns from `start` (a row's own), the K after zeroed."""
    cols = start.view(-1, 1, 1) + torch.arange(width - 1, device=conv.device).view(1, 1, -1)
    window = conv.gather(2, cols.expand(-1, conv.shape[1], -1))
    return torch.cat([window, torch.zeros_like(conv[..., width - 1:])], dim=-1)


def spec_reference_forward(num_draft, reference, x, cu_seqlens, state):
    """The reference layer with its states in vLLM's spec layout: the conv state W - 1 + K columns,
    the window first."""
    width = reference.config.conv_size
    if state is not None:
        state = LayerState(state.conv[..., :width - 1], state.recurrent)
    y, final = engine_reference_forward(reference, x, cu_seqlens, state)
    return y, LayerState(torch.cat([final.conv, final.conv.new_zeros(final.conv.shape[:-1] + (num_draft,))], -1),
                         final.recurrent)


def vllm_row_prefill(module, x, cu_seqlens, pool, slots, fresh, placement):
    """A prefill of each row from its current slot (its first after a fresh start), the conv state in
    the row's first slot."""
    current = row_prefill_slots(module, pool, slots, fresh)
    return call_with_pool(module, x, cu_seqlens, kind="prefill", pool=pool, slots=current.to(torch.int32),
                          conv_slots=slots[:, 0].to(torch.int32), has_initial_state=~fresh.to(slots.device))


def vllm_row_verify(module, x, cu_seqlens, pool, slots, placement):
    """1 + K tokens of each row in one call, with the num_accepted_tokens of its last call."""
    accepted = num_accepted(module, pool, slots)
    return call_with_pool(module, x, cu_seqlens, kind="verify", pool=pool, slots=slots.to(torch.int32),
                          num_accepted=accepted.to(torch.int32))


def vllm_row_state(module, pool, slots, placement):
    """Each sequence's state: the recurrent one in row[num_accepted_tokens - 1], the conv window in
    row[0] from column num_accepted_tokens - 1."""
    accepted = num_accepted(module, pool, slots)
    conv = _window(pool.conv[slots[:, 0]], accepted - 1, module.config.conv_size)
    return LayerState(conv, pool.recurrent[current_slots(slots, accepted)])


def vllm_spec_path(config, num_draft, accept=row_accept, verify=vllm_row_verify) -> SpecDecodePath:
    """VllmGDN (VllmKDA for a KDA config) with vLLM's speculative decoding: a bonus token and
    num_draft drafts per verify call, a row of 1 + num_draft slots per sequence; accept keeps
    num_accepted_tokens for the next call (a planted bug replaces it, or verify)."""
    if config.op == "kda":
        from clients.engines.vllm_kda import _build as build
    else:
        build = _build
    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(build, config))
    return SpecDecodePath(layer, prefill=vllm_row_prefill, verify=verify, accept=accept,
                          bonus_token=True, slots_per_sequence=1 + num_draft, read_state=vllm_row_state)
