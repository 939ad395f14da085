"""Configuration shared by every linear-attention layer family.

Families (parameter names follow each family's Hugging Face checkpoint, see state_dict.py):

    qwen3_next  GatedDeltaNet, fused in_proj_qkvz / in_proj_ba grouped per key head (Qwen3-Next)
    qwen3_5     GatedDeltaNet, separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5)
    kda         KimiDeltaAttention, per-key-channel decay (Kimi Linear and successors)
"""

from __future__ import annotations

import dataclasses

from linattn.checks import positive_int, require
from linattn.heads import HEAD_PAIRINGS, check_head_pairing, key_head_of

FAMILIES = ("qwen3_next", "qwen3_5", "kda")
GDN_FAMILIES = ("qwen3_next", "qwen3_5")

__all__ = ["FAMILIES", "GDN_FAMILIES", "HEAD_PAIRINGS", "LinearAttentionConfig"]


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Sizes of one linear-attention layer (the replicated, unsharded layer).

    family: one of FAMILIES.
    num_k_heads / num_v_heads: query-key heads and value heads (num_v_heads a multiple of
        num_k_heads: grouped value attention).
    head_pairing: which key head value head j reads when num_v_heads > num_k_heads (HEAD_PAIRINGS,
        linattn.heads): "grouped" (the default), j // (num_v_heads // num_k_heads), the order of
        every family's Hugging Face checkpoint (transformers' modules repeat q and k with
        repeat_interleave), of fla's layers and kernels and of Megatron's GDN; or "tiled",
        j % num_k_heads, the order llama.cpp's GGUF conversion gives Qwen3.5's value heads (ggml
        broadcasts tiled). Every value-head tensor (v, z, b, a, A_log, dt_bias, the output
        projection's columns, the recurrent state) is in that order; TP gives each rank the value
        heads of its key heads under it. With num_v_heads == num_k_heads both are the identity.
    conv_size: width W of the causal depthwise short convolution on q, k and v.
    norm_eps: epsilon of the gated RMSNorm on the recurrence output.
    gate_lower_bound (kda only): None gives g = -exp(A_log) * softplus(f + dt_bias); a negative
        number b gives fla's bounded gate g = b * sigmoid(exp(A_log) * (f + dt_bias)), in [b, 0).
    output_gate_rank (kda only): None gives a full-rank output gate `g_proj`; an int r gives
        Kimi Linear's low-rank pair `g_a_proj` (hidden -> r) and `g_b_proj` (r -> value dim).
    """

    family: str
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_size: int = 4
    norm_eps: float = 1e-6
    gate_lower_bound: float | None = None
    output_gate_rank: int | None = None
    head_pairing: str = "grouped"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_size"):
            positive_int(getattr(self, name), name)
        if self.num_v_heads % self.num_k_heads != 0:
            raise ValueError(
                f"num_v_heads must be a multiple of num_k_heads (grouped value attention), "
                f"got num_v_heads={self.num_v_heads}, num_k_heads={self.num_k_heads}"
            )
        check_head_pairing(self.head_pairing, "head_pairing")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")
        if self.family != "kda" and (self.gate_lower_bound is not None or self.output_gate_rank is not None):
            raise ValueError(f"gate_lower_bound and output_gate_rank apply to family 'kda' only, not {self.family!r}")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ValueError(f"gate_lower_bound must be negative (a log decay), got {self.gate_lower_bound!r}")
        rank = self.output_gate_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
            raise ValueError(f"output_gate_rank must be None or a positive int, got {rank!r}")

    @classmethod
    def from_hf_config(cls, config) -> "LinearAttentionConfig":
        """The linear-attention layer of a transformers config: model types qwen3_next, qwen3_5
        (and qwen3_5_moe; their text_config), kimi_linear, glm5_next (its text_config).

        Reads the head counts and dims, conv size, norm eps (rms_norm_eps: 1e-5 for Kimi and GLM),
        GLM's gate lower bound (linear_lower_bound) and the KDA output gate's rank (head_dim); the
        head pairing is "grouped", as the checkpoints and transformers' modules pair heads. Raises
        ValueError for another model type or a field value the layers do not implement.
        """
        return _config_from_hf(config)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def v_heads_per_k_head(self) -> int:
        return self.num_v_heads // self.num_k_heads

    def key_head_of(self, value_head: int) -> int:
        """The key head value head `value_head` reads (`head_pairing`)."""
        return key_head_of(value_head, self.num_k_heads, self.num_v_heads, self.head_pairing)

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v, in that order."""
        return 2 * self.key_dim + self.value_dim

    @property
    def op(self) -> str:
        """Recurrence, named as its linattn.kernels entry: 'gated_delta_rule' (scalar decay per value
        head) or 'kda' (decay per key channel)."""
        return "kda" if self.family == "kda" else "gated_delta_rule"

    def check_tensor_parallel_size(self, tp_size: int) -> None:
        """TP splits whole key heads (and with them their value heads): tp_size must divide
        num_k_heads; or, beyond the key heads, be a multiple of num_k_heads that divides
        num_v_heads: then each key head is replicated over tp_size / num_k_heads consecutive
        ranks, each holding its share of that key head's value heads."""
        positive_int(tp_size, "tp_size")
        H, HV = self.num_k_heads, self.num_v_heads
        if H % tp_size != 0 and (tp_size % H != 0 or HV % tp_size != 0):
            raise ValueError(
                f"tensor parallel size must divide num_k_heads: tp_size={tp_size}, num_k_heads={H}, num_v_heads={HV} "
                f"(or, beyond the key heads, be a multiple of num_k_heads that divides num_v_heads: each key head "
                f"replicated over tp_size / num_k_heads ranks)"
            )

    def key_head_replicas(self, tp_size: int) -> int:
        """How many TP ranks hold each key head: 1 when tp_size divides num_k_heads, else
        tp_size / num_k_heads (consecutive ranks; rank i holds key head i // replicas)."""
        self.check_tensor_parallel_size(tp_size)
        return max(1, tp_size // self.num_k_heads)

    def value_heads_of_rank(self, tp_size: int, tp_rank: int) -> list[int]:
        """The value heads TP rank `tp_rank` of `tp_size` holds, in its local order: those reading
        its key heads (tiled: the rank's slots of each tile)."""
        local, replicas = self.local(tp_size), self.key_head_replicas(tp_size)
        require(isinstance(tp_rank, int) and 0 <= tp_rank < tp_size, "tp_rank",
                f"must be an int in [0, {tp_size}), got {tp_rank!r}")
        H, r, local_r = self.num_k_heads, self.v_heads_per_k_head, local.v_heads_per_k_head
        key0, slot0 = tp_rank // replicas * local.num_k_heads, tp_rank % replicas * local_r
        heads = []
        for j in range(local.num_v_heads):
            k, m = (j // local_r, j % local_r) if self.head_pairing == "grouped" else (j % local.num_k_heads,
                                                                                      j // local.num_k_heads)
            key, slot = key0 + k, slot0 + m
            heads.append(key * r + slot if self.head_pairing == "grouped" else slot * H + key)
        return heads

    def local(self, tp_size: int) -> "LinearAttentionConfig":
        """The config of one TP rank's shard: 1/tp_size of the value heads, and 1/tp_size of the
        key heads (one key head when tp_size is beyond them), paired as this config pairs them: a
        rank holding key heads [a, b) holds the value heads that read them, in the same order
        (tiled: the rank's r tiles of b - a heads)."""
        replicas = self.key_head_replicas(tp_size)
        return dataclasses.replace(
            self, num_k_heads=self.num_k_heads * replicas // tp_size, num_v_heads=self.num_v_heads // tp_size
        )


# ---- transformers configs ----

GDN_MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5"}
KDA_MODEL_TYPES = ("kimi_linear", "glm5_next_text")
# multimodal wrappers whose language model sits in config.text_config
WRAPPER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "glm5_next")
# activations HF's modules apply after the short conv; the project's layers apply SiLU
SILU_NAMES = ("silu", "swish")


def _hf_text_config(config):
    """(model type, the config that holds the linear-attention fields) of a transformers config."""
    model_type = getattr(config, "model_type", None)
    if model_type in WRAPPER_MODEL_TYPES:
        config = config.text_config
        model_type = getattr(config, "model_type", None)
    supported = (*GDN_MODEL_TYPES, *KDA_MODEL_TYPES, *WRAPPER_MODEL_TYPES)
    require(model_type in GDN_MODEL_TYPES or model_type in KDA_MODEL_TYPES, "config.model_type",
            f"must be one of {supported} (a model with linear-attention layers the project implements), "
            f"got {model_type!r}")
    return model_type, config


def _config_from_hf(config) -> LinearAttentionConfig:
    """LinearAttentionConfig.from_hf_config's logic (one place; see its docstring)."""
    model_type, c = _hf_text_config(config)
    act = getattr(c, "hidden_act", None)
    require(act in SILU_NAMES, "config.hidden_act",
            f"must be 'silu' (the short conv's activation in the project's layers), got {act!r}")
    if model_type in GDN_MODEL_TYPES:
        fields = dict(family=GDN_MODEL_TYPES[model_type], hidden_size=c.hidden_size,
                      num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads,
                      head_k_dim=c.linear_key_head_dim, head_v_dim=c.linear_value_head_dim)
    else:
        # Kimi Linear and GLM: equal key and value heads, low-rank output gate hidden -> head_dim
        lower_bound = getattr(c, "linear_lower_bound", None) if model_type == "glm5_next_text" else None
        require(lower_bound is None or (isinstance(lower_bound, (int, float)) and lower_bound < 0),
                "config.linear_lower_bound", f"must be None or negative (a log decay), got {lower_bound!r}")
        fields = dict(family="kda", hidden_size=c.hidden_size, num_k_heads=c.linear_num_heads,
                      num_v_heads=c.linear_num_heads, head_k_dim=c.linear_head_dim, head_v_dim=c.linear_head_dim,
                      gate_lower_bound=None if lower_bound is None else float(lower_bound),
                      output_gate_rank=c.linear_head_dim)
    try:
        return LinearAttentionConfig(**fields, conv_size=c.linear_conv_kernel_dim, norm_eps=c.rms_norm_eps)
    except ValueError as err:
        raise ValueError(f"config ({model_type}) gives an invalid layer: {err}") from None
