"""Decode steps with a planted precision bug, for bench_long_decode (a module of its own: the
rank pool imports a decode function by its module's name, which a script run as __main__ lacks)."""

from __future__ import annotations

import torch

from linattn.layers import LayerState


def decode_storing_bf16_state(module, x, state, placement):
    """The recurrent state written back in bf16 after every token (read back as float32), where
    the layer keeps it in float32 (fla's state dtype) whatever its compute dtype."""
    y, new = module.step(x, LayerState(state.conv, state.recurrent.float()))
    return y, LayerState(new.conv, new.recurrent.to(torch.bfloat16))


PLANTS = {"bf16-state": decode_storing_bf16_state}
