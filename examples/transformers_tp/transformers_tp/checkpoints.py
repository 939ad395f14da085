"""Tiny random Qwen3-Next, Qwen3.5 and Kimi Linear checkpoints, written with `save_pretrained`.

Every model: hidden size 64, vocabulary 96, 3 linear-attention layers and 1 full-attention layer
(the full-attention layer last). Qwen3-Next and Qwen3.5: Gated DeltaNet with 2 key heads x 16 and
4 value heads x 8, a dense MLP in every layer, gated full attention with 4 query heads and 2
key/value heads of 16 (q_norm / k_norm). Kimi Linear: KDA with 4 heads x 16, MLA full attention,
the first layer's MLP dense and the others MoE (4 experts, top 2, 1 shared).

Random init leaves norms at 1 and many weights at std 0.02; `perturb` redraws every parameter so
that every gradient is informative (a norm weight of exactly 1 would hide a wrong scale).
"""

from __future__ import annotations

import os

import torch

__all__ = ["MODELS", "config", "write_checkpoint"]

MODELS = ("qwen3_next", "qwen3_5", "kimi_linear")

_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]

_GDN = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, layer_types=_LAYER_TYPES,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4,
            rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def config(model: str):
    """The tiny config of `model` (one of MODELS)."""
    import transformers

    if model == "qwen3_next":
        # mlp_only_layers: a dense MLP in every layer (the MoE block is Qwen3-Next's default)
        return transformers.Qwen3NextConfig(mlp_only_layers=[0, 1, 2, 3], num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=32, **_GDN)
    if model == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**_GDN)
    if model == "kimi_linear":
        return transformers.KimiLinearConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            v_head_dim=16, qk_nope_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            n_group=1, topk_group=1, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
            layer_types=_LAYER_TYPES, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def _causal_lm(model: str):
    import transformers

    return {"qwen3_next": transformers.Qwen3NextForCausalLM, "qwen3_5": transformers.Qwen3_5ForCausalLM,
            "kimi_linear": transformers.KimiLinearForCausalLM}[model]


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: A_log in [-1, 1), dt_bias ~ 0.5 N(0, 1), 1-D norm weights 1 + 0.2 N(0, 1),
    everything else 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, dtype=p.dtype).uniform_(-1.0, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def write_checkpoint(model: str, path: str | os.PathLike, seed: int = 1234) -> str:
    """Build `model`'s tiny config with perturbed random weights and `save_pretrained` it (float32
    safetensors) at `path`; returns the path."""
    torch.manual_seed(seed)
    lm = _causal_lm(model)(config(model))
    perturb(lm, seed)
    lm.save_pretrained(path)
    return str(path)
