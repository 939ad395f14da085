"""An FP8-style quantized checkpoint client of linattn's layer for
`pytest_linattn.harness.assert_checkpoint_round_trip`: fake quantization on the CPU (float64
tensors holding float8_e4m3fn's values), scales as a static FP8 checkpoint carries them.

The exporter (`merge_quantized`) puts the ranks' full-precision shards together
(`unshard_state_dict`) and quantizes every TP-split matrix, `<name>_scale` beside it:

  - a fused, sectioned weight (`in_proj_qkv` `[q | k | v]`; Qwen3-Next's `in_proj_qkvz`
    `[q | k | v | z]` per key head and `in_proj_ba` `[b | a]`): one per-tensor scale per section
    (3, 4 and 2 scale slots), each the section's amax / 448;
  - any other (`in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`): block scales along the dim TP
    splits, one per head (its amax / 448), so a rank's blocks are its heads';

each value is weight / scale rounded to e4m3 (3 mantissa bits). The conv weight, A_log, dt_bias
and the norm stay in full precision. `read_quantized` dequantizes the whole checkpoint.

The loader (`load_quantized`), as a serving engine's: the rank's rows of the quantized values
(`shard_state_dict`) and of the block scales (`shard_rows`); each fused weight's per-section
scale slots start at float32's lowest value (vLLM's `PerTensorScaleParameter`) and are filled from
the checkpoint by `fill_slots` (a planted loader replaces it); each section is dequantized with
its slot.

Measured (2026-12-06, CPU, float64, the CPU suites' qwen3_5 and qwen3_next configs with 2 value
heads per key head, seeded weights): the dequantized weights within 2.8e-2 of the reference's per
section and head block (e4m3's 3 mantissa bits), so `QUANTIZED_RTOL` = 5e-2 is the checkpoint's
`weight_rtol`; the loaded shards are the checkpoint's exactly and the layer at TP 1, 2 and 4 is
within 1.6e-15 of the replicated layer holding the dequantized weights (`rtol` 1e-10 holds). The
layer's outputs and gradients against the full-precision reference are another matter: up to
0.42 (dx; the l2-normalised q and k and the gated norm amplify 3% weight errors), which is why the
check compares the loaded layer with the checkpoint's weights and judges the quantization once, on them.
"""

from __future__ import annotations

import functools

import torch

from linattn.layers import ParameterLayout, parameter_layouts, shard_state_dict, unshard_state_dict
from linattn.layers.state_dict import shard_rows
from pytest_linattn.harness import CheckpointIO

from clients.checkpoint import save_rank_shard

__all__ = ["FP8_MAX", "QUANTIZED_RTOL", "SLOT_INIT", "fill_every_slot", "load_quantized", "merge_quantized",
           "quantized_checkpoint_io", "read_quantized", "scaled_weights"]

FP8_MAX = 448.0  # e4m3's largest finite value
QUANTIZED_RTOL = 5e-2
SLOT_INIT = float(torch.finfo(torch.float32).min)  # a scale slot nothing was loaded into


def scaled_weights(config) -> dict[str, str]:
    """{name: "sections" | "blocks"} of the quantized weights: the TP-split matrices, per-section
    scales where the layout names sections, block scales per head otherwise."""
    return {n: ("sections" if layout.names else "blocks") for n, layout in parameter_layouts(config).items()
            if len(layout.shape) == 2 and layout.split != "replicated"}


def _section_ids(layout: ParameterLayout) -> torch.Tensor:
    """The section of each row of a sectioned layout."""
    ids = torch.arange(len(layout.blocks)).repeat_interleave(torch.tensor(layout.blocks))
    return ids.repeat(layout.groups)


def _block_layout(config, layout: ParameterLayout) -> ParameterLayout:
    """The layout of a weight's block scales: one per head of the split dim, split as its heads."""
    key = bool(layout.key_blocks and layout.key_blocks[0])
    heads = config.num_k_heads if key else config.num_v_heads
    return ParameterLayout((heads,), "rows", key_blocks=(key,) if key else ())


def _split_dim(layout: ParameterLayout) -> int:
    return 1 if layout.split == "cols" else 0


def _per_row(scales: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """Block scales (one per head) expanded to the weight's split dim, shaped to broadcast."""
    full = scales.repeat_interleave(rows // scales.numel())
    return full[:, None] if dim == 0 else full[None, :]


def _fp8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float8_e4m3fn).to(torch.float64)


def merge_quantized(config, saved, placement):
    """The exporter: the ranks' shards put together, every TP-split matrix quantized (module docstring)."""
    full = unshard_state_dict(saved, config)
    layouts, checkpoint = parameter_layouts(config), {}
    for name, w in full.items():
        kind = scaled_weights(config).get(name)
        w = w.detach().double()
        if kind == "sections":
            ids = _section_ids(layouts[name])
            scales = torch.stack([w[ids == j].abs().max() for j in range(len(layouts[name].blocks))]) / FP8_MAX
            checkpoint[name], checkpoint[f"{name}_scale"] = _fp8(w / scales[ids][:, None]), scales
        elif kind == "blocks":
            dim = _split_dim(layouts[name])
            heads = _block_layout(config, layouts[name]).shape[0]
            scales = w.movedim(dim, 0).reshape(heads, -1).abs().amax(1) / FP8_MAX
            checkpoint[name] = _fp8(w / _per_row(scales, w.shape[dim], dim))
            checkpoint[f"{name}_scale"] = scales
        else:
            checkpoint[name] = w
    return checkpoint


def read_quantized(config, checkpoint):
    """The checkpoint dequantized: the replicated layer's state dict."""
    layouts, full = parameter_layouts(config), {}
    for name, layout in layouts.items():
        kind, q = scaled_weights(config).get(name), checkpoint[name]
        if kind == "sections":
            full[name] = q * checkpoint[f"{name}_scale"][_section_ids(layout)][:, None]
        elif kind == "blocks":
            dim = _split_dim(layout)
            full[name] = q * _per_row(checkpoint[f"{name}_scale"], q.shape[dim], dim)
        else:
            full[name] = q
    return full


def fill_every_slot(slots, on_disk):
    """The loader's fill of a fused weight's per-section scale slots: each from its section's scale."""
    slots.copy_(on_disk)


def load_quantized(config, checkpoint, placement, tp_rank, fill_slots=fill_every_slot):
    """The loader: TP rank `tp_rank`'s shard at `placement`, dequantized (module docstring)."""
    tp = placement.tp
    local = shard_state_dict({n: checkpoint[n] for n in parameter_layouts(config)}, config, tp_rank, tp)
    layouts, local_layouts = parameter_layouts(config), parameter_layouts(config.local(tp))
    replicas = config.key_head_replicas(tp)
    for name, kind in scaled_weights(config).items():
        on_disk = checkpoint[f"{name}_scale"]
        if kind == "sections":
            slots = torch.full((len(layouts[name].blocks),), SLOT_INIT, dtype=torch.float64)
            fill_slots(slots, on_disk)
            local[name] = local[name] * slots[_section_ids(local_layouts[name])][:, None]
        else:
            dim = _split_dim(layouts[name])
            scales = shard_rows(on_disk, _block_layout(config, layouts[name]), tp_rank, tp, replicas)
            local[name] = local[name] * _per_row(scales, local[name].shape[dim], dim)
    return local


def quantized_checkpoint_io(config, *, fill_slots=fill_every_slot) -> CheckpointIO:
    """linattn's layer for `config` through the FP8-style checkpoint; `fill_slots(slots, on_disk)`
    the loader's fill of the per-section scale slots (a planted one: only the first)."""
    return CheckpointIO(save=save_rank_shard, merge=functools.partial(merge_quantized, config),
                        load=functools.partial(load_quantized, config, fill_slots=fill_slots),
                        read=functools.partial(read_quantized, config), config=config)
