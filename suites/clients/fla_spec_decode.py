"""Speculative decoding through fla's KDA serving kernel, as vLLM calls it, for
`pytest_linattn.harness.assert_spec_decode_parity` (imported lazily: it imports fla).

`FlaSpecKDA` is the serving client's layer (`clients.fla_serving.FlaPoolKDA`: linattn's KDA layer,
prefill on fla's `chunk_kda`) whose verify call runs `fused_recurrent_kda_fwd` on the pool with
`ssm_state_indices` `[N, 1 + K]` and `num_accepted_tokens`, as vLLM's GDN / KDA spec-decode
metadata hands them to it:

- each sequence holds a row of 1 + K slots (the harness's `slots_per_sequence`); a verify call
  runs 1 + K tokens of every sequence (the token the previous step sampled, then K drafts);
- the kernel starts sequence n from slot `row[a - 1]`, a = the num_accepted_tokens of its last
  call (1 after a prefill), and writes its state after token t to slot `row[t]`;
- accept copies nothing: it keeps num_accepted_tokens (1 + the accepted drafts) for the next
  call, whose kernel reads that column. The rollback is the kernel's. (The bookkeeping,
  `num_accepted`, `row_accept`, `row_state`, is `clients.spec_decode`' for vLLM's layout.)

The conv state goes the same way, by the client: fla 0.6.0 has no conv update that takes
`num_accepted_tokens` (vLLM's `causal_conv1d_update` does), so the verify writes each token's conv
state (the last W-1 conv inputs) to the row's slots and the next call reads column a - 1. A
prefill runs from (and writes back to) the sequence's current column; a fresh one starts its row
over at column 0.

`fla_spec_path(config, num_draft, verify=..., accept=...)`: the harness's SpecDecodePath
(`clients.spec_decode.linattn_row_spec_path`'s: `bonus_token`, `slots_per_sequence = 1 +
num_draft`, `read_state`, the state sharded over TP as linattn's layer's, on this layer); a
planted bug replaces prefill, verify or accept (module-level functions: spawn pickles them by
reference).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from clients.fla_serving import FlaPoolKDA, fla_pool_prefill
from cases.layer_parity import linattn_layer
from linattn.layers import LayerState
from pytest_linattn.harness import SpecDecodePath
from clients.spec_decode import current_slots, linattn_row_spec_path, num_accepted, row_accept, row_prefill_slots

__all__ = ["FlaSpecKDA", "fla_spec_path", "fla_spec_prefill", "fla_spec_verify"]


class FlaSpecKDA(FlaPoolKDA):
    """FlaPoolKDA with a verify call on the pool (`pool_verify`)."""

    token_convs = None  # during pool_verify: None, then each token's conv state `[N, C, channels, W-1]`
    _keep_token_convs = False

    def _short_conv(self, xs, weights, cu_seqlens, cp_context=None, carry=None):
        if self._keep_token_convs:
            N = cu_seqlens.numel() - 1
            x = torch.cat(xs, dim=-1).view(N, -1, sum(t.shape[-1] for t in xs)).transpose(1, 2)
            window = torch.cat([carry.initial_conv, x.to(carry.initial_conv.dtype)], dim=-1)  # [N, D, W-1 + C]
            # the state after token t: the W-1 inputs up to it
            self.token_convs = window.unfold(-1, carry.initial_conv.shape[-1], 1)[:, :, 1:].transpose(1, 2)
        return super()._short_conv(xs, weights, cu_seqlens, cp_context, carry)

    def pool_verify(self, x, cu_seqlens, conv, pool, indices, num_accepted_tokens):
        """C tokens of each of N sequences, x `[1, N*C, hidden]` packed by cu_seqlens, from their
        conv states `[N, ...]`; the recurrence on fla's fused_recurrent_kda_fwd over the recurrent
        pool: sequence n from slot indices[n, a - 1] (a = num_accepted_tokens[n]; None: column 0),
        its state after token t written to slot indices[n, t]. Returns (y, each token's conv state
        `[N, C, ...]`)."""
        N = indices.shape[0]
        placeholder = pool.new_zeros((N,) + tuple(pool.shape[1:]))  # forward checks it; the pool is read instead
        self.pool_call = (pool, indices, cu_seqlens.to(device=x.device, dtype=torch.long), num_accepted_tokens)
        self._keep_token_convs, self.token_convs = True, None
        try:
            y, _ = self(x, cu_seqlens, LayerState(conv, placeholder), output_final_state=True)
        finally:
            self.pool_call, self._keep_token_convs = None, False
        return y, self.token_convs


def fla_spec_prefill(module, x, cu_seqlens, pool, slots, fresh, placement):
    """The serving client's prefill (chunk_kda) on each row's current slot; a fresh sequence's row
    starts over at column 0."""
    return fla_pool_prefill(module, x, cu_seqlens, pool, row_prefill_slots(module, pool, slots, fresh), fresh,
                            placement)


def fla_spec_verify(module, x, cu_seqlens, pool, slots, placement):
    """Every token's state written to the row's slots, the recurrent one by fla's kernel, which
    starts each sequence from column num_accepted_tokens - 1 of its row."""
    accepted = num_accepted(module, pool, slots)
    conv = pool.conv[current_slots(slots, accepted)]
    y, token_convs = module.pool_verify(x, cu_seqlens, conv, pool.recurrent, slots, accepted)
    pool.conv[slots] = token_convs.to(pool.conv.dtype)
    return y


def _build(config, placement, groups, dtype, device):
    tp_group, _ = groups
    return FlaSpecKDA(config, tp_group=tp_group, dtype=dtype, device=device)


def fla_spec_path(config, num_draft, prefill=fla_spec_prefill, verify=fla_spec_verify,
                  accept=row_accept) -> SpecDecodePath:
    """FlaSpecKDA for a KDA `config` as the harness's SpecDecodePath: a bonus token and num_draft
    drafts per verify call, a row of 1 + num_draft slots per sequence (TP: heads, weights and
    state sharded as linattn's layer's)."""
    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(_build, config))
    return dataclasses.replace(linattn_row_spec_path(config, num_draft, prefill, verify, accept), layer=layer)
