"""transformers #48256 (open; live in transformers 5.17.0): a right-padded prefill corrupts the
linear-attention cache, so the next decode step differs from the unpadded run.

    python suites/live_bugs/transformers_48256_right_padded_prefill_cache.py     # CPU, float64, seconds

A one-layer Qwen3-Next GatedDeltaNet (`Qwen3NextGatedDeltaNet`) of a tiny config on transformers'
torch path (fla is kept from transformers' import, as on a machine without fla). The cache keeps
the call's last W conv columns, the zeroed pads included (`LinearAttentionLayer.update_conv_state`,
cache_utils.py:1083), and the recurrence runs over the pads as over zero-input tokens (beta and g
of the zeroed pads: modeling_qwen3_next.py:719, :721). Compared: the decode step's output after
the prompt prefilled with 2 right pads (mask 1 1 1 0 0) against after the same prompt unpadded;
the control: the same pads on the left.
"""
import sys

sys.modules["fla"] = None  # transformers resolves its kernels at import: no fla, the torch path

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, Qwen3NextConfig  # noqa: E402
from transformers.masking_utils import create_recurrent_attention_mask  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet  # noqa: E402

transformers.logging.set_verbosity_error()  # the torch path's "falling back" warning
torch.manual_seed(0)
config = Qwen3NextConfig(hidden_size=20, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                         linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                         layer_types=["linear_attention"], num_experts=0)
layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).double().eval()
prompt, pads = torch.randn(1, 3, 20, dtype=torch.float64), 2
step = torch.randn(1, 1, 20, dtype=torch.float64)


def decode_after(x, mask):
    cache = DynamicCache(config=config)
    with torch.no_grad():
        layer(x, cache_params=cache, attention_mask=create_recurrent_attention_mask(config, x, mask))
        conv, state = cache.layers[0].conv_states[0].clone(), cache.layers[0].recurrent_states[0].clone()
        return layer(step, cache_params=cache), conv, state


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


y_ref, conv_ref, state_ref = decode_after(prompt, torch.ones(1, 3, dtype=torch.long))
padded = torch.cat([prompt, torch.randn(1, pads, 20, dtype=torch.float64)], dim=1)
mask = torch.tensor([[1] * 3 + [0] * pads])
y, conv, state = decode_after(padded, mask)
print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float64, torch path (no fla)")
print(f"Qwen3NextGatedDeltaNet: prompt of 3 tokens prefilled with attention_mask {mask.tolist()[0]} vs unpadded, "
      "then one decode step from the cache:")
print(f"  cached conv state {rel(conv, conv_ref):.2e}, cached recurrent state {rel(state, state_ref):.2e} "
      f"(relative error)")
print(f"  decode step's output: relative error {rel(y, y_ref):.2e} (0 expected: the pads are masked)")
y_left, _, _ = decode_after(padded.roll(pads, dims=1), mask.roll(pads, dims=1))  # the control: left padding
print(f"  the same pads on the left (mask {mask.roll(pads, dims=1).tolist()[0]}): {rel(y_left, y_ref):.2e}")
