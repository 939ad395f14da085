"""Weight layouts: Hugging Face parameter names and shapes per family, and how TP splits each one.

The replicated layer's state dict uses the HF checkpoint's names and shapes, so a checkpoint's
layer dict loads as is. TP gives rank i the i-th contiguous group of key heads, with their value
heads; every tensor is split one of four ways:

    rows        dim 0 in tp_size contiguous pieces (column-parallel weights, per-head vectors)
    cols        dim 1 in tp_size contiguous pieces (row-parallel output projection)
    row_blocks  dim 0 is a concatenation of blocks ([q | k | v]); each block splits by rows
    replicated  every rank holds the whole tensor (norm weight, KDA's f_a_proj / g_a_proj)

Value heads are in the config's head-pairing order (`LinearAttentionConfig.head_pairing`,
linattn.heads): grouped, each key head's value heads side by side, so "its value heads" are the
i-th contiguous group; or tiled, value head j reading key head j % H, so rank i's value heads are
its key heads' slots of each of the r tiles (llama.cpp's split of Qwen3.5's GGUF tensors, V
"segmented on the scale of K"). A tiled layout (`ParameterLayout.tiled`) moves its value heads
into grouped order, splits as below, and moves each rank's piece back into its own tiled order.

TP beyond the key heads (tp_size a multiple of num_k_heads that divides num_v_heads): each key
head is replicated over tp_size / num_k_heads consecutive ranks (`key_head_replicas`), which
split its value heads. The rows of key-head parts (q and k, `key_blocks`) then split over the
key heads, each replica holding its key head's whole; value-head parts split over tp_size as
always. The replicas' gradients of a key-head part are summed over the replicas inside the
layer's backward, so every replica holds the same, and unsharding takes the first replica's.

Layouts (HF order; H key heads, HV value heads, r = HV / H, dk / dv head dims):

    qwen3_next  in_proj_qkvz [H x (q dk, k dk, v r*dv, z r*dv), hidden]  rows: grouped per key head
                in_proj_ba   [H x (b r, a r), hidden]                     rows: grouped per key head
                             (groups = H; blocks: the parts of one group)
                conv1d       [q H*dk | k H*dk | v HV*dv, 1, W]            row_blocks (HF concatenates
                             q, k, v after ungrouping, so the conv channels are block-major)
    qwen3_5     in_proj_qkv  [q H*dk | k H*dk | v HV*dv, hidden]          row_blocks (feeds the conv as is)
                in_proj_z [HV*dv, hidden], in_proj_b / in_proj_a [HV, hidden]   rows
    both GDN    A_log, dt_bias [HV] rows; norm.weight [dv] replicated; out_proj [hidden, HV*dv] cols
    kda         q_proj, k_proj [H*dk, hidden], v_proj [HV*dv, hidden]      rows
                q_conv1d, k_conv1d [H*dk, 1, W], v_conv1d [HV*dv, 1, W]    rows
                f_a_proj [dv, hidden] replicated; f_b_proj [HV*dk, dv] rows; dt_bias [HV*dk] rows
                A_log [HV] rows; b_proj [HV, hidden] rows
                g_proj [HV*dv, hidden] rows, or g_a_proj [rank, hidden] replicated + g_b_proj
                [HV*dv, rank] rows; o_norm.weight [dv] replicated; o_proj [hidden, HV*dv] cols

Checkpoints that store A_log as [1, 1, HV, 1] or [HV, 1] (Kimi Linear) or dt_bias as [HV, dk]
are reshaped to the flat layout on load (same elements, same order).

A sectioned tensor's layout names its blocks (`ParameterLayout.names`: q, k, v and z of the fused
projections and the conv; b and a), so a report can say which section a row lies in.

The same functions shard and unshard gradient dicts (same keys and shapes as the parameters).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from linattn.heads import from_grouped, to_grouped

from .config import LinearAttentionConfig

__all__ = [
    "ParameterLayout",
    "parameter_layouts",
    "canonical_tensor",
    "shard_state_dict",
    "unshard_state_dict",
    "reorder_value_heads",
    "shard_rows",
    "unshard_rows",
]

SPLITS = ("rows", "cols", "row_blocks", "replicated")
# per-head vectors some checkpoints store with extra unit dims or 2-D; reshaped to flat on load
FLATTENABLE = ("A_log", "dt_bias")


@dataclasses.dataclass(frozen=True)
class ParameterLayout:
    shape: tuple[int, ...]
    split: str
    blocks: tuple[int, ...] = ()  # row_blocks: block sizes along dim 0; grouped rows: the parts of one group
    key_blocks: tuple[bool, ...] = ()  # per block (or the whole tensor): rows of key heads
    groups: int = 1  # rows grouped per key head (qwen3_next's fused projections)
    names: tuple[str, ...] = ()  # per block: the section's name (q, k, v, z; b, a)
    # (num_k_heads, num_v_heads) when the value heads pair tiled (value head j reads key head j % H):
    # every value-head part holds num_v_heads heads of equal size in that order; () for grouped
    tiled: tuple[int, ...] = ()


def parameter_layouts(config: LinearAttentionConfig) -> dict[str, ParameterLayout]:
    """Name -> (shape, split) of every parameter of the replicated layer, in registration order."""
    c = config
    hidden, kd, vd, hv, W = c.hidden_size, c.key_dim, c.value_dim, c.num_v_heads, c.conv_size
    H, r, dk, dv = c.num_k_heads, c.v_heads_per_k_head, c.head_k_dim, c.head_v_dim
    qkv_blocks, qkv_keys, qkv = (kd, kd, vd), (True, True, False), ("q", "k", "v")
    tiled = (H, hv) if c.head_pairing == "tiled" and hv > H else ()
    L = functools.partial(ParameterLayout, tiled=tiled)
    if c.family == "qwen3_next":
        layouts = {
            "in_proj_qkvz.weight": L((2 * kd + 2 * vd, hidden), "rows", (dk, dk, r * dv, r * dv),
                                     (True, True, False, False), H, ("q", "k", "v", "z")),
            "in_proj_ba.weight": L((2 * hv, hidden), "rows", (r, r), (False, False), H, ("b", "a")),
        }
    elif c.family == "qwen3_5":
        layouts = {
            "in_proj_qkv.weight": L((c.conv_dim, hidden), "row_blocks", qkv_blocks, qkv_keys, names=qkv),
            "in_proj_z.weight": L((vd, hidden), "rows"),
            "in_proj_b.weight": L((hv, hidden), "rows"),
            "in_proj_a.weight": L((hv, hidden), "rows"),
        }
    if c.family in ("qwen3_next", "qwen3_5"):
        layouts.update({
            "conv1d.weight": L((c.conv_dim, 1, W), "row_blocks", qkv_blocks, qkv_keys, names=qkv),
            "dt_bias": L((hv,), "rows"),
            "A_log": L((hv,), "rows"),
            "norm.weight": L((c.head_v_dim,), "replicated"),
            "out_proj.weight": L((hidden, vd), "cols"),
        })
        return layouts
    layouts = {
        "q_proj.weight": L((kd, hidden), "rows", key_blocks=(True,)),
        "k_proj.weight": L((kd, hidden), "rows", key_blocks=(True,)),
        "v_proj.weight": L((vd, hidden), "rows"),
        "q_conv1d.weight": L((kd, 1, W), "rows", key_blocks=(True,)),
        "k_conv1d.weight": L((kd, 1, W), "rows", key_blocks=(True,)),
        "v_conv1d.weight": L((vd, 1, W), "rows"),
        "f_a_proj.weight": L((c.head_v_dim, hidden), "replicated"),
        "f_b_proj.weight": L((hv * c.head_k_dim, c.head_v_dim), "rows"),
        "dt_bias": L((hv * c.head_k_dim,), "rows"),
        "A_log": L((hv,), "rows"),
        "b_proj.weight": L((hv, hidden), "rows"),
    }
    if c.output_gate_rank is None:
        layouts["g_proj.weight"] = L((vd, hidden), "rows")
    else:
        layouts["g_a_proj.weight"] = L((c.output_gate_rank, hidden), "replicated")
        layouts["g_b_proj.weight"] = L((vd, c.output_gate_rank), "rows")
    layouts["o_norm.weight"] = L((c.head_v_dim,), "replicated")
    layouts["o_proj.weight"] = L((hidden, vd), "cols")
    return layouts


def canonical_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` in the layer's shape for `name`: flattens A_log / dt_bias stored with other shapes."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    if name in FLATTENABLE and tensor.numel() == torch.Size(shape).numel():
        return tensor.reshape(shape)
    raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def _check_keys(state_dict, layouts, what: str) -> None:
    if not isinstance(state_dict, dict) and not hasattr(state_dict, "keys"):
        raise ValueError(f"{what} must be a dict of tensors, got {type(state_dict).__name__}")
    missing = [k for k in layouts if k not in state_dict]
    unexpected = [k for k in state_dict if k not in layouts]
    if missing or unexpected:
        raise ValueError(f"{what} keys must match the layer's parameters: missing {missing}, unexpected {unexpected}")


def shard_rows(full: torch.Tensor, layout: ParameterLayout, tp_rank: int, tp_size: int, replicas: int,
               dim: int = 0) -> torch.Tensor:
    """TP rank `tp_rank`'s rows (along `dim`) of a "rows" / "row_blocks" tensor: value-head rows
    split over tp_size, key-head rows over the tp_size / replicas key-head shards (a tiled
    layout's value heads: those of the rank's key heads, in its own tiled order)."""
    if layout.tiled:
        full = _value_heads(full, layout, dim, layout.tiled, to_grouped)
    key_shards, key_index = tp_size // replicas, tp_rank // replicas
    if layout.groups > 1:  # grouped per key head: this rank's groups, then its share of their value parts
        grouped = full.unflatten(dim, (layout.groups, -1)).chunk(key_shards, dim=dim)[key_index]
        parts = [p if key else p.chunk(replicas, dim=dim + 1)[tp_rank % replicas]
                 for p, key in zip(grouped.split(layout.blocks, dim=dim + 1), layout.key_blocks)]
        piece = torch.cat(parts, dim=dim + 1).flatten(dim, dim + 1)
    else:
        blocks = layout.blocks or (full.shape[dim],)
        keys = layout.key_blocks or (False,) * len(blocks)
        piece = torch.cat([b.chunk(key_shards, dim=dim)[key_index] if key else b.chunk(tp_size, dim=dim)[tp_rank]
                           for b, key in zip(full.split(blocks, dim=dim), keys)], dim=dim)
    if layout.tiled:
        piece = _value_heads(piece, _local_layout(layout, tp_size, replicas), dim,
                             _local_tiled(layout, tp_size, replicas), from_grouped)
    return piece


def unshard_rows(pieces, layout: ParameterLayout, local_layout: ParameterLayout, replicas: int,
                 dim: int = 0) -> torch.Tensor:
    """Inverse of shard_rows over the TP ranks' pieces in rank order; a key-head part is taken
    from the first of its replicas."""
    tp_size = len(pieces)
    if layout.tiled:
        local_tiled = _local_tiled(layout, tp_size, replicas)
        pieces = [_value_heads(p, local_layout, dim, local_tiled, to_grouped) for p in pieces]
    firsts = range(0, tp_size, replicas)
    if layout.groups > 1:
        per_rank = [p.unflatten(dim, (local_layout.groups, -1)).split(local_layout.blocks, dim=dim + 1)
                    for p in pieces]
        groups = [torch.cat([per_rank[g][j] if key else torch.cat([r[j] for r in per_rank[g:g + replicas]], dim=dim + 1)
                             for j, key in enumerate(layout.key_blocks)], dim=dim + 1) for g in firsts]
        full = torch.cat(groups, dim=dim).flatten(dim, dim + 1)
    else:
        blocks = local_layout.blocks or (pieces[0].shape[dim],)
        keys = layout.key_blocks or (False,) * len(blocks)
        per_rank = [p.split(blocks, dim=dim) for p in pieces]
        full = torch.cat([torch.cat([per_rank[g][j] for g in firsts] if key else [r[j] for r in per_rank], dim=dim)
                          for j, key in enumerate(keys)], dim=dim)
    if layout.tiled:
        full = _value_heads(full, layout, dim, layout.tiled, from_grouped)
    return full


def reorder_value_heads(state_dict, config: LinearAttentionConfig, head_pairing: str) -> dict[str, torch.Tensor]:
    """The weights of `config`'s layer re-paired as `head_pairing`: the state dict of the layer of
    `dataclasses.replace(config, head_pairing=head_pairing)` that computes the same function. Every
    value-head part (v, z, b, a, A_log, dt_bias, the v conv channels, the output projection's
    columns; KDA's too) is permuted; key-head parts and replicated weights are kept. From grouped to
    tiled this is llama.cpp's `_reorder_v_heads` of Qwen3.5's GGUF conversion."""
    target = dataclasses.replace(config, head_pairing=head_pairing)  # validates head_pairing
    source_layouts, target_layouts = parameter_layouts(config), parameter_layouts(target)
    _check_keys(state_dict, source_layouts, "state_dict")
    out = {}
    for name, layout in source_layouts.items():
        t = canonical_tensor(name, state_dict[name], layout.shape)
        if layout.split != "replicated":
            dim = 1 if layout.split == "cols" else 0
            if layout.tiled:
                t = _value_heads(t, layout, dim, layout.tiled, to_grouped)
            if target_layouts[name].tiled:
                t = _value_heads(t, target_layouts[name], dim, target_layouts[name].tiled, from_grouped)
        out[name] = t.contiguous()
    return out


def _local_tiled(layout: ParameterLayout, tp_size: int, replicas: int) -> tuple[int, int]:
    """(key heads, value heads) of one TP rank's piece of a tiled layout."""
    H, HV = layout.tiled
    return H * replicas // tp_size, HV // tp_size


def _local_layout(layout: ParameterLayout, tp_size: int, replicas: int) -> ParameterLayout:
    """The blocks of one TP rank's piece of `layout` (value blocks 1/tp_size, key blocks 1/key shards)."""
    key_shards = tp_size // replicas
    keys = layout.key_blocks or (False,) * max(1, len(layout.blocks))
    if layout.groups > 1:  # one group per local key head, its value parts 1/replicas
        blocks = tuple(b if key else b // replicas for b, key in zip(layout.blocks, keys))
        return dataclasses.replace(layout, blocks=blocks, groups=layout.groups // key_shards)
    blocks = tuple(b // (key_shards if key else tp_size) for b, key in zip(layout.blocks, keys))
    return dataclasses.replace(layout, blocks=blocks)


def _value_heads(t: torch.Tensor, layout: ParameterLayout, dim: int, heads: tuple[int, int], move) -> torch.Tensor:
    """`t` (a tensor of `layout` along `dim`) with the value heads of every value part moved by
    `move` (linattn.heads.to_grouped or from_grouped) for (key heads, value heads) = `heads`. A
    part grouped per key head (qwen3_next's fused rows) holds its value heads across the groups."""
    H, HV = heads
    keys = layout.key_blocks or (False,) * max(1, len(layout.blocks))
    if layout.groups > 1:
        groups = t.unflatten(dim, (layout.groups, -1))  # [.., groups, per group, ..]
        parts = list(groups.split(layout.blocks, dim=dim + 1))
        for j, key in enumerate(keys):
            if not key:  # this part's value heads across the groups, in storage order
                part = parts[j]
                heads_first = part.flatten(dim, dim + 1)
                parts[j] = move(heads_first, H, HV, "tiled", dim).unflatten(dim, part.shape[dim:dim + 2])
        return torch.cat(parts, dim=dim + 1).flatten(dim, dim + 1)
    blocks = layout.blocks or (t.shape[dim],)
    return torch.cat([b if key else move(b, H, HV, "tiled", dim) for b, key in zip(t.split(blocks, dim=dim), keys)],
                     dim=dim)


def shard_state_dict(state_dict, config: LinearAttentionConfig, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """The TP rank's shard of a replicated-layer state dict (or gradient dict), HF names kept."""
    replicas = config.key_head_replicas(tp_size)
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be an int in [0, {tp_size}), got {tp_rank!r}")
    layouts = parameter_layouts(config)
    _check_keys(state_dict, layouts, "state_dict")
    shard = {}
    for name, layout in layouts.items():
        full = canonical_tensor(name, state_dict[name], layout.shape)
        if layout.split == "replicated":
            piece = full
        elif layout.split == "cols":
            piece = shard_rows(full, layout, tp_rank, tp_size, replicas, dim=1)
        else:  # rows, row_blocks: this rank's heads of every block, blocks kept in order
            piece = shard_rows(full, layout, tp_rank, tp_size, replicas)
        shard[name] = piece.contiguous()
    return shard


def unshard_state_dict(shards, config: LinearAttentionConfig) -> dict[str, torch.Tensor]:
    """Inverse of shard_state_dict: the replicated-layer dict from the shards in TP rank order.

    Replicated entries are taken from rank 0, and key-head parts replicated beyond the key heads
    from their first replica (after the layer's all-reduce of their gradients every replica
    holds the same sum).
    """
    if isinstance(shards, dict) or not len(shards):
        raise ValueError("shards must be a non-empty sequence of per-rank dicts in TP rank order")
    tp_size = len(shards)
    local, replicas = config.local(tp_size), config.key_head_replicas(tp_size)
    layouts, local_layouts = parameter_layouts(config), parameter_layouts(local)
    for rank, shard in enumerate(shards):
        _check_keys(shard, layouts, f"shards[{rank}]")
    full = {}
    for name, layout in layouts.items():
        pieces = [canonical_tensor(name, shard[name], local_layouts[name].shape) for shard in shards]
        if layout.split == "replicated":
            full[name] = pieces[0]
        elif layout.split == "cols":
            full[name] = unshard_rows(pieces, layout, local_layouts[name], replicas, dim=1)
        else:
            full[name] = unshard_rows(pieces, layout, local_layouts[name], replicas)
    return full
