"""The record's serving bugs planted in the engine clients' glue (suites/clients/engines/): the
engines' own kernels (vLLM 0.33.0, sglang 0.5.23) run unchanged, and the plant replaces the
engine-side code around them that the upstream report's bug lived in (the metadata builder, the
CUDA-graph padding, the prefix-cache copies, the accept step), as that code stood before its fix.
Module-level: spawn's ranks get them by reference. Caught by suites/engines/test_record_on_engines.py
(`Bug.engine_tests` in the registry).
"""

from __future__ import annotations

import torch

from clients.engines.layout import call_with_pool
from clients.engines.sglang_gdn import sglang_pool_decode
from clients.engines.vllm_gdn import (NULL_BLOCK_ID, vllm_pool_decode, vllm_pool_prefill, vllm_prefix_prefill,
                                     vllm_row_verify)
from clients.spec_decode import num_accepted

__all__ = ["sglang_accept_keeping_rejected_drafts", "sglang_decode_padding_clamped_to_slot_0",
           "vllm_accept_keeping_rejected_drafts", "vllm_decode_padding_from_stale_rows",
           "vllm_prefill_1_token_chunks_as_decodes", "vllm_prefix_short_chunk_in_the_prefix_block",
           "vllm_verify_undrafted_rows_on_the_non_spec_path"]


def vllm_prefill_1_token_chunks_as_decodes(module, x, cu_seqlens, pool, slots, fresh, placement):
    """vLLM #51483 in vLLM's metadata builder: `split_decodes_and_prefills(decode_threshold=1)`
    without the first-chunk rule that 0.33.0 added (vllm/v1/attention/backends/gdn_attn.py:356-378
    classifies a row with no prior state as a prefill): every 1-token row of the call runs the
    decode kernels on its slot, a fresh sequence's first chunk too, which reads the state a
    previous sequence left there."""
    single = cu_seqlens.diff() == 1
    if not single.any():
        return vllm_pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement)
    starts = cu_seqlens[:-1].long()
    y = torch.empty_like(x)
    rows = single.nonzero().flatten().to(slots.device)
    decode_tokens = starts[single]
    y[:, decode_tokens] = call_with_pool(module, x[:, decode_tokens],
                                         torch.arange(len(rows) + 1, dtype=torch.int32),
                                         kind="decode", pool=pool, slots=slots[rows].to(torch.int32))
    rest = (~single).nonzero().flatten()
    if len(rest):
        tokens = torch.cat([torch.arange(int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in rest.tolist()])
        cu = torch.cat([cu_seqlens.new_zeros(1), cu_seqlens.diff()[rest].cumsum(0)]).to(cu_seqlens)
        keep = rest.to(slots.device)
        y[:, tokens] = vllm_pool_prefill(module, x[:, tokens], cu, pool, slots[keep], fresh.to(slots.device)[keep],
                                         placement)
    return y


def vllm_decode_padding_from_stale_rows(module, x, pool, slots, num_valid, placement):
    """vLLM #37728 / #49757 / #23035 class in vLLM's metadata builder: the CUDA-graph batch's state
    indices are a persistent buffer into which each step copies its decode rows; the fill of the
    padding rows with NULL_BLOCK_ID (gdn_attn.py:656-662 in 0.33.0) is left out, so a padding row
    keeps the slot an earlier, larger batch had in that row: a live slot, or one freed since."""
    buffer = getattr(module, "state_indices_buffer", None)
    if buffer is None or buffer.numel() < slots.numel():
        buffer = module.state_indices_buffer = torch.full_like(slots, NULL_BLOCK_ID)
    buffer[:num_valid] = slots[:num_valid]
    return vllm_pool_decode(module, x, pool, buffer[:slots.numel()].clone(), num_valid, placement)


def vllm_prefix_short_chunk_in_the_prefix_block(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots,
                                                prefix_slots):
    """vLLM #56196 in vLLM's align-mode prefix caching (`clients.engines.vllm_gdn.vllm_prefix_prefill`):
    a prefix hit whose chunk is shorter than W-1 keeps its conv state in the prefix block it read
    from (no pre-copy of the conv state into its own block; causal_conv1d_fn writes where it read),
    so the shared block changes and the sequence's own block is never written."""
    short = (prefix_slots >= 0) & (cu_seqlens.diff().to(prefix_slots.device) < module.local_config.conv_size - 1)
    own_conv = pool.conv[slots[short]].clone()
    conv_slots = torch.where(short, prefix_slots, slots)
    hit = prefix_slots >= 0
    for f in pool:
        f[slots[hit]] = f[prefix_slots[hit]]
    fresh = fresh.to(slots.device) & ~hit
    y = call_with_pool(module, x, cu_seqlens, kind="prefill", pool=pool, slots=slots.to(torch.int32),
                       conv_slots=conv_slots.to(torch.int32), has_initial_state=~fresh)
    pool.conv[slots[short]] = own_conv
    taken = snapshot_slots >= 0
    for f in pool:
        f[snapshot_slots[taken]] = f[slots[taken]]
    return y


def vllm_accept_keeping_rejected_drafts(module, pool, slots, num_accepted_tokens, placement):
    """sglang #27658 / vllm-ascend #12255's mechanism in vLLM's layout: the step after a verify call
    is handed num_accepted_tokens = 1 + K whatever was accepted, so the next call starts from the
    state after every draft (the row's last slot), the rejected ones included."""
    num_accepted(module, pool, slots)
    module.accepted[slots[:, 0]] = slots.shape[1]


def vllm_verify_undrafted_rows_on_the_non_spec_path(module, x, cu_seqlens, pool, slots, placement):
    """vLLM #56531 in vLLM's metadata builder (before the fix that 0.33.0 has, gdn_attn.py:340-348:
    "A batch whose rows all drafted nothing still has to run the speculative path"): a row that
    drafted nothing (its bonus token alone) is not a spec row, so it runs the non-spec decode
    kernels on `block_table[:, 0]` (:392), column 0 of its row, without num_accepted_tokens: the
    state before the previous step's accepted tokens."""
    undrafted = cu_seqlens.diff().to(slots.device) == 1
    if not undrafted.any():
        return vllm_row_verify(module, x, cu_seqlens, pool, slots, placement)
    starts = cu_seqlens[:-1].long()
    y = torch.empty_like(x)
    rows = undrafted.nonzero().flatten()
    tokens = starts[undrafted.cpu()]
    y[:, tokens] = vllm_pool_decode(module, x[:, tokens], pool, slots[rows, 0], len(rows), placement)
    spec = (~undrafted).nonzero().flatten()
    if len(spec):
        keep = spec.cpu()
        spec_tokens = torch.cat([torch.arange(int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in keep.tolist()])
        cu = torch.cat([cu_seqlens.new_zeros(1), cu_seqlens.diff()[keep].cumsum(0)]).to(cu_seqlens)
        num_accepted(module, pool, slots)
        y[:, spec_tokens] = vllm_row_verify(module, x[:, spec_tokens], cu, pool, slots[spec], placement)
    return y


def sglang_decode_padding_clamped_to_slot_0(module, x, pool, slots, num_valid, placement):
    """tokenspeed #700 (vLLM #37728's class) in sglang's CUDA-graph replay: the padding rows'
    PAD_SLOT_ID (-1) indices clamped to 0 before the kernels, while slot 0 is a slot like any
    other (sglang reserves none): the padding rows' states are written into it."""
    return sglang_pool_decode(module, x, pool, slots.clamp(min=0), num_valid, placement)


def sglang_accept_keeping_rejected_drafts(module, pool, slots, num_accepted_tokens, placement):
    """sglang #27658: after target_verify the slot takes the intermediate buffers' last step
    (every draft), not step accept_len - 1."""
    rows = torch.arange(slots.shape[0], device=slots.device)
    for f, buffer in zip(pool, module.verify_buffers):
        f[slots] = buffer[rows, -1]
    module.verify_buffers = None

