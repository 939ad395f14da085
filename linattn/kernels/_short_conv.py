"""Depthwise causal short convolution: one entry, backends as a parameter.

"torch" runs linattn.reference.short_conv in the input's dtype (CPU, or any device);
"triton", "mix" and "cuda" run fla 0.6.0's causal_conv1d (fla/modules/causal_conv1d/ops.py):
"mix" is its FastCausalConv1dFn, a Triton forward with causal-conv1d's CUDA backward.
"""

import weakref

import torch

from linattn import selection
from linattn.checks import fail

BACKENDS = ("torch",) + selection.CONV_BACKENDS
# fla 0.6.0's backends that cannot carry a conv state between calls, and why (measured on an
# H200, 2026-12-03: "cuda" asserted on a chunked prefill's initial state)
STATELESS_BACKENDS = {
    "mix": "its FastCausalConv1dFn asserts no initial state and no final state",
    "cuda": "it refuses an initial state with packed sequences, and autograd does not reach its final state",
}
ACTIVATIONS = ("silu", "swish", None)
# causal-conv1d 1.7.0's CUDA kernels past 2**31 elements of x give NaN or an illegal memory access
# (an H100, 2026-12-06, x [1, 528384, 8192] bf16: docs/live-bugs.md; 258,048 tokens pass): "cuda"
# runs them both ways, "mix" backward (not measured apart); fla's "triton" passes at both lengths
INT32_LIMITED_BACKENDS = ("cuda", "mix")
INT32_ELEMENTS = 2**31


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    backend: str | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """x `[B, T, D]` (B = 1 with cu_seqlens), weight `[D, W]`, bias `[D]`; returns `[B, T, D]` in x's dtype,
    or with output_final_state `(y, final_state)`.

    initial_state / final_state: the conv state `[N, D, W-1]`, each sequence's last W-1 inputs
    (linattn.reference.short_conv's convention). backend None: `selection.short_conv_backend()`
    for CUDA tensors ("triton" where a state comes in or goes out: see STATELESS_BACKENDS),
    "torch" otherwise.
    """
    if not (backend is None or backend in BACKENDS):
        fail("backend", f"must be None or one of {BACKENDS}, got {backend!r}")
    if activation not in ACTIVATIONS:
        fail("activation", f"must be one of {ACTIVATIONS}, got {activation!r}")
    if not (isinstance(x, torch.Tensor) and x.dim() == 3):
        fail("x", f"must be a [B, T, D] tensor, got {getattr(x, 'shape', x)!r}")
    if not (weight.dim() == 2 and weight.shape[0] == x.shape[2]):
        fail("weight", f"must be [D, W] with D={x.shape[2]}, got shape {tuple(weight.shape)}")
    with_state = initial_state is not None or output_final_state
    too_large = x.numel() >= INT32_ELEMENTS
    if backend is None:
        backend = selection.short_conv_backend() if x.is_cuda else "torch"
        if (with_state and backend in STATELESS_BACKENDS) or (too_large and backend in INT32_LIMITED_BACKENDS):
            backend = "triton"
    elif with_state and backend in STATELESS_BACKENDS:
        fail("backend", f"{backend!r} carries no conv state in fla 0.6.0 ({STATELESS_BACKENDS[backend]}): "
                        f"use 'triton' or 'torch' with initial_state or output_final_state")
    elif too_large and backend in INT32_LIMITED_BACKENDS:
        fail("backend", f"{backend!r} runs causal-conv1d's CUDA kernels, wrong past 2**31 elements of x (NaN or an "
                        f"illegal memory access; x has {x.numel():,}): use 'triton'")
    state = dict(initial_state=initial_state, output_final_state=output_final_state)
    if backend == "torch":
        return _short_conv_torch(x, weight, cu_seqlens, bias, activation, **state)
    if not x.is_cuda:
        fail("backend", f"{backend!r} runs fla's GPU kernels and needs CUDA tensors, got x on {x.device}")
    return _short_conv_fla(x, weight, cu_seqlens, bias, activation, backend, **state)


def _short_conv_torch(x, weight, cu_seqlens, bias, activation, initial_state, output_final_state):
    from linattn import reference

    # the reference computes in float32 or float64; half-precision inputs compute in float32
    compute_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    out = reference.short_conv(x, weight, cu_seqlens, bias, activation, compute_dtype=compute_dtype,
                               initial_state=initial_state, output_final_state=output_final_state)
    if output_final_state:
        return out[0].to(x.dtype), out[1].to(x.dtype)
    return out.to(x.dtype)


def _short_conv_fla(x, weight, cu_seqlens, bias, activation, backend, initial_state, output_final_state):
    from fla.modules.causal_conv1d import causal_conv1d

    if not (cu_seqlens is None or x.shape[0] == 1):
        fail("x", f"must have batch size 1 when cu_seqlens is given, got {x.shape[0]}")
    # fla's kernels (and causal-conv1d's) want one dtype; the casts are no-ops for matching dtypes
    weight = weight.to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    extra = {}
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
        if backend in ("cuda", "mix"):
            extra["seq_idx"] = _int32_sequence_ids(cu_seqlens, x.shape[1])
    if initial_state is not None:
        # fla's cache is W wide, slot 0 the oldest and never read: a zero column in front
        extra["initial_state"] = torch.nn.functional.pad(initial_state.to(x.dtype), (1, 0))
    y, final_state = causal_conv1d(x, weight=weight, bias=bias, activation=activation, backend=backend,
                                   cu_seqlens=cu_seqlens, output_final_state=output_final_state, **extra)
    if output_final_state:
        return y.to(x.dtype), final_state[..., 1:].to(x.dtype)
    return y.to(x.dtype)


# id(cu_seqlens) -> (weakref to it, its _version, int32 sequence ids [1, T])
_SEQUENCE_IDS: dict[int, tuple] = {}


def _int32_sequence_ids(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """causal-conv1d's seq_idx for a boundaries tensor, built once per tensor (as fla caches its own
    indices per tensor). Without it fla builds one per call, which each conv's backward keeps:
    4 bytes a token per conv of a layer (KDA's three: a step's peak 0.2-0.8 MB over fla's layer)."""
    key = id(cu_seqlens)
    hit = _SEQUENCE_IDS.get(key)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    # (fla's prepare_sequence_ids caches by identity only: a tensor changed in place would get stale ids)
    sequences = torch.arange(cu_seqlens.numel() - 1, device=cu_seqlens.device, dtype=torch.int32)
    seq_idx = torch.repeat_interleave(sequences, cu_seqlens.diff(), output_size=tokens).unsqueeze(0)
    _SEQUENCE_IDS[key] = (weakref.ref(cu_seqlens, lambda _: _SEQUENCE_IDS.pop(key, None)), cu_seqlens._version, seq_idx)
    return seq_idx


def short_conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, bias: torch.Tensor | None = None,
                    activation: str | None = "silu"):
    """One decode step of the short conv: x `[1, N, D]`, the next input of each of N sequences;
    weight `[D, W]`; state `[N, D, W-1]` their last W-1 inputs (None: zeros). Returns (y `[1, N, D]`
    in x's dtype, the new state `[N, D, W-1]` in x's dtype).

    Plain torch ops on any device, computed in at least float32 (float64 stays float64): no host
    synchronisation and fixed shapes, so a CUDA graph can capture it (fla's causal_conv1d with
    cu_seqlens reads the boundaries on the host)."""
    if activation not in ACTIVATIONS:
        fail("activation", f"must be one of {ACTIVATIONS}, got {activation!r}")
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] == 1):
        fail("x", f"must be one token per sequence, [1, N, D], got {getattr(x, 'shape', x)!r}")
    N, D = x.shape[1], x.shape[2]
    if not (weight.dim() == 2 and weight.shape[0] == D):
        fail("weight", f"must be [D, W] with D={D}, got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if state is not None and tuple(state.shape) != (N, D, W - 1):
        fail("state", f"must be [N, D, W-1] = {(N, D, W - 1)}, got shape {tuple(state.shape)}")
    compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    token = x[0].to(compute).unsqueeze(-1)  # [N, D, 1]
    past = token.new_zeros(N, D, W - 1) if state is None else state.to(compute)
    window = torch.cat([past, token], dim=-1)  # [N, D, W], oldest first
    y = (window * weight.to(compute)).sum(-1)
    if bias is not None:
        y = y + bias.to(compute)
    if activation is not None:
        y = torch.nn.functional.silu(y)
    return y.unsqueeze(0).to(x.dtype), window[..., 1:].to(x.dtype)
