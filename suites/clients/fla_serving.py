"""A serving client on fla's KDA ops, for `pytest_linattn.harness.assert_state_pool_parity`
(imported lazily: it imports fla).

`FlaPoolKDA` is linattn's head-sharded KDA layer (its projections, short conv, gate and output
norm; its weights and state sharded over TP as linattn's) whose recurrence runs on fla's ops as
a serving engine calls them on a state pool:

- prefill: `chunk_kda` from the scheduled slots' states (zeros for a fresh sequence), the final
  states written back to the slots (fla 0.6.0's chunk_kda has no pool interface of its own);
- decode: `fused_recurrent_kda_fwd` on the pool's recurrent field with `ssm_state_indices` = the
  rows' slots, the state updated in place. The rows beyond `num_valid` (padding to a captured
  batch size, pointing at slot -1, slot 0 or a free slot) are sequences of zero tokens in
  `cu_seqlens`: fla 0.6.0's kernel skips them without reading their slot (it has no padding
  sentinel: a row of one token at slot -1 would read and write outside the pool).

The conv state is gathered and written back by slot. `fla_pool_path(config)` is the harness's
StatePoolPath; the reference is linattn's replicated float64 layer.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from fla.ops.kda import chunk_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

from cases.layer_parity import linattn_layer
from linattn.layers import KimiDeltaAttention, LayerState
from pytest_linattn.harness import StatePoolPath
from clients.state_pool import _shard, _unshard

__all__ = ["FlaPoolKDA", "fla_pool_decode", "fla_pool_path", "fla_pool_prefill"]


class FlaPoolKDA(KimiDeltaAttention):
    """linattn's KDA layer, its recurrence on fla's chunk_kda (prefill) and
    fused_recurrent_kda_fwd (a decode step on a pool, `pool_step`)."""

    # during a pool call: (the recurrent pool, ssm_state_indices, the rows' cu_seqlens, num_accepted_tokens or None)
    pool_call = None

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        if carry is None or cp_context is not None:
            raise ValueError("FlaPoolKDA serves with a state: no CP, a state in and out")
        scale = self.config.head_k_dim ** -0.5
        if self.pool_call is not None:
            pool, indices, rows_cu, accepted = self.pool_call
            # q, k, v are views of one conv output; this entry (no input_guard) reads them as contiguous
            q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
            o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=pool,
                                           inplace_final_state=True, ssm_state_indices=indices, cu_seqlens=rows_cu,
                                           num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True, **gate)
            return o
        state = carry.initial_recurrent
        if state.dtype != torch.float64:  # fla's chunk_kda takes float32 states
            state = state.float()
        o, final = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **gate)
        carry.recurrent = final
        return o

    def pool_step(self, x, conv, pool, slots, num_valid):
        """One token of each of B rows, x `[1, B, hidden]`, the rows' conv states `[B, ...]`; the
        first num_valid rows are sequences in `slots`, the rest padding. Returns (y, conv states)."""
        B = x.shape[1]
        rows_cu = torch.tensor([min(n, num_valid) for n in range(B + 1)], dtype=torch.long, device=x.device)
        placeholder = pool.new_zeros((B,) + tuple(pool.shape[1:]))  # step checks it; the pool is read instead
        self.pool_call = (pool, slots, rows_cu, None)
        try:
            y, new = self.step(x, LayerState(conv, placeholder))
        finally:
            self.pool_call = None
        return y, new.conv


def fla_pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement):
    """Each sequence from its slot (zeros when fresh); its final conv and recurrent state written back."""
    rows = [torch.where(fresh.view(-1, *[1] * (f.dim() - 1)), torch.zeros_like(f[slots]), f[slots]) for f in pool]
    y, new = module(x, cu_seqlens, LayerState(*rows), output_final_state=True)
    for f, n in zip(pool, new):
        f[slots] = n.to(f.dtype)
    return y


def fla_pool_decode(module, x, pool, slots, num_valid, placement):
    """Every row of the padded batch in one call (a captured graph's shape); the recurrence in place
    on the pool by slot; the valid rows' conv states written back."""
    conv = torch.zeros((x.shape[1],) + tuple(pool.conv.shape[1:]), dtype=pool.conv.dtype, device=pool.conv.device)
    conv[:num_valid] = pool.conv[slots[:num_valid]]
    y, new_conv = module.pool_step(x, conv, pool.recurrent, slots, num_valid)
    pool.conv[slots[:num_valid]] = new_conv[:num_valid]
    return y


def _build(config, placement, groups, dtype, device):
    tp_group, _ = groups
    return FlaPoolKDA(config, tp_group=tp_group, dtype=dtype, device=device)


def fla_pool_path(config, prefill=fla_pool_prefill, decode=fla_pool_decode) -> StatePoolPath:
    """FlaPoolKDA for a KDA `config`, as the harness's StatePoolPath (TP: heads, weights and
    state sharded as linattn's layer's)."""
    layer = dataclasses.replace(linattn_layer(config), build=functools.partial(_build, config))
    return StatePoolPath(layer, prefill=prefill, decode=decode, shard_state=functools.partial(_shard, config),
                         unshard_state=functools.partial(_unshard, config))
