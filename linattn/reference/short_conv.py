"""Depthwise causal short convolution, fla's `causal_conv1d` convention.

y[t, d] = act(bias[d] + sum_{s=0}^{W-1} weight[d, W-1-s] * x[t-s, d]): the last weight column
multiplies the current token, column 0 the token W-1 steps back. Tokens before the start of a
token's own sequence count as zero, so nothing crosses a packed-sequence boundary.

With a conv state (`initial_state` `[N, D, W-1]`, one per sequence, oldest input first) the
tokens before a sequence's start are the state's instead of zero; the final state is each
sequence's last W-1 inputs (the incoming state's where the sequence is shorter). fla's and
transformers' caches are W wide (their slot 0 never enters the convolution); this one is not.
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
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """x `[B, T, D]` (B = 1 with cu_seqlens), weight `[D, W]`, bias `[D]`; returns `[B, T, D]` in
    compute_dtype, or with output_final_state `(y, final_state [N, D, W-1])` (N sequences: B rows,
    or cu_seqlens' sequences)."""
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
    W = weight.shape[1]
    N = len(bounds) - 1
    if initial_state is not None:
        validate_floating(initial_state, "initial_state")
        validate_shape(initial_state, (N, D, W - 1), "initial_state")
    if initial_state is not None or output_final_state:
        return _with_state(x, weight, bounds, bias, activation, compute_dtype, initial_state, output_final_state)

    x = x.to(compute_dtype)
    weight = weight.to(device=x.device, dtype=compute_dtype)
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


def _with_state(x, weight, bounds, bias, activation, compute_dtype, initial_state, output_final_state):
    """Each sequence's W-1 state inputs put before its tokens (one packed batch of extended
    sequences), the convolution run on that, the extended part's outputs dropped."""
    B, T, D = x.shape
    W = weight.shape[1]
    N = len(bounds) - 1
    flat = x.to(compute_dtype).reshape(1, B * T, D)
    if initial_state is None:
        history = flat.new_zeros(N, W - 1, D)
    else:
        history = initial_state.to(device=x.device, dtype=compute_dtype).transpose(1, 2)  # [N, W-1, D]
    pieces, ext_bounds, keep = [], [0], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        pieces += [history[n], flat[0, bos:eos]]
        keep.append(torch.arange(ext_bounds[-1] + W - 1, ext_bounds[-1] + W - 1 + eos - bos))
        ext_bounds.append(ext_bounds[-1] + W - 1 + eos - bos)
    extended = torch.cat(pieces).unsqueeze(0)
    ext_cu = torch.tensor(ext_bounds, device=x.device)
    y = short_conv(extended, weight, ext_cu, bias, activation, compute_dtype=compute_dtype)
    y = y[:, torch.cat(keep).to(x.device)].reshape(B, T, D)
    if not output_final_state:
        return y
    final = torch.stack([extended[0, end - (W - 1):end] for end in ext_bounds[1:]])
    return y, final.transpose(1, 2)
