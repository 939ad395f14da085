"""A decoder stack sharded over TP the way sglang runs Qwen3.5, for `assert_sharded_parity`.

sglang's decoder layers hand (hidden_states, residual) down the stack. Under TP a layer's MLP ends
in a row-parallel down projection, so its output is a partial sum on every rank. With all-reduce
fusion (sglang's `LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer`: TP > 1 and not
`is_last_layer`) the layer skips that all-reduce, and the next layer's input norm does it, fused
with the residual add and the RMSNorm. The last layer reduces its own output, and the model's final
norm adds it to the residual and normalises.

`TPDecoderStack(config, layers=2, seed=0, tp_group=None)`: float64 by default. Each layer is
pre-norm: the record's linear-attention layer (linattn's, its heads split over TP, its output
all-reduced at its exit), then an MLP split over TP (up column-parallel, down row-parallel).
`forward(x, cu_seqlens, hidden_state_after=k)` returns the hidden state after layer k: the residual
stream that the next layer's input norm forms (for the last layer, the one the final norm forms),
as transformers' output_hidden_states gives it. Without k it returns the final norm's output.

`tp_decoder_stack(config, stack_class, layers=, hidden_state_after=)` is the harness's
ShardedLayer. `stack_reference(config, layers, seed)` is the replicated stack. `reference_forward(k)`
calls the reference for the same output. The bug record plants sglang #19411 in a subclass
(`bug_record.plants_layer.DecoderLayersWithoutIsLastLayer`: no layer told it is the last).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from cases.layer_parity import random_state_dict
from clients.isolation import RMSNorm
from linattn.layers import build_layer, parameter_layouts, shard_state_dict, unshard_state_dict
from linattn.parallel.groups import group_size
from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn.harness import ShardedLayer

__all__ = ["DecoderLayer", "TPDecoderStack", "reference_forward", "stack_reference", "tp_decoder_stack"]

FFN_RATIO = 2  # the MLP's inner size, in hidden sizes (split over TP)


class DecoderLayer(nn.Module):
    """One pre-norm layer: input norm, linear attention (reduced at its exit), residual add, post
    attention norm, MLP (this rank's partial sum), and the MLP's all-reduce unless it is deferred.
    `is_last_layer` defaults to False, as in sglang's LayerCommunicator."""

    def __init__(self, config, *, tp_group=None, is_last_layer: bool = False):
        super().__init__()
        hidden, tp = config.hidden_size, group_size(tp_group)
        self.tp_group, self.is_last_layer = tp_group, is_last_layer
        self.input_layernorm = RMSNorm(hidden)
        self.linear_attn = build_layer(config, tp_group=tp_group, dtype=torch.float64)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.up_proj = nn.Parameter(torch.empty(FFN_RATIO * hidden // tp, hidden, dtype=torch.float64))
        self.down_proj = nn.Parameter(torch.empty(hidden, FFN_RATIO * hidden // tp, dtype=torch.float64))

    def defers_mlp_all_reduce(self) -> bool:
        """sglang's should_fuse_mlp_allreduce_with_next_layer: the next layer's input norm reduces."""
        return group_size(self.tp_group) > 1 and not self.is_last_layer

    def forward(self, hidden, residual, cu_seqlens, reduce_incoming: bool):
        """(hidden, residual) from the layer before (residual None for the first layer); reduce_incoming:
        that layer deferred its MLP all-reduce to this layer's input norm. Returns (hidden, residual,
        deferred, the residual stream entering this layer)."""
        if residual is None:
            residual = hidden
        else:  # the input norm's residual add, with the previous layer's all-reduce fused in
            incoming = reduce_from_tensor_parallel_region(hidden, self.tp_group) if reduce_incoming else hidden
            residual = incoming + residual
        entering = residual
        residual = self.linear_attn(self.input_layernorm(residual), cu_seqlens) + residual
        h = copy_to_tensor_parallel_region(self.post_attention_layernorm(residual), self.tp_group)
        hidden = F.silu(h @ self.up_proj.T) @ self.down_proj.T  # this rank's partial sum
        deferred = self.defers_mlp_all_reduce()
        if not deferred:
            hidden = reduce_from_tensor_parallel_region(hidden, self.tp_group)
        return hidden, residual, deferred, entering


class TPDecoderStack(nn.Module):
    """`layers` DecoderLayers of linattn's layer of `config`, then the final norm; seeded weights
    (the reference's: shard them for a TP rank's stack)."""

    def __init__(self, config, *, layers: int = 2, seed: int = 0, tp_group=None):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config, tp_group=tp_group, **self.layer_options(i, layers))
                                    for i in range(layers))
        self.norm = RMSNorm(config.hidden_size)
        if group_size(tp_group) == 1:
            self.load_state_dict(stack_state_dict(config, layers, seed))

    def layer_options(self, index: int, layers: int) -> dict:
        """What the stack tells layer `index` of `layers` (sglang's decoder layers pass is_last_layer)."""
        return {"is_last_layer": index == layers - 1}

    def forward(self, x, cu_seqlens, hidden_state_after: int | None = None):
        hidden, residual, deferred, after = x, None, False, []
        for i, layer in enumerate(self.layers):
            hidden, residual, deferred, entering = layer(hidden, residual, cu_seqlens, deferred)
            if i:  # what layer i's input norm formed: the hidden state after layer i - 1
                after.append(entering)
        # the final norm: a plain residual add and RMSNorm (no all-reduce: the last layer reduced its own)
        residual = hidden + residual
        after.append(residual)
        if hidden_state_after is not None:
            return after[hidden_state_after - 1]
        return self.norm(residual)


def stack_state_dict(config, layers: int, seed: int) -> dict:
    """The replicated stack's weights: each layer's linear attention as the record seeds it, norms
    near 1, the MLP ~ N(0, 1 / fan-in)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    sd = {}
    for i in range(layers):
        for name, t in random_state_dict(config, seed=seed * 100 + i).items():
            sd[f"layers.{i}.linear_attn.{name}"] = t
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"layers.{i}.{norm}.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen, dtype=torch.float64)
        sd[f"layers.{i}.up_proj"] = (torch.randn(FFN_RATIO * hidden, hidden, generator=gen, dtype=torch.float64)
                                     / hidden ** 0.5)
        sd[f"layers.{i}.down_proj"] = (torch.randn(hidden, FFN_RATIO * hidden, generator=gen, dtype=torch.float64)
                                       / (FFN_RATIO * hidden) ** 0.5)
    sd["norm.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen, dtype=torch.float64)
    return sd


def stack_reference(config, layers: int = 2, seed: int = 0) -> TPDecoderStack:
    """The replicated stack (no TP group), float64."""
    return TPDecoderStack(config, layers=layers, seed=seed)


# ---- the harness's description --------------------------------------------------------------------


def _build(stack_class, config, layers, placement, groups, dtype, device):
    return stack_class(config, layers=layers, tp_group=groups[0]).to(dtype=dtype, device=device)


def _layer_names(full, i):
    prefix = f"layers.{i}.linear_attn."
    return {n.removeprefix(prefix): t for n, t in full.items() if n.startswith(prefix)}


def _shard(config, layers, full, placement, tp_rank):
    tp, local = placement.tp, {}
    for i in range(layers):
        for name, t in shard_state_dict(_layer_names(full, i), config, tp_rank, tp).items():
            local[f"layers.{i}.linear_attn.{name}"] = t
        for norm in ("input_layernorm", "post_attention_layernorm"):
            local[f"layers.{i}.{norm}.weight"] = full[f"layers.{i}.{norm}.weight"]
        local[f"layers.{i}.up_proj"] = full[f"layers.{i}.up_proj"].chunk(tp, dim=0)[tp_rank]
        local[f"layers.{i}.down_proj"] = full[f"layers.{i}.down_proj"].chunk(tp, dim=1)[tp_rank]
    local["norm.weight"] = full["norm.weight"]
    return local


def _unshard(config, layers, grads, placement):
    """The replicated stack's gradients; a layer past the output checked (`hidden_state_after`) has none."""
    full = {}
    for i in range(layers):
        shards = [_layer_names(g, i) for g in grads]
        if all(t is None for t in shards[0].values()):
            full.update({f"layers.{i}.linear_attn.{n}": None for n in shards[0]})
        else:
            full.update({f"layers.{i}.linear_attn.{n}": t for n, t in unshard_state_dict(shards, config).items()})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            full[f"layers.{i}.{norm}.weight"] = grads[0][f"layers.{i}.{norm}.weight"]
        for name, dim in (("up_proj", 0), ("down_proj", 1)):
            parts = [g[f"layers.{i}.{name}"] for g in grads]
            full[f"layers.{i}.{name}"] = None if parts[0] is None else torch.cat(parts, dim=dim)
    full["norm.weight"] = grads[0]["norm.weight"]
    return full


def _forward(hidden_state_after, module, x, cu_seqlens, placement):
    return module(x, cu_seqlens, hidden_state_after=hidden_state_after)


def _reference_forward(hidden_state_after, reference, x, cu_seqlens):
    return reference(x, cu_seqlens, hidden_state_after=hidden_state_after)


def reference_forward(hidden_state_after: int | None = None):
    """The reference's call for the hidden state after layer `hidden_state_after` (None: the output)."""
    return functools.partial(_reference_forward, hidden_state_after)


def tp_decoder_stack(config, stack_class=TPDecoderStack, *, layers: int = 2,
                     hidden_state_after: int | None = None) -> ShardedLayer:
    """The stack as the harness's ShardedLayer; its output the hidden state after layer
    `hidden_state_after` (None: the final norm's output)."""
    replicated = {f"layers.{i}.linear_attn.{n}" for i in range(layers)
                  for n, layout in parameter_layouts(config).items() if layout.split == "replicated"}
    replicated |= {f"layers.{i}.{norm}.weight" for i in range(layers)
                   for norm in ("input_layernorm", "post_attention_layernorm")}
    return ShardedLayer(build=functools.partial(_build, stack_class, config, layers),
                        shard=functools.partial(_shard, config, layers),
                        unshard=functools.partial(_unshard, config, layers),
                        replicated=replicated | {"norm.weight"},
                        forward=functools.partial(_forward, hidden_state_after))
