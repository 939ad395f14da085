"""Depthwise causal short convolution, fla's `causal_conv1d` convention.

y[t, d] = act(bias[d] + sum_{s=0}^{W-1} weight[d, W-1-s] * x[t-s, d]): the last weight column
multiplies the current token, column 0 the token W-1 steps back. Tokens before the start of a
token's own sequence count as zero, so nothing crosses a packed-sequence boundary.
"""

import torch
import torch.nn.functional as F

from linattn.checks import require, sequence_bounds, validate_compute_dtype, validate_floating, validate_shape

ACTIVATIONS = ("silu", "swish", None)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """x `[B, T, D]` (B = 1 with cu_seqlens), weight `[D, W]`, bias `[D]`; returns `[B, T, D]` in compute_dtype."""
    validate_floating(x, "x")
    validate_floating(weight, "weight")
    validate_compute_dtype(compute_dtype)
    require(x.dim() == 3, "x", f"must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    require(weight.dim() == 2 and weight.shape[0] == D and weight.shape[1] >= 1, "weight",
            f"must be [D, W] with D={D} and W >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        validate_floating(bias, "bias")
        validate_shape(bias, (D,), "bias")
    require(activation in ACTIVATIONS, "activation", f"must be one of {ACTIVATIONS}, got {activation!r}")
    bounds = sequence_bounds(B, T, cu_seqlens, name="x")

    x = x.to(compute_dtype)
    weight = weight.to(device=x.device, dtype=compute_dtype)
    W = weight.shape[1]
    # position of every token inside its own sequence: a shift by s may only reach back that far
    starts = torch.tensor(bounds[:-1], device=x.device)
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=x.device)
    if cu_seqlens is None:
        position = torch.arange(T, device=x.device)
    else:
        position = torch.arange(T, device=x.device) - torch.repeat_interleave(starts, lengths)

    zero = torch.zeros((), dtype=compute_dtype, device=x.device)
    y = x * weight[:, W - 1]
    for s in range(1, min(W, T)):
        shifted = F.pad(x[:, : T - s], (0, 0, s, 0))
        inside = (position >= s)[None, :, None]
        # where(), not a multiply by 0, so the other sequence's values never enter the sum
        y = y + torch.where(inside, shifted, zero) * weight[:, W - 1 - s]
    if bias is not None:
        y = y + bias.to(device=x.device, dtype=compute_dtype)
    if activation is not None:
        y = F.silu(y)
    return y
