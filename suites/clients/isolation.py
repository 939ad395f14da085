"""Models and decoder stacks for `pytest_linattn.harness.assert_document_isolation`.

- `DecoderStack`: linattn's layers inside a small pre-norm decoder (RMSNorm, linear attention,
  residual, RMSNorm, MLP, residual), float64. It takes the boundaries as `cu_seqlens`, or derives
  them from `position_ids` restarting at 0 per document (as a packing collator gives them).
  Planted bugs, each a subclass (model-level packing plumbing):
    DropsCuSeqlens        the decoder gets cu_seqlens but hands the layer the whole row as one
                          sequence
    IgnoresPositionIds    the decoder reads only cu_seqlens; given position_ids alone it runs the
                          row as one sequence (transformers' GatedDeltaNet models do this)
    ConvOnlyBoundaries    the short conv gets the boundaries, the recurrence does not
- `hf_model(family, seed)`: transformers' Qwen3-Next, Qwen3.5 (text) and Kimi Linear, two layers
  (one linear-attention layer, one full-attention layer), small, float64; `hf_call(model)` runs
  it on input embeddings and returns the last hidden states.
- `torch_fallbacks(*modules)`: transformers' own torch fallbacks for fla's kernels bound in
  place of fla's, with the wrapper's state as a machine without fla has it (what such a machine
  runs, transformers' packed-sequence guard included), restored on exit.
- `boundary_aware_conv(modeling)`: a short conv for `modeling.causal_conv1d_fn` that honours the
  `cu_seq_lens_q` kwarg the model passes it (transformers' torch fallback drops it).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn as nn

from cases.layer_parity import random_state_dict
from linattn.layers import GatedDeltaNet, LinearAttentionConfig, build_layer

__all__ = ["boundary_aware_conv", "ConvOnlyBoundaries", "DecoderStack", "DropsCuSeqlens", "IgnoresPositionIds", "HF_FAMILIES", "hf_call",
           "hf_model", "stack_call", "torch_fallbacks"]


def boundaries_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens `[N + 1]` int32 of a packed row whose position ids restart at 0 per document."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"position_ids must be one packed row [1, T], got {tuple(position_ids.shape)}")
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("position_ids must start at 0 (a packed row: each document restarts at 0)")
    return torch.tensor(starts + [position_ids.shape[1]], dtype=torch.int32)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=torch.float64))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, layer: nn.Module, hidden: int, gen: torch.Generator):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.mixer = layer
        self.up = nn.Parameter(torch.randn(2 * hidden, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5)
        self.down = nn.Parameter(torch.randn(hidden, 2 * hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5)

    def forward(self, x, cu_seqlens):
        x = x + self.mixer(self.attn_norm(x), cu_seqlens)
        return x + torch.nn.functional.silu(self.mlp_norm(x) @ self.up.T) @ self.down.T


class DecoderStack(nn.Module):
    """`layers` blocks of linattn's layer of `config`, seeded weights, float64."""

    layer_class = None  # None: build_layer's class for the family

    def __init__(self, config: LinearAttentionConfig, *, layers: int = 2, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        blocks = []
        for i in range(layers):
            if self.layer_class is None:
                layer = build_layer(config, dtype=torch.float64)
            else:
                layer = self.layer_class(config, dtype=torch.float64)
            layer.load_state_dict(random_state_dict(config, seed=seed * 100 + i))
            blocks.append(Block(layer, config.hidden_size, gen))
        self.blocks = nn.ModuleList(blocks)

    def layer_boundaries(self, x, cu_seqlens, position_ids):
        """The boundaries the linear-attention layers get: cu_seqlens, or those position_ids
        imply, or the whole row as one sequence."""
        if cu_seqlens is not None:
            return cu_seqlens
        if position_ids is not None:
            return boundaries_from_position_ids(position_ids)
        return torch.tensor([0, x.shape[1]], dtype=torch.int32)

    def forward(self, x, cu_seqlens=None, position_ids=None):
        cu = self.layer_boundaries(x, cu_seqlens, position_ids)
        for block in self.blocks:
            x = block(x, cu)
        return x


class DropsCuSeqlens(DecoderStack):
    """Planted: the boundaries stop at the decoder; the layers see one sequence."""

    def layer_boundaries(self, x, cu_seqlens, position_ids):
        return torch.tensor([0, x.shape[1]], dtype=torch.int32)


class IgnoresPositionIds(DecoderStack):
    """Planted: only an explicit cu_seqlens reaches the layers; position_ids are never read."""

    def layer_boundaries(self, x, cu_seqlens, position_ids):
        return super().layer_boundaries(x, cu_seqlens, None)


class _ConvOnlyGatedDeltaNet(GatedDeltaNet):
    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        whole_row = torch.tensor([0, q.shape[1]], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        return super()._delta_rule(q, k, v, g, beta, whole_row, cp_context, carry, **gate)


class ConvOnlyBoundaries(DecoderStack):
    """Planted: the short conv gets cu_seqlens, the delta rule runs over the whole row."""

    layer_class = _ConvOnlyGatedDeltaNet


def stack_call(stack: DecoderStack):
    """model_call for assert_document_isolation: the stack's outputs for inputs and the feed's kwargs."""

    def call(inputs, cu_seqlens=None, position_ids=None):
        return stack(inputs, cu_seqlens=cu_seqlens, position_ids=position_ids)

    return call


# ---- transformers' models ----

HF_FAMILIES = ("qwen3_next", "qwen3_5", "kimi_linear")


def hf_model(family: str, seed: int = 0):
    """transformers' model of `family`: layer 0 linear attention, layer 1 full attention; hidden
    16, float64, eval mode, sdpa attention, weights drawn with `seed`."""
    torch.manual_seed(seed)  # transformers initialises from the global generator
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextModel

        config = Qwen3NextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                                 linear_conv_kernel_dim=4, num_experts=0,
                                 layer_types=["linear_attention", "full_attention"])
        model = Qwen3NextModel(config)
    elif family == "qwen3_5":
        from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

        config = Qwen3_5TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                                   linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
        model = Qwen3_5TextModel(config)
    elif family == "kimi_linear":
        from transformers import KimiLinearConfig, KimiLinearModel

        config = KimiLinearConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                  linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                                                      "head_dim": 8, "short_conv_kernel_size": 4},
                                  mlp_layer_types=["dense", "dense"], q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
                                  qk_rope_head_dim=4, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = KimiLinearModel(config)
    else:
        raise ValueError(f"family must be one of {HF_FAMILIES}, got {family!r}")
    model.config._attn_implementation = "sdpa"
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():  # never zeros (zero-centred norms start at 0)
            if not p.abs().sum() > 0:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for m in model.modules():
            # a gentle decay (A in [0.2, 2], dt_bias ~ N(0, 0.25)): transformers' init decays by up
            # to e^-20 a token, so a leaked state would fall under the float32 fallbacks' rounding
            if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                m.A_log.copy_(torch.empty(m.A_log.shape, dtype=m.A_log.dtype).uniform_(0.2, 2.0, generator=gen).log())
                m.dt_bias.copy_(0.5 * torch.randn(m.dt_bias.shape, generator=gen, dtype=m.dt_bias.dtype))
    return model


def hf_call(model):
    """model_call: input embeddings and the feed's kwargs -> the last hidden states."""

    def call(inputs, **kwargs):
        return model(inputs_embeds=inputs, use_cache=False, **kwargs).last_hidden_state

    return call


@contextlib.contextmanager
def torch_fallbacks(*modules):
    """What a machine without fla binds, in each `use_kernel_func_from_hub_with_fallback` wrapper
    of `modules` that holds one of fla's functions: the wrapper's closure as if fla had not
    imported. transformers decides three things once, at import, and reads them on every call:
    `implementation` (here the wrapped torch function), `is_new_implementation` (False: the torch
    path; from 5.20 the packed-sequence guard reads it) and `applicable_params` (the torch
    function's parameters, the kwargs it is handed). Restored on exit; yields the number of
    wrappers rebound (0 when transformers' wrapper no longer has these names)."""
    rebound = []
    for module in modules:
        for fn in vars(module).values():
            torch_function = getattr(fn, "__wrapped__", None)
            code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
            if not callable(fn) or torch_function is None or code is None or closure is None:
                continue
            cells = dict(zip(code.co_freevars, closure))
            if not {"implementation", "is_new_implementation", "applicable_params"} <= cells.keys():
                continue
            implementation = cells["implementation"].cell_contents
            if implementation is torch_function or not getattr(implementation, "__module__", "").startswith("fla"):
                continue
            without_fla = {"implementation": torch_function, "is_new_implementation": False,
                           "applicable_params": tuple(inspect.signature(torch_function).parameters)}
            for name, value in without_fla.items():
                rebound.append((cells[name], cells[name].cell_contents))
                cells[name].cell_contents = value
    try:
        yield len(rebound) // 3
    finally:
        for cell, value in reversed(rebound):
            cell.cell_contents = value


def boundary_aware_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' `causal_conv1d_fn` signature (x `[B, D, T]`, weight `[D, W]`), computed by
    linattn's short conv within the documents of `cu_seq_lens_q` (whole rows without it)."""
    from linattn.kernels import short_conv

    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None or silu, got {activation!r}")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    y = short_conv(hidden_states.transpose(1, 2), weight, cu_seqlens=cu_seqlens, bias=bias,
                   activation=None if activation is None else "silu")
    return y.transpose(1, 2).to(hidden_states.dtype)
