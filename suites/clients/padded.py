"""A padded-batch client of linattn's layer for `pytest_linattn.harness.assert_padded_continuation_parity`:
a batch `[B, T, hidden]` with an attention mask becomes packed tokens and `cu_seqlens` (the
masked tokens of every row, in order, as transformers' models and fla's `unpad_input` do), the
layer runs from each row's state, and its outputs go back to their columns. A row with no token
in a call (only pads) keeps its state.

Under CP a prefill call comes with `held` (the tokens this CP rank holds: its contiguous piece
of the call's tokens in row order): the layer runs the held tokens as this rank's piece, with
the boundaries of the whole call (the mask's), and returns every row's state whole on every CP
rank. A decode step comes whole to every CP rank and runs on the layer's one-token step (`step`:
the whole decode batch on every rank).

`linattn_padded_path(config, forward=...)`: the harness's PaddedStatePath for a config; a
planted bug replaces forward (module-level functions: spawn pickles them by reference).
"""

from __future__ import annotations

import functools

import torch

from cases.layer_parity import linattn_layer
from linattn.layers import LayerState
from pytest_linattn.harness import PaddedStatePath
from clients.state_pool import _unshard

__all__ = ["linattn_padded_path", "padded_forward", "run_rows", "step_rows", "zero_state"]


def zero_state(module, B, dtype):
    """An empty cache's state for B rows (the recurrent state float32 unless the layer is float64)."""
    c = module.local_config
    recurrent = torch.float64 if dtype == torch.float64 else torch.float32
    return LayerState(torch.zeros(B, c.conv_dim, c.conv_size - 1, dtype=dtype),
                      torch.zeros(B, c.num_v_heads, c.head_k_dim, c.head_v_dim, dtype=recurrent))


def run_rows(module, x, mask, state, held=None):
    """The masked tokens of every row packed, from each row's state: y `[B, T, hidden]` (pads
    zero) and every row's state after its tokens (a row without tokens keeps its own). held:
    under CP, the tokens this rank runs (its piece of the packed tokens; the boundaries are the
    mask's); y is filled there only."""
    lengths = mask.sum(dim=1)
    rows = torch.nonzero(lengths).flatten()
    local = mask if held is None else held
    y = torch.zeros_like(x)
    new_state = LayerState(*(f.clone() for f in state))
    if rows.numel():
        cu = torch.cat([lengths.new_zeros(1), lengths[rows].cumsum(0)]).to(torch.int32)
        y_packed, new = module(x[local].unsqueeze(0), cu, LayerState(*(f[rows] for f in state)),
                               output_final_state=True)
        y[local] = y_packed[0]
        for f, n in zip(new_state, new):
            f[rows] = n.to(f.dtype)
    return y, new_state


def step_rows(module, x, mask, state):
    """One column: the layer's decode step over the rows with a token, from each row's state (the
    others keep theirs). y `[B, 1, hidden]` (pads zero) and every row's state."""
    if x.shape[1] != 1:
        raise ValueError(f"step_rows runs one column (a decode step), got x of shape {tuple(x.shape)}")
    rows = torch.nonzero(mask[:, 0]).flatten()
    y = torch.zeros_like(x)
    new_state = LayerState(*(f.clone() for f in state))
    if rows.numel():
        y_rows, new = module.step(x[rows, 0].unsqueeze(0), LayerState(*(f[rows] for f in state)))
        y[rows, 0] = y_rows[0]
        for f, n in zip(new_state, new):
            f[rows] = n.to(f.dtype)
    return y, new_state


def padded_forward(module, x, attention_mask, state, placement, held=None):
    """Unpad, run, repad; under CP a prefill call on this rank's held tokens, a decode step (no
    `held`) on the layer's one-token step."""
    state = zero_state(module, x.shape[0], x.dtype) if state is None else state
    if placement.cp > 1 and held is None:
        return step_rows(module, x, attention_mask, state)
    return run_rows(module, x, attention_mask, state, held)


def linattn_padded_path(config, forward=padded_forward) -> PaddedStatePath:
    """linattn's layer for `config` through the padded-batch client, its state unsharded over TP
    as its weights are."""
    return PaddedStatePath(linattn_layer(config), forward=forward, unshard_state=functools.partial(_unshard, config))
