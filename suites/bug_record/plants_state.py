"""Planted bugs on the state path: wrappers around the layer's prefill and decode calls (the
StatePath's `prefill(module, x, cu_seqlens, state, placement)` and `decode(module, x, state,
placement)`, as an engine or a model's cache code calls the layer), and layer subclasses whose
decode step alone carries the bug. Module-level: spawn's ranks get them by reference.

Every plant here runs only on the stateful path (a call from a carried state, a decode step), so
the continuation check, which compares the calls with one full forward, is the check that sees it;
a plant of a state-pool client (`decode(module, x, pool, slots, num_valid, placement)`) is seen by
the state-pool check, which also requires the live slots a call did not schedule to stay unchanged;
a plant of the spec-decode client's accept by the spec-decode check, of the padded-batch client's
forward by the padded continuation check, a state stored in bf16 by the long-decode check, and a
prefill's prefix snapshots and blocks by the state-pool check's prefix mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linattn import kernels
from linattn.layers import GatedDeltaNet, LayerState
from clients.padded import padded_forward, run_rows
from clients.spec_decode import num_accepted, row_verify
from clients.state_pool import MAX_CAPTURED_ROWS, captured_buffers, decode_step_on, pool_prefill, replayed


def _rows_where(mask, rows, other):
    """`rows` `[N, ...]` with the rows where `mask` `[N]` holds replaced by `other`'s."""
    return torch.where(mask.view(-1, *[1] * (rows.dim() - 1)), other, rows)


def _call(module, x, cu_seqlens, state):
    return module(x, cu_seqlens, state, output_final_state=True)


# ---- caught by the continuation check ------------------------------------------------------------


def prefill_restarting_multi_token_chunks(module, x, cu_seqlens, state, placement):
    """transformers #45513: a multi-token forward with a populated cache calls the chunk kernel
    with initial_state=None, restarting from zero."""
    multi = (cu_seqlens.diff() > 1).to(x.device)
    return _call(module, x, cu_seqlens, LayerState(*(_rows_where(multi, s, torch.zeros_like(s)) for s in state)))


def prefill_reading_a_stale_state_for_1_token_chunks(module, x, cu_seqlens, state, placement):
    """vLLM #51483: a stateless 1-token first chunk classified as a decode reads a reused state
    page (here the previous row's, a state that is not its own)."""
    single = (cu_seqlens.diff() == 1).to(x.device)
    return _call(module, x, cu_seqlens, LayerState(*(_rows_where(single, s, s.roll(1, dims=0)) for s in state)))


# a client's prefill limit (mlxcel's MLXCEL_PREFILL_CHUNK, 2048), at the record's sizes
PREFILL_LIMIT = 6


def prefill_restarting_past_a_chunk_limit(module, x, cu_seqlens, state, placement):
    """sparkinfer #1071 / mlxcel #1749: a prompt longer than the client's prefill limit runs in
    pieces, and a piece at position > 0 restarts from zero instead of the previous piece's state."""
    long = (cu_seqlens.diff() > PREFILL_LIMIT).to(x.device)
    starts = cu_seqlens[:-1].tolist()
    lengths = cu_seqlens.diff().tolist()
    cut = [s + min(n, PREFILL_LIMIT) for s, n in zip(starts, lengths)]
    first = [torch.arange(s, c) for s, c in zip(starts, cut)]
    rest = [torch.arange(c, s + n) for s, c, n in zip(starts, cut, lengths)]
    head_cu = torch.tensor([0] + [len(i) for i in first]).cumsum(0).to(cu_seqlens)
    y_head, mid = _call(module, x[:, torch.cat(first)], head_cu, state)
    tails = [n for n, i in enumerate(rest) if len(i)]
    if not tails:
        return y_head, mid
    rows = torch.tensor(tails)
    zeroed = LayerState(*(_rows_where(long[rows], s[rows], torch.zeros_like(s[rows])) for s in mid))
    tail_cu = torch.tensor([0] + [len(rest[n]) for n in tails]).cumsum(0).to(cu_seqlens)
    y_tail, end = _call(module, x[:, torch.cat([rest[n] for n in tails])], tail_cu, zeroed)
    y = torch.empty_like(x)
    y[:, torch.cat(first)] = y_head
    y[:, torch.cat([rest[n] for n in tails])] = y_tail
    final = LayerState(*(m.index_copy(0, rows, e) for m, e in zip(mid, end)))
    return y, final


def prefill_through_the_decode_step(module, x, cu_seqlens, state, placement):
    """transformers #46741: a cached forward of T > 1 tokens takes the 1-token decode branch:
    one recurrent step on each sequence's first token, its output for every token of the chunk."""
    firsts = cu_seqlens[:-1].long()
    y_first, new = module.step(x[:, firsts], state)
    lengths = cu_seqlens.diff().long()
    return y_first.repeat_interleave(lengths, dim=1), new


# the client's kernel chunk (the token grid of a packed call), at the record's sizes
CLIENT_CHUNK = 8


def prefill_decaying_from_the_chunk_start(module, x, cu_seqlens, state, placement):
    """vLLM #23279: in a varlen chunked prefill a sequence starting mid-chunk gets its initial
    state's decay accumulated from the chunk start (the previous sequence's tokens included),
    not from its own start. GDN (qwen3_5 layout): a = in_proj_a(x), scalar decay per value head."""
    g = kernels.log_decay(F.linear(x, module.in_proj_a.weight), module.A_log, module.dt_bias)[0]  # [T, HV]
    starts = cu_seqlens[:-1].tolist()
    extra = torch.stack([g[s - s % CLIENT_CHUNK:s].sum(0) for s in starts])  # [N, HV]
    recurrent = state.recurrent * extra.exp().to(state.recurrent.dtype)[:, :, None, None]
    return _call(module, x, cu_seqlens, LayerState(state.conv, recurrent))


def _drop_gradient_of_oldest_column(conv):
    return torch.cat([conv[..., :1].detach(), conv[..., 1:]], dim=-1)


def prefill_dropping_the_oldest_conv_column_gradient(module, x, cu_seqlens, state, placement):
    """The fla causal_conv1d backward (no upstream issue): tokens before T-(W-1) are masked, so the
    final conv state's column 0 passes no gradient back (its value is right)."""
    y, new = _call(module, x, cu_seqlens, state)
    return y, LayerState(_drop_gradient_of_oldest_column(new.conv), new.recurrent)


def decode_dropping_the_oldest_conv_column_gradient(module, x, state, placement):
    y, new = module.step(x, state)
    return y, LayerState(_drop_gradient_of_oldest_column(new.conv), new.recurrent)


def decode_reading_the_first_columns_of_a_wider_state(module, x, state, placement):
    """sglang #38622: the decode conv update reads the first W-1 columns of a conv state kept W
    wide (a zero column in front, as transformers' cache pads it), not the last W-1."""
    wide = torch.cat([torch.zeros_like(state.conv[..., :1]), state.conv], dim=-1)
    return module.step(x, LayerState(wide[..., :-1], state.recurrent))


class DecodeBetaThroughBF16(GatedDeltaNet):
    """sglang #38975: the packed decode rounds sigmoid(beta) through bf16 on every step (prefill
    untouched), so the rounding enters the state once per token."""

    def step(self, hidden_states, state):
        self._decoding = True
        try:
            return super().step(hidden_states, state)
        finally:
            self._decoding = False

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        if getattr(self, "_decoding", False):
            beta = beta.to(torch.bfloat16).to(beta.dtype)
        return super()._delta_rule(q, k, v, g, beta, cu_seqlens, cp_context, carry, **gate)


class DecodeStoringStateInBF16(GatedDeltaNet):
    """TensorRT-Model-Connect #725: the persistent recurrent state written back in the storage
    dtype (bf16) every decoded token, read back into the float32 step. Seen by the long-decode
    check's state-dtype rule, and by its error bound within a few steps."""

    def step(self, hidden_states, state):
        y, new = super().step(hidden_states, state)
        return y, LayerState(new.conv, new.recurrent.to(torch.bfloat16))


def decode_writing_padding_rows_through_slot_0(module, x, pool, slots, num_valid, placement):
    """vLLM #37728 and siblings (a state-pool client's decode, `StatePoolPath.decode`): the
    captured graph runs every row of a decode padded to its captured size, and the padding rows
    write their state too, through slot 0 (the padding sentinel read as slot 0, as PAD_SLOT_ID
    equal to a live slot). The valid rows' outputs and states are right; slot 0 is not."""
    rows = slots.clamp(min=0)
    y, new = module.step(x, LayerState(*(f[rows] for f in pool)))
    for f, n in zip(pool, new):
        f[rows.flip(0)] = n.flip(0)  # the padding rows, last in the batch, write first: valid rows win ties
    return y


def prefill_writing_a_short_chunk_into_the_prefix_block(module, x, cu_seqlens, pool, slots, fresh, placement,
                                                        snapshot_slots, prefix_slots):
    """vLLM #56196 (a state-pool client's prefill in prefix mode): a prefix hit's chunk shorter
    than W-1 writes its conv state into the shared prefix block it read from; its own slot is
    never written (it keeps the conv state it held)."""
    own_conv = pool[0][slots].clone()
    y = pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix_slots)
    short = (prefix_slots >= 0) & (cu_seqlens.diff().to(prefix_slots.device) < module.local_config.conv_size - 1)
    pool[0][prefix_slots[short]] = pool[0][slots[short]]
    pool[0][slots[short]] = own_conv[short]
    return y


def prefill_without_track_snapshots(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots,
                                    prefix_slots):
    """sglang #31474 (a state-pool client's prefill in prefix mode): the KDA backend never writes
    the mamba track snapshots at block boundaries, so a later prefix hit restores whatever the
    snapshot slot held."""
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, None, prefix_slots)


def prefill_hit_from_an_empty_state(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots,
                                    prefix_slots):
    """vLLM #43090 (a state-pool client's prefill in prefix mode): the prefix cache's coordinator
    keeps one hit length for every layer group; the attention group hit, the Mamba group missed,
    and with num_computed_tokens > 0 the layer is told the sequence has an initial state, yet its
    state was never restored: it recurs from an empty (zero) state past the prefix."""
    hit = prefix_slots >= 0
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh | hit.to(fresh.device), placement, snapshot_slots,
                        None)


def prefill_copying_snapshots_by_element_count(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots,
                                               prefix_slots):
    """llama.cpp #20700 (a state-pool client's prefill in prefix mode): the recurrent-state copy
    into the snapshot cell passed an element count where `ggml_view_1d` wanted bytes, so each
    field's copy covers its first numel / element_size elements only (the rest of the snapshot
    slot keeps what it held)."""
    y = pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, None, prefix_slots)
    taken = (snapshot_slots >= 0).nonzero().flatten()
    for f in pool:
        for n in taken.tolist():
            source, target = f[slots[n]].flatten(), f[snapshot_slots[n]].view(-1)
            count = source.numel() // source.element_size()  # the element count, read as bytes
            target[:count] = source[:count]
    return y


def accept_keeping_rejected_drafts(module, pool, slots, num_accepted_tokens, placement):
    """sglang #27658 / #40419, vllm-ascend #12255 (the spec-decode client's accept,
    `SpecDecodePath.accept`): the slot keeps the state the verify call advanced through all K
    drafts, whatever was accepted. Right where every draft was accepted, wrong everywhere else."""
    rows = torch.arange(slots.numel(), device=slots.device)
    for f, kept in zip(pool, module.verify_states):
        f[slots] = kept[-1, rows]
    module.verify_states = None


def row_verify_reading_column_0_for_undrafted_rows(module, x, cu_seqlens, pool, slots, placement):
    """vLLM #56531 (before it; also #55504's non-spec path): in a mixed batch a row that drafted
    nothing takes the non-spec decode path, which keeps one slot per request (`block_table[:, 0]`):
    it starts from column 0, the state before the previous call's accepted tokens, instead of
    column num_accepted_tokens - 1 (the row client in vLLM's layout)."""
    undrafted = cu_seqlens.diff().to(slots.device) == 1  # the bonus token alone
    num_accepted(module, pool, slots)
    module.accepted[slots[undrafted, 0]] = 1
    return row_verify(module, x, cu_seqlens, pool, slots, placement)


def row_verify_keeping_one_conv_window(module, x, cu_seqlens, pool, slots, placement):
    """vLLM #50272 / #44296 (LFM2's short_conv under any speculative method): the conv state sized
    W-1 with no room for the drafts and num_accepted_tokens never passed to it, so one window is
    shifted through every token of the verify call, the rejected drafts included, and that window
    is what the next call reads whatever was accepted (the recurrent state keeps its per-token
    columns; the row client in vLLM's layout)."""
    y = row_verify(module, x, cu_seqlens, pool, slots, placement)
    last = slots.gather(1, (cu_seqlens.diff().to(slots.device).long() - 1).view(-1, 1)).squeeze(1)
    pool[0][slots] = pool[0][last].unsqueeze(1).expand(-1, slots.shape[1], *pool[0].shape[1:]).clone()
    return y


def capture_refilling_the_front_reading_the_tail(module, pool, batch_size, placement):
    """sglang #32555 (a CUDA-graph runner's captured decode, StatePoolPath.capture): the replay
    refills the static destination buffer's first rows (`[:bs]`) but the captured step writes
    through its last ones (`[-bs:]`), never refreshed while no batch of the buffer's full size
    runs: every row reads its own slot and writes its new state into the slot the tail still holds
    (the null slot, as allocated); the batch's slots keep their old states."""
    x_buf, slot_buf = captured_buffers(module, module.config.hidden_size, pool)
    destination = module.__dict__.setdefault("destination_buffer", slot_buf.clone())
    front, tail = slice(0, batch_size), slice(MAX_CAPTURED_ROWS - batch_size, MAX_CAPTURED_ROWS)

    def refill(x, slots):
        x_buf[:, front].copy_(x)
        slot_buf[front].copy_(slots)
        destination[front].copy_(slots)

    return replayed(lambda out: decode_step_on(module, pool, x_buf[:, front], slot_buf[front], out,
                                               write_rows=destination[tail]), pool, refill, x_buf[:, front])


def forward_ignoring_the_mask_when_continued(module, x, attention_mask, state, placement):
    """transformers #47086 (the padded-batch client's forward, `PaddedStatePath.forward`): the
    first call (an empty cache) applies the attention mask; a continued forward does not, so the
    pads of a padding run that straddles a call boundary enter the conv and recurrent state as
    tokens."""
    if state is None:
        return padded_forward(module, x, attention_mask, state, placement)
    return run_rows(module, x, torch.ones_like(attention_mask), state)


# ---- inner snapshots (StatePoolPath.inner_snapshots): block boundaries inside a chunk ------------

# the engine's snapshot cadence (sglang's mamba_cache_chunk_size; vLLM's RWKV-7 scatter chunk), at
# the record's sizes: a chunk shorter than it writes no snapshot at the block boundaries inside it
CADENCE = 8


def prefill_skipping_inner_snapshots_of_short_chunks(module, x, cu_seqlens, pool, slots, fresh, placement,
                                                     snapshot_slots, prefix_slots, inner_snapshot_slots,
                                                     inner_snapshot_offsets):
    """sglang #30938 / vLLM #41060 (a state-pool client's prefill with inner snapshots): the snapshot
    cadence against the chunk size: a chunk shorter than CADENCE skips the track write at the block
    boundaries inside it (sglang's track mask skipped with a warning; vLLM's RWKV-7 scatter returns
    silently when mamba_block_size < chunk size), so those blocks keep stale contents, which a later
    prefix hit restores. Its chunk-end snapshot and its own slot are right."""
    short = (cu_seqlens.diff() < CADENCE).to(inner_snapshot_slots.device)
    kept = inner_snapshot_slots.masked_fill(short[:, None], -1)
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix_slots, kept,
                        inner_snapshot_offsets)


def prefill_publishing_the_chunk_end_under_its_last_boundary(module, x, cu_seqlens, pool, slots, fresh, placement,
                                                             snapshot_slots, prefix_slots, inner_snapshot_slots,
                                                             inner_snapshot_offsets):
    """vLLM #51113 (a state-pool client's prefill with inner snapshots): a prefill chunk not kept
    block-aligned (past last_cache_position) publishes its chunk-end state under the last block
    boundary it crossed, a state that boundary does not represent; the boundaries before it, its
    own slot and every chunk that ends on a block boundary are right."""
    y = pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix_slots,
                     inner_snapshot_slots, inner_snapshot_offsets)
    if inner_snapshot_slots.shape[1] == 0:
        return y
    last = inner_snapshot_slots.max(dim=1).values  # slots are given in token order: the last boundary's
    unaligned = (snapshot_slots < 0) & (last >= 0)
    for f in pool:
        f[last[unaligned]] = f[slots[unaligned]]
    return y


def _chunks(plans, hits):
    """(sequence, start, end) of every prefill chunk, in tokens of its sequence (a hit's chunks
    after its restored prefix)."""
    for n, plan in enumerate(plans):
        start = hits[n][1] if n in hits else 0
        for length in plan.chunks:
            yield n, start, start + length
            start += length


def inner_boundaries(start, end, block_size):
    """The multiples of block_size strictly inside the chunk [start, end)."""
    return list(range(start - start % block_size + block_size, end, block_size))


def stale_inner_snapshots(plans, hits, block_size):
    """(sequence, token) of each snapshot prefill_skipping_inner_snapshots_of_short_chunks leaves
    unwritten, in plan order: the block boundaries inside every chunk shorter than CADENCE."""
    return [(n, b) for n, start, end in _chunks(plans, hits) if end - start < CADENCE
            for b in inner_boundaries(start, end, block_size)]


def misplaced_inner_snapshots(plans, hits, block_size):
    """(sequence, token, chunk end) of each snapshot
    prefill_publishing_the_chunk_end_under_its_last_boundary fills with its chunk-end state, in
    plan order: the last block boundary inside every chunk that does not end on one."""
    return [(n, inner_boundaries(start, end, block_size)[-1], end) for n, start, end in _chunks(plans, hits)
            if end % block_size and inner_boundaries(start, end, block_size)]
