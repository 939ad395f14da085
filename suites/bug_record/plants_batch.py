"""Planted bugs for the batch-invariance check (`pytest_linattn.harness.assert_batch_invariance`):
wrappers around the slot-pool client's prefill and decode (suites/clients/state_pool.py), as a
serving engine's batching code would carry them. Module-level: spawn's ranks get them by reference.

Each plant names where it breaks, so a test can assert the located line:

- `prefill_starting_later_copies_from_the_first_slot` (slot crosstalk, modelled on ik_llama.cpp's
  `-np > 1` symptom: slots reading each other's recurrent state): a later copy differs bitwise
  from copy 0 at prompt token 0 of the prefill call;
- `decode_scaled_by_the_padded_batch` (a padding row leaking into the valid rows through a batch
  reduction): copy 0 off the reference at the first padded decode call; padding rows at zero or
  of ordinary size would hide it, the check's large ones do not;
- `decode_batched_in_float32` (a kernel chosen by batch size): the batched copy 0 off the single
  run at the first decode call, the copies still bitwise equal;
- `decode_writing_later_rows_as_an_increment` (rows differing by rounding only): copies differ
  bitwise at the second decode call, within any tolerance of the reference.

`decode_reading_the_next_rows_slot` is the crosstalk the check cannot see: identical copies hold
identical states, so a row reading its neighbour's slot reads its own state's bits.
"""

from __future__ import annotations

import torch

from clients.state_pool import pool_decode, pool_prefill
from linattn.layers import LayerState


def prefill_starting_later_copies_from_the_first_slot(module, x, cu_seqlens, pool, slots, fresh, placement):
    """The sequences run one after another, and every one after the first starts from the first
    one's slot (which it has just written) instead of from zero: one sequence's recurrent state
    read by another slot's."""
    bounds = cu_seqlens.tolist()
    ys = []
    for n in range(len(bounds) - 1):
        read = slots[:1] if n else slots[n:n + 1]
        state = LayerState(*(torch.zeros_like(f[read]) if n == 0 and bool(fresh[0]) else f[read] for f in pool))
        one = torch.tensor([0, bounds[n + 1] - bounds[n]], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        y, new = module(x[:, bounds[n]:bounds[n + 1]], one, state, output_final_state=True)
        for f, s in zip(pool, new):
            f[slots[n:n + 1]] = s
        ys.append(y)
    return torch.cat(ys, dim=1)


ACTIVATION_RANGE = 64.0  # the scaled input's bound: far above ordinary activations (|x| ~ 4)


def decode_scaled_by_the_padded_batch(module, x, pool, slots, num_valid, placement):
    """A per-tensor dynamic scale that keeps the decode's input within +-64 for a low-precision
    path, its amax taken over every row of the captured batch, the padding rows' included (the
    valid rows' alone were meant). Ordinary inputs never reach the bound: the valid rows change
    only when a padding row is large."""
    scale = (ACTIVATION_RANGE / x.abs().amax()).clamp(max=1.0)
    return pool_decode(module, x * scale, pool, slots, num_valid, placement)


def decode_batched_in_float32(module, x, pool, slots, num_valid, placement):
    """A kernel chosen by batch size: a decode of more than one row takes a batched kernel that
    reads its input and the rows' states in float32; one row takes the ranks' dtype."""
    if num_valid > 1:
        x = x.float().to(x.dtype)
        valid = slots[:num_valid]
        for f in pool:
            f[valid] = f[valid].float().to(f.dtype)
    return pool_decode(module, x, pool, slots, num_valid, placement)


def decode_writing_later_rows_as_an_increment(module, x, pool, slots, num_valid, placement):
    """The rows after the first write their new state as an increment, old + (new - old): exact in
    real arithmetic, a rounding apart in floating point, so the copies drift apart by ulps."""
    valid = slots[:num_valid]
    old = [f[valid].clone() for f in pool]
    y = pool_decode(module, x, pool, slots, num_valid, placement)
    for f, before in zip(pool, old):
        f[valid[1:]] = before[1:] + (f[valid[1:]] - before[1:])
    return y


def decode_reading_the_next_rows_slot(module, x, pool, slots, num_valid, placement):
    """Row i reads its state from row i+1's slot (the last row from the first's) and writes its
    own: crosstalk between the slots, invisible where every row holds the same state."""
    valid = slots[:num_valid]
    y, new = module.step(x[:, :num_valid], LayerState(*(f[valid.roll(-1)] for f in pool)))
    for f, n in zip(pool, new):
        f[valid] = n
    return torch.cat([y, torch.zeros_like(x[:, num_valid:])], dim=1)
