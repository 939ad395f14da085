"""Depthwise causal short convolution: one entry, backends as a parameter.

"torch" runs linattn.reference.short_conv in the input's dtype (CPU, or any device);
"triton", "mix" and "cuda" run fla 0.6.0's causal_conv1d (fla/modules/causal_conv1d/ops.py):
"mix" is its FastCausalConv1dFn, a Triton forward with causal-conv1d's CUDA backward.
"""

import torch

from linattn import selection
from linattn.checks import fail

BACKENDS = ("torch",) + selection.CONV_BACKENDS
ACTIVATIONS = ("silu", "swish", None)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    backend: str | None = None,
) -> torch.Tensor:
    """x `[B, T, D]` (B = 1 with cu_seqlens), weight `[D, W]`, bias `[D]`; returns `[B, T, D]` in x's dtype.

    backend None: `selection.short_conv_backend()` for CUDA tensors, "torch" otherwise.
    """
    if not (backend is None or backend in BACKENDS):
        fail("backend", f"must be None or one of {BACKENDS}, got {backend!r}")
    if activation not in ACTIVATIONS:
        fail("activation", f"must be one of {ACTIVATIONS}, got {activation!r}")
    if not (isinstance(x, torch.Tensor) and x.dim() == 3):
        fail("x", f"must be a [B, T, D] tensor, got {getattr(x, 'shape', x)!r}")
    if not (weight.dim() == 2 and weight.shape[0] == x.shape[2]):
        fail("weight", f"must be [D, W] with D={x.shape[2]}, got shape {tuple(weight.shape)}")
    if backend is None:
        backend = selection.short_conv_backend() if x.is_cuda else "torch"
    if backend == "torch":
        return _short_conv_torch(x, weight, cu_seqlens, bias, activation)
    if not x.is_cuda:
        fail("backend", f"{backend!r} runs fla's GPU kernels and needs CUDA tensors, got x on {x.device}")
    return _short_conv_fla(x, weight, cu_seqlens, bias, activation, backend)


def _short_conv_torch(x, weight, cu_seqlens, bias, activation):
    from linattn import reference

    # the reference computes in float32 or float64; half-precision inputs compute in float32
    compute_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    y = reference.short_conv(x, weight, cu_seqlens, bias, activation, compute_dtype=compute_dtype)
    return y.to(x.dtype)


def _short_conv_fla(x, weight, cu_seqlens, bias, activation, backend):
    from fla.modules.causal_conv1d import causal_conv1d

    if not (cu_seqlens is None or x.shape[0] == 1):
        fail("x", f"must have batch size 1 when cu_seqlens is given, got {x.shape[0]}")
    # fla's kernels (and causal-conv1d's) want one dtype; the casts are no-ops for matching dtypes
    weight = weight.to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
    y, _ = causal_conv1d(x, weight=weight, bias=bias, activation=activation, backend=backend, cu_seqlens=cu_seqlens)
    return y.to(x.dtype)
