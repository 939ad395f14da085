"""Weight-layout adapters: other implementations' state dicts <-> the project's (state_dict.py).

Each pair converts a whole state dict (or a gradient dict: same keys and shapes) bit-exactly:

    from_hf_state_dict / to_hf_state_dict          transformers modules: Qwen3NextGatedDeltaNet,
                                                   Qwen3_5GatedDeltaNet (the project's names),
                                                   KimiLinearDeltaAttention and GLM-5.3-Flash's
                                                   Glm5NextTextLinearAttention (fused conv1d,
                                                   forget_gate.*)
    from_fla_state_dict / to_fla_state_dict        fla's GatedDeltaNet (<-> qwen3_5) and
                                                   KimiDeltaAttention (<-> kda) layers
    from_megatron_state_dicts / to_megatron_state_dict
                                                   megatron-core's GatedDeltaNet, replicated or one
                                                   TP rank's shard (<-> qwen3_5 and qwen3_next)
    qwen3_next_to_qwen3_5 / qwen3_5_to_qwen3_next  the two GDN layouts of the same layer

Most maps are tables of entries (project names, other names) whose dim-0 concatenations are the
same tensor: a name on one side may be several on the other (fla's q/k/v projections are
in_proj_qkv's row blocks). Keys must match exactly; a tensor the project's layer has no place for
(a bias, a non-zero fla output-gate bias) raises ValueError, never dropped.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from linattn.checks import require

from .config import GDN_FAMILIES, SILU_NAMES, LinearAttentionConfig, _config_from_hf, _hf_text_config
from .state_dict import _check_keys, canonical_tensor, parameter_layouts, shard_state_dict, unshard_state_dict

__all__ = [
    "config_from_fla_layer",
    "from_fla_state_dict",
    "from_hf_state_dict",
    "from_megatron_state_dicts",
    "qwen3_5_to_qwen3_next",
    "qwen3_next_to_qwen3_5",
    "to_fla_state_dict",
    "to_hf_state_dict",
    "to_megatron_state_dict",
]

# ---- table-driven conversion ----


def _same(*names: str):
    """Table entries for names that are the same on both sides."""
    return [((n,), (n,)) for n in names]


def _inverse(entries):
    """Tables list (project names, other names); converting from the other layout swaps them."""
    return [(other, project) for project, other in entries]


def _project_shapes(config: LinearAttentionConfig) -> dict[str, tuple[int, ...]]:
    return {name: layout.shape for name, layout in parameter_layouts(config).items()}


def _regroup(state_dict, entries, source_shapes, target_shapes, what: str) -> dict[str, torch.Tensor]:
    """Convert by a table of (source names, target names): each entry's source tensors, flattened
    and concatenated in order, cut into its target tensors (a dim-0 concatenation is the
    concatenation of the flattened pieces, so this is bit-exact)."""
    _check_keys(state_dict, source_shapes, what)
    out = {}
    for sources, targets in entries:
        flat = torch.cat([canonical_tensor(n, state_dict[n], source_shapes[n]).reshape(-1) for n in sources])
        pieces = flat.split([math.prod(target_shapes[n]) for n in targets])
        for name, piece in zip(targets, pieces):
            out[name] = piece.reshape(target_shapes[name]).clone()
    return out


# ---- GDN: qwen3_next <-> qwen3_5 ----


def _check_family(config, families, what: str = "config.family") -> None:
    if not isinstance(config, LinearAttentionConfig):
        raise ValueError(f"config must be a LinearAttentionConfig, got {type(config).__name__}")
    require(config.family in families, what, f"must be one of {families} for this map, got {config.family!r}")


def _check_grouped(config, what: str) -> None:
    """ValueError unless config pairs its value heads as `what` does (grouped: fla's layers and
    kernels, Megatron's GDN, transformers' modules)."""
    require(config.head_pairing == "grouped" or config.num_v_heads == config.num_k_heads, "config.head_pairing",
            f"must be 'grouped' for {what}, which pairs value head j with key head j // (num_v_heads / "
            f"num_k_heads), got {config.head_pairing!r}: re-pair the weights first with "
            f"reorder_value_heads(state_dict, config, 'grouped')")


def qwen3_next_to_qwen3_5(state_dict, config: LinearAttentionConfig) -> dict[str, torch.Tensor]:
    """A qwen3_next layer's dict in the qwen3_5 layout (config: the qwen3_next layer's).

    Qwen3-Next groups in_proj_qkvz's rows per key head, [q dk | k dk | v r*dv | z r*dv] for each,
    and in_proj_ba's as [b r | a r]; Qwen3.5 stores the blocks q | k | v, z, b, a whole.
    """
    _check_family(config, ("qwen3_next",))
    _check_keys(state_dict, parameter_layouts(config), "state_dict")
    c = config
    H, r, dk, dv, hidden = c.num_k_heads, c.v_heads_per_k_head, c.head_k_dim, c.head_v_dim, c.hidden_size
    shapes = _project_shapes(c)
    qkvz = canonical_tensor("in_proj_qkvz.weight", state_dict["in_proj_qkvz.weight"], shapes["in_proj_qkvz.weight"])
    ba = canonical_tensor("in_proj_ba.weight", state_dict["in_proj_ba.weight"], shapes["in_proj_ba.weight"])
    q, k, v, z = (t.reshape(-1, hidden) for t in qkvz.view(H, -1, hidden).split([dk, dk, r * dv, r * dv], dim=1))
    b, a = (t.reshape(-1, hidden) for t in ba.view(H, 2 * r, hidden).split([r, r], dim=1))
    out = {"in_proj_qkv.weight": torch.cat([q, k, v]), "in_proj_z.weight": z.contiguous(),
           "in_proj_b.weight": b.contiguous(), "in_proj_a.weight": a.contiguous()}
    target = dataclasses.replace(c, family="qwen3_5")
    for name, shape in _project_shapes(target).items():
        if name not in out:
            out[name] = canonical_tensor(name, state_dict[name], shape).clone()
    return {name: out[name] for name in parameter_layouts(target)}


def qwen3_5_to_qwen3_next(state_dict, config: LinearAttentionConfig) -> dict[str, torch.Tensor]:
    """Inverse of qwen3_next_to_qwen3_5 (config: the qwen3_5 layer's)."""
    _check_family(config, ("qwen3_5",))
    layouts = parameter_layouts(config)
    _check_keys(state_dict, layouts, "state_dict")
    c = config
    H, r, dk, dv, hidden = c.num_k_heads, c.v_heads_per_k_head, c.head_k_dim, c.head_v_dim, c.hidden_size
    t = {n: canonical_tensor(n, state_dict[n], layout.shape) for n, layout in layouts.items()}
    q, k, v = t["in_proj_qkv.weight"].split(layouts["in_proj_qkv.weight"].blocks)
    per_head = [q.view(H, dk, hidden), k.view(H, dk, hidden), v.view(H, r * dv, hidden),
                t["in_proj_z.weight"].view(H, r * dv, hidden)]
    out = {"in_proj_qkvz.weight": torch.cat(per_head, dim=1).reshape(-1, hidden),
           "in_proj_ba.weight": torch.cat([t["in_proj_b.weight"].view(H, r, hidden),
                                           t["in_proj_a.weight"].view(H, r, hidden)], dim=1).reshape(-1, hidden)}
    target = dataclasses.replace(c, family="qwen3_next")
    for name in parameter_layouts(target):
        if name not in out:
            out[name] = t[name].clone()
    return {name: out[name] for name in parameter_layouts(target)}


# ---- transformers modules ----


def _hf_table(config, hf_config):
    """(entries, other-side shapes) of the transformers module for hf_config; config: its layer."""
    model_type, _ = _hf_text_config(hf_config)
    shapes = _project_shapes(config)
    if config.family in GDN_FAMILIES:  # HF's Qwen GDN modules use the project's names
        return _same(*shapes), dict(shapes)
    kd, vd, W = config.key_dim, config.value_dim, config.conv_size
    renamed = {"f_a_proj.weight": "forget_gate.f_a_proj.weight", "f_b_proj.weight": "forget_gate.f_b_proj.weight",
               "dt_bias": "forget_gate.dt_bias", "A_log": "forget_gate.A_log"}
    conv = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
    entries = [(conv, ("conv1d.weight",))] + [((n,), (renamed.get(n, n),)) for n in shapes if n not in conv]
    other = {renamed.get(n, n): s for n, s in shapes.items() if n not in conv}
    other["conv1d.weight"] = (2 * kd + vd, 1, W)
    # Kimi Linear stores A_log as [1, 1, H, 1], GLM as [H]
    other["forget_gate.A_log"] = (1, 1, config.num_v_heads, 1) if model_type == "kimi_linear" else (config.num_v_heads,)
    return entries, other


def from_hf_state_dict(state_dict, hf_config) -> dict[str, torch.Tensor]:
    """The project layer's dict from a transformers module's (the linear-attention module of a
    model with `hf_config`, keys relative to the module); the layer: from_hf_config(hf_config)."""
    config = _config_from_hf(hf_config)
    entries, other = _hf_table(config, hf_config)
    return _regroup(state_dict, _inverse(entries), other, _project_shapes(config), "state_dict")


def to_hf_state_dict(state_dict, hf_config) -> dict[str, torch.Tensor]:
    """Inverse of from_hf_state_dict: the transformers module's dict from the project layer's."""
    config = _config_from_hf(hf_config)
    entries, other = _hf_table(config, hf_config)
    return _regroup(state_dict, entries, _project_shapes(config), other, "state_dict")


# ---- fla layers ----

# fla's KimiDeltaAttention has a bias on g_proj.1 (the output gate's up projection); the
# project's layer has none, so only a zero bias converts
FLA_KDA_GATE_BIAS = "g_proj.1.bias"


def config_from_fla_layer(layer) -> LinearAttentionConfig:
    """The project's config of an fla GatedDeltaNet (family qwen3_5) or KimiDeltaAttention (kda)
    layer; raises ValueError for an option the project's layer does not implement."""
    kind = type(layer).__name__
    require(kind in ("GatedDeltaNet", "KimiDeltaAttention"), "layer",
            f"must be fla's GatedDeltaNet or KimiDeltaAttention, got {kind}")
    require(layer.use_short_conv, "layer.use_short_conv", "must be True (the project's layers always convolve)")
    require(not layer.conv_bias, "layer.conv_bias", "must be False (the project's short conv has no bias)")
    require(not layer.allow_neg_eigval, "layer.allow_neg_eigval",
            "must be False (the project's beta is sigmoid(b), not 2 * sigmoid(b))")
    fields = dict(hidden_size=layer.hidden_size, num_k_heads=layer.num_heads, num_v_heads=layer.num_v_heads,
                  head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim, conv_size=layer.conv_size,
                  norm_eps=layer.o_norm.eps)
    if kind == "GatedDeltaNet":
        require(layer.use_gate, "layer.use_gate", "must be True (the project's GDN always gates its output norm)")
        act = layer.o_norm.activation
        require(act in SILU_NAMES, "layer.o_norm.activation", f"must be 'swish' or 'silu', got {act!r}")
        return LinearAttentionConfig("qwen3_5", **fields)
    return LinearAttentionConfig("kda", **fields, gate_lower_bound=layer.lower_bound,
                                 output_gate_rank=layer.head_v_dim)


def _fla_table(config):
    _check_family(config, ("qwen3_5", "kda"))
    _check_grouped(config, "fla's layers")
    shapes = _project_shapes(config)
    if config.family == "qwen3_5":
        kd, vd, W = config.key_dim, config.value_dim, config.conv_size
        renamed = {"in_proj_z.weight": "g_proj.weight", "in_proj_b.weight": "b_proj.weight",
                   "in_proj_a.weight": "a_proj.weight", "norm.weight": "o_norm.weight",
                   "out_proj.weight": "o_proj.weight"}
        entries = [(("in_proj_qkv.weight",), ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
                   (("conv1d.weight",), ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"))]
        entries += [((n,), (renamed.get(n, n),)) for n in shapes if n not in ("in_proj_qkv.weight", "conv1d.weight")]
        other = {renamed.get(n, n): s for n, s in shapes.items()}
        del other["in_proj_qkv.weight"], other["conv1d.weight"]
        hidden = config.hidden_size
        other.update({"q_proj.weight": (kd, hidden), "k_proj.weight": (kd, hidden), "v_proj.weight": (vd, hidden),
                      "q_conv1d.weight": (kd, 1, W), "k_conv1d.weight": (kd, 1, W), "v_conv1d.weight": (vd, 1, W)})
        return entries, other
    require(config.output_gate_rank == config.head_v_dim, "config.output_gate_rank",
            f"must equal head_v_dim={config.head_v_dim} for fla's KimiDeltaAttention (its g_proj is "
            f"hidden -> head_v_dim -> value dim), got {config.output_gate_rank!r}")
    renamed = {"f_a_proj.weight": "f_proj.0.weight", "f_b_proj.weight": "f_proj.1.weight",
               "g_a_proj.weight": "g_proj.0.weight", "g_b_proj.weight": "g_proj.1.weight"}
    return [((n,), (renamed.get(n, n),)) for n in shapes], {renamed.get(n, n): s for n, s in shapes.items()}


def from_fla_state_dict(state_dict, config: LinearAttentionConfig) -> dict[str, torch.Tensor]:
    """The project layer's dict from an fla layer's: GatedDeltaNet -> config.family 'qwen3_5',
    KimiDeltaAttention -> 'kda' (config: see config_from_fla_layer). fla KDA's g_proj.1.bias must
    be zero (the project's output gate has no bias)."""
    entries, other = _fla_table(config)
    if config.family == "kda":
        require(FLA_KDA_GATE_BIAS in state_dict, "state_dict", f"must hold fla KDA's {FLA_KDA_GATE_BIAS!r}")
        bias = canonical_tensor(FLA_KDA_GATE_BIAS, state_dict[FLA_KDA_GATE_BIAS], (config.value_dim,))
        require(not bias.any(), f"state_dict[{FLA_KDA_GATE_BIAS!r}]",
                f"must be zero (the project's output gate has no bias), got max |bias| = {bias.abs().max():.3g}")
        state_dict = {k: v for k, v in state_dict.items() if k != FLA_KDA_GATE_BIAS}
    return _regroup(state_dict, _inverse(entries), other, _project_shapes(config), "state_dict")


def to_fla_state_dict(state_dict, config: LinearAttentionConfig) -> dict[str, torch.Tensor]:
    """Inverse of from_fla_state_dict; for KDA, g_proj.1.bias is written as zeros."""
    entries, other = _fla_table(config)
    out = _regroup(state_dict, entries, _project_shapes(config), other, "state_dict")
    if config.family == "kda":
        weight = out["g_proj.1.weight"]
        out[FLA_KDA_GATE_BIAS] = torch.zeros(config.value_dim, dtype=weight.dtype, device=weight.device)
    return out


# ---- megatron-core GatedDeltaNet ----

MEGATRON_OUT_NORM = "out_norm.weight"
MEGATRON_EXTRA_STATE = "._extra_state"


def _megatron_table(local: LinearAttentionConfig):
    """Entries and megatron shapes of one TP rank, from the qwen3_5 layout of its shard:
    in_proj rows are [q | k | v | z | beta | alpha] of this rank's heads."""
    shapes = _project_shapes(local)
    in_proj = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
    renamed = {"norm.weight": MEGATRON_OUT_NORM}
    entries = [(in_proj, ("in_proj.weight",))] + [((n,), (renamed.get(n, n),)) for n in shapes if n not in in_proj]
    other = {renamed.get(n, n): s for n, s in shapes.items() if n not in in_proj}
    other["in_proj.weight"] = (sum(shapes[n][0] for n in in_proj), local.hidden_size)
    return entries, other


def to_megatron_state_dict(state_dict, config: LinearAttentionConfig, *, tp_rank: int = 0, tp_size: int = 1,
                           layernorm_zero_centered_gamma: bool = False) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s megatron-core GatedDeltaNet dict from the replicated project layer's
    (config.family 'qwen3_5' or 'qwen3_next'; tp_size=1: the whole layer).

    Megatron keys: in_proj.weight, conv1d.weight, dt_bias, A_log, out_norm.weight, out_proj.weight
    (a layer built without biases). The rank holds its heads of every in_proj section, so the
    ranks' in_proj tensors concatenated are not the tp_size=1 tensor.
    layernorm_zero_centered_gamma: Megatron's option (its norm applies 1 + w), stores w - 1. For
    weights only: a gradient is the same in both parametrisations, convert it with False.
    """
    _check_family(config, GDN_FAMILIES)
    _check_grouped(config, "megatron-core's GatedDeltaNet")
    if config.family == "qwen3_next":
        state_dict, config = qwen3_next_to_qwen3_5(state_dict, config), dataclasses.replace(config, family="qwen3_5")
    shard = shard_state_dict(state_dict, config, tp_rank, tp_size)
    local = config.local(tp_size)
    entries, other = _megatron_table(local)
    out = _regroup(shard, entries, _project_shapes(local), other, "state_dict")
    if layernorm_zero_centered_gamma:
        out[MEGATRON_OUT_NORM] = out[MEGATRON_OUT_NORM] - 1
    return out


def from_megatron_state_dicts(shards, config: LinearAttentionConfig, *,
                              layernorm_zero_centered_gamma: bool = False) -> dict[str, torch.Tensor]:
    """The replicated project layer's dict (config.family 'qwen3_5' or 'qwen3_next') from the
    megatron-core GatedDeltaNet dicts of every TP rank, in rank order (one dict for tp_size=1);
    their `._extra_state` entries (module metadata, no weights) are skipped.

    Inverse of to_megatron_state_dict; the same for gradient dicts (with
    layernorm_zero_centered_gamma=False). out_norm.weight is replicated and taken from rank 0, as
    unshard_state_dict does: reduce a replicated weight's gradient over TP before converting.
    """
    _check_family(config, GDN_FAMILIES)
    _check_grouped(config, "megatron-core's GatedDeltaNet")
    if isinstance(shards, dict) or not isinstance(shards, (list, tuple)) or not shards:
        raise ValueError("shards must be a non-empty list of per-rank megatron dicts in TP rank order")
    target = config
    config = dataclasses.replace(config, family="qwen3_5")
    local = config.local(len(shards))
    entries, other = _megatron_table(local)
    # `<module>._extra_state` entries are module metadata (None, or Transformer Engine's FP8
    # state), not weights; Megatron's state_dict() has them, load_state_dict does not need them
    shards = [{k: v for k, v in s.items() if not k.endswith(MEGATRON_EXTRA_STATE)} if isinstance(s, dict) else s
              for s in shards]
    local_dicts = [_regroup(s, _inverse(entries), other, _project_shapes(local), f"shards[{r}]") for r, s in enumerate(shards)]
    full = unshard_state_dict(local_dicts, config)
    if layernorm_zero_centered_gamma:
        full["norm.weight"] = full["norm.weight"] + 1
    return qwen3_5_to_qwen3_next(full, config) if target.family == "qwen3_next" else full
