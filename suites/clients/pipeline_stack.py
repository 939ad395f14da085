"""A stack of linear-attention layers split into pipeline stages, for the harness's pipeline checks
(`assert_pipeline_parity`, `assert_pipeline_decode_parity`).

`StackLayer`: a pre-norm residual block, x + linear_attn(norm(x)), linattn's layer of the config
(its heads over TP, its tokens over CP) under `linear_attn.`, an RMSNorm (TP-replicated) under
`norm.`; called as linattn's layer is: (x, cu_seqlens, state=None, output_final_state=False), and
`step(x, state)`.

`LinearAttentionStack(config, num_layers, seed)`: the replicated stack, float64, `layers` in a
ModuleList, layer i's weights seeded by `seed * 100 + i`.

`PipelineStage(config, layers, num_layers, ...)`: the stage holding the stack's layers `layers`
(global indices), in a ModuleDict keyed by global index, so its parameters are named as the
reference's (`layers.2.linear_attn.A_log`), as torchtitan's and torchchat's pipeline stages keep
them. Its caches, as HF's cache lists: one state pool per layer in a list indexed by global layer
index (None for the layers of other stages); a pool holds a slot per sequence (sequence n in slot
n + 1; slot 0 is the null slot, never a sequence's). A decode step maps the batch's rows to slots
(`row_map`), reads the rows' states, steps every layer, writes the states back.

`pipeline_stack(config, num_layers, stage_class, shard=)` is the harness's PipelineStack. The bug
record's plants of pipeline-stage bugs subclass PipelineStage or replace the shard
(`bug_record.plants_pipeline`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from cases.layer_parity import describe_grad_element, random_state_dict
from clients.isolation import RMSNorm
from linattn.layers import (LayerState, build_layer, parameter_layouts, shard_state_dict, unshard_layer_state,
                            unshard_state_dict)
from pytest_linattn.harness import PipelineStack

__all__ = ["LinearAttentionStack", "PipelineStage", "StackLayer", "pipeline_stack", "shard_stage", "stack_state_dict"]


class StackLayer(nn.Module):
    """x + linear_attn(norm(x)), with linattn's layer's state path."""

    def __init__(self, config, *, tp_group=None, cp_group=None, cp_layout="contiguous", sequence_parallel=False,
                 dtype=torch.float64, device="cpu"):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size).to(dtype=dtype, device=device)
        self.linear_attn = build_layer(config, tp_group=tp_group, cp_group=cp_group, cp_layout=cp_layout,
                                       sequence_parallel=sequence_parallel, dtype=dtype, device=device)

    def forward(self, x, cu_seqlens, state=None, *, output_final_state=False):
        out = self.linear_attn(self.norm(x), cu_seqlens, state, output_final_state=output_final_state)
        if output_final_state:
            return x + out[0], out[1]
        return x + out

    def step(self, x, state):
        y, state = self.linear_attn.step(self.norm(x), state)
        return x + y, state


class LinearAttentionStack(nn.Module):
    """The replicated stack: `num_layers` StackLayers (no TP, CP), seeded weights."""

    def __init__(self, config, num_layers: int = 4, seed: int = 0, dtype=torch.float64):
        super().__init__()
        self.layers = nn.ModuleList(StackLayer(config, dtype=dtype) for _ in range(num_layers))
        self.load_state_dict(stack_state_dict(config, num_layers, seed))

    def forward(self, x, cu_seqlens):
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x


def stack_state_dict(config, num_layers: int, seed: int) -> dict:
    """The replicated stack's weights: layer i's linear attention as the record seeds a layer
    (seed * 100 + i), its norm near 1."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(num_layers):
        for name, t in random_state_dict(config, seed=seed * 100 + i).items():
            sd[f"layers.{i}.linear_attn.{name}"] = t
        sd[f"layers.{i}.norm.weight"] = 1.0 + 0.2 * torch.randn(config.hidden_size, generator=gen, dtype=torch.float64)
    return sd


class PipelineStage(nn.Module):
    """The stage of a pipeline holding the stack's layers `layers` (module docstring)."""

    def __init__(self, config, layers: range, num_layers: int, *, tp_group=None, cp_group=None,
                 cp_layout="contiguous", sequence_parallel=False, dtype=torch.float64, device="cpu"):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): StackLayer(config, tp_group=tp_group, cp_group=cp_group,
                                                        cp_layout=cp_layout, sequence_parallel=sequence_parallel,
                                                        dtype=dtype, device=device) for i in layers})
        self.last_stage = layers.stop == num_layers
        self.pools = [None] * num_layers  # per global layer index: this stage's state pool of that layer
        self.slot_of = {}  # sequence -> its slot in every pool

    def forward(self, x, cu_seqlens):
        for layer in self.layers.values():
            x = layer(x, cu_seqlens)
        return x

    # ---- the decode path ----

    def prefill(self, x, cu_seqlens):
        """Every sequence's prompt from empty state; each layer's states into its pool."""
        self.slot_of = {n: n + 1 for n in range(cu_seqlens.numel() - 1)}
        for index, layer in self.layers.items():
            x, state = layer(x, cu_seqlens, None, output_final_state=True)
            self.pools[int(index)] = self._write(None, torch.tensor(list(self.slot_of.values())), state)
        return x

    def decode(self, x, sequences):
        """One token of each sequence in `sequences` (rows in that order), from its slots."""
        rows = self.row_map(sequences)
        for index, layer in self.decode_layers():
            pool = self.pools[index]
            state = None if pool is None else LayerState(*(t[rows] for t in pool))  # None: an empty state
            x, new = layer.step(x, state)
            self.pools[index] = self._write(pool, rows, new)
        return x

    def row_map(self, sequences) -> torch.Tensor:
        """The decode batch's rows -> their slots."""
        return torch.tensor([self.slot_of[n] for n in sequences])

    def decode_layers(self) -> list:
        """(cache index, layer) of the stage's layers in order: each layer's cache under its global index."""
        return [(int(index), layer) for index, layer in self.layers.items()]

    def _write(self, pool, rows, state):
        if pool is None:
            slots = len(self.slot_of) + 1
            pool = LayerState(*(t.new_zeros((slots, *t.shape[1:])) for t in state))
        for t, new in zip(pool, state):
            t[rows] = new
        return pool

    def caches(self) -> dict:
        """{global layer index: its state, one row per sequence in sequence order} of this stage's layers."""
        slots = [self.slot_of[n] for n in sorted(self.slot_of)]
        return {int(index): LayerState(*(t[slots] for t in self.pools[int(index)])) for index in self.layers}


# ---- the harness's description ---------------------------------------------------------------------


def _build(config, stage_class, num_layers, placement, groups, layers, dtype, device):
    tp_group, cp_group = groups
    return stage_class(config, layers, num_layers, tp_group=tp_group, cp_group=cp_group,
                       cp_layout=placement.cp_layout, sequence_parallel=placement.sequence_parallel, dtype=dtype,
                       device=device)


def _of_layer(full, i, part="linear_attn"):
    prefix = f"layers.{i}.{part}."
    return {n.removeprefix(prefix): t for n, t in full.items() if n.startswith(prefix)}


def shard_stage(config, full, placement, tp_rank, layers) -> dict:
    """The stage's parameters for its TP rank: each layer's linear attention by linattn's
    shard_state_dict, its norm whole."""
    local = {}
    for i in layers:
        for name, t in shard_state_dict(_of_layer(full, i), config, tp_rank, placement.tp).items():
            local[f"layers.{i}.linear_attn.{name}"] = t
        local[f"layers.{i}.norm.weight"] = full[f"layers.{i}.norm.weight"]
    return local


def _unshard(config, grads, placement, layers):
    full = {}
    for i in layers:
        shards = [_of_layer(g, i) for g in grads]
        full.update({f"layers.{i}.linear_attn.{n}": t for n, t in unshard_state_dict(shards, config).items()})
        full[f"layers.{i}.norm.weight"] = grads[0][f"layers.{i}.norm.weight"]
    return full


def _unshard_state(config, states, placement):
    return unshard_layer_state(states, config)


def _describe(config, name, index, placement):
    """A linear attention's gradient element by head (cases.layer_parity), under its layer's prefix."""
    _, _, rest = name.partition(".linear_attn.")
    return describe_grad_element(config, rest, index, placement) if rest else None


def pipeline_stack(config, num_layers: int = 4, stage_class=PipelineStage, shard=None) -> PipelineStack:
    """The stack as the harness's PipelineStack; `stage_class` a PipelineStage (a planted one), `shard`
    the stage's shard function (default `shard_stage` of `config`)."""
    replicated = {f"layers.{i}.linear_attn.{n}" for i in range(num_layers)
                  for n, layout in parameter_layouts(config).items() if layout.split == "replicated"}
    replicated |= {f"layers.{i}.norm.weight" for i in range(num_layers)}
    return PipelineStack(num_layers=num_layers, build=functools.partial(_build, config, stage_class, num_layers),
                         shard=shard or functools.partial(shard_stage, config),
                         unshard=functools.partial(_unshard, config), replicated=replicated,
                         unshard_state=functools.partial(_unshard_state, config),
                         describe_grad_element=functools.partial(_describe, config))
