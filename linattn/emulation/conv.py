"""fla's short convolution (``causal_conv1d``, its decode step, ``ShortConvolution``) on
``linattn.reference.short_conv``.

fla's conventions, kept here:

- x ``[B, T, D]`` (or ``[B, T, H, K]`` with ``D = H*K``: flattened, returned in x's shape),
  weight ``[D, W]``, output ``act(conv(x) + bias) + residual`` in x's dtype.
- conv cache ``[N, D, W]`` (N sequences), x's dtype: the last W tokens of each sequence, slot
  ``W-1`` the newest; before the sequence's own tokens, the incoming cache's. Only its last
  ``W-1`` slots enter the convolution (slot 0 is shifted out), so slot 0's gradient is zero.
- ``cp_context``: the exchange of ``linattn.parallel.cp.short_conv`` over the context's group;
  no cache in or out (fla asserts the same).
"""

from __future__ import annotations


import torch

from linattn.emulation.patching import compute_dtype, refuse
from linattn.kernels._short_conv import _int32_sequence_ids
from linattn.reference import short_conv as reference_short_conv

ACTIVATIONS = (None, "silu", "swish")
BACKENDS = ("triton", "mix", "cuda")  # fla's values; all compute the same convolution

__all__ = ["causal_conv1d", "causal_conv1d_update", "short_convolution_forward", "short_convolution_step", "PATCHES"]


def _check_activation(function: str, activation) -> None:
    if activation not in ACTIVATIONS:
        refuse(function, "activation", activation)


def conv_in_compute_dtype(x, weight, cu_seqlens=None, bias=None, activation=None):
    """``linattn.kernels.short_conv``'s call shape, in the emulation's compute dtype (CP short_conv's piece_op)."""
    return reference_short_conv(x, weight, cu_seqlens, bias, activation, compute_dtype=compute_dtype())


def _conv_with_initial_state(x, weight, bias, activation, initial_state, cu_seqlens):
    """The reference conv with each sequence's cached W-1 tokens prepended, then dropped."""
    W = weight.shape[1]
    history = initial_state[:, :, 1:].transpose(1, 2).to(x.dtype)  # [N, W-1, D], oldest first
    if cu_seqlens is None:
        y = conv_in_compute_dtype(torch.cat([history, x], dim=1), weight, None, bias, activation)
        return y[:, W - 1:]
    bounds = cu_seqlens.tolist()
    pieces = []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        pieces += [history[n].unsqueeze(0), x[:, start:end]]
    ext_cu = torch.tensor(bounds, dtype=torch.int64) + (W - 1) * torch.arange(len(bounds))
    y = conv_in_compute_dtype(torch.cat(pieces, dim=1), weight, ext_cu, bias, activation)
    keep = torch.cat([torch.arange(a + (W - 1), b) for a, b in zip(ext_cu[:-1].tolist(), ext_cu[1:].tolist())])
    return y.index_select(1, keep.to(y.device))


def _final_state(x, W, initial_state, cu_seqlens):
    """``[N, D, W]``: the last W entries of (incoming cache, sequence tokens) per sequence."""
    B, T, D = x.shape
    if cu_seqlens is None:
        seqs = list(x.unbind(0))
    else:
        bounds = cu_seqlens.tolist()
        seqs = [x[0, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    states = []
    for n, seq in enumerate(seqs):
        seq = seq.transpose(0, 1)  # [D, t]
        before = initial_state[n].to(seq.dtype) if initial_state is not None else seq.new_zeros(D, W)
        states.append(torch.cat([before, seq], dim=1)[:, -W:])
    return torch.stack(states)


def _check_seq_idx(function: str, seq_idx, cu_seqlens, tokens: int) -> None:
    """seq_idx (causal-conv1d's per-token sequence index, `[1, T]`, that fla's "mix" and "cuda"
    backends read) beside cu_seqlens is the same boundaries again: emulated when it is exactly
    cu_seqlens' index; alone it would mean other sequences per backend ("triton" ignores it)."""
    if cu_seqlens is None:
        refuse(function, "seq_idx", "<tensor>", "is emulated only beside cu_seqlens, the boundaries it repeats")
    expected = _int32_sequence_ids(cu_seqlens, tokens)  # what the project's layers pass fla
    if tuple(seq_idx.shape) != (1, tokens) or not torch.equal(seq_idx.to(expected), expected):
        refuse(function, "seq_idx", "<tensor>",
               f"differs from cu_seqlens' per-token sequence index {expected.tolist()}")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool | None = False,
    activation: str | None = None,
    backend: str | None = "triton",
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``causal_conv1d``: returns ``(y, final_state)``, final_state None unless requested.

    cu_seqlens_cpu / chunk_indices are fla's precomputed metadata and not needed here; seq_idx
    (in kwargs, as fla takes it) is checked against cu_seqlens."""
    name = "causal_conv1d"
    if weight is None:
        refuse(name, "weight", None)
    _check_activation(name, activation)
    if backend not in BACKENDS:
        raise ValueError(f"Unsupported backend: {backend}")
    if kwargs.get("seq_idx") is not None:
        _check_seq_idx(name, kwargs["seq_idx"], cu_seqlens, x.shape[1])
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.flatten(2)  # [B, T, H, K] -> [B, T, H*K], as fla
    W = weight.shape[1]

    if cp_context is not None:
        assert initial_state is None, "Initial state is not supported for CP"
        assert output_final_state is False, "Output final state is not supported for CP"
        assert cp_context.conv1d_kernel_size is not None, "conv1d_kernel_size must be provided for causal_conv1d_cp"
        if cp_context.conv1d_kernel_size != W:
            refuse(name, "cp_context.conv1d_kernel_size", cp_context.conv1d_kernel_size,
                   f"differs from the weight's width {W}")
        from linattn.emulation.cp import piece_context
        from linattn.parallel import cp as linattn_cp

        ctx = piece_context(cp_context)
        y = linattn_cp.short_conv(ctx.relayout.to_contiguous(x), weight, bias, activation, backend="exchange",
                                  piece_op=conv_in_compute_dtype, cp_context=ctx)
        y = ctx.relayout.from_contiguous(y)
        if residual is not None:
            y = y + residual.reshape(y.shape).to(y.dtype)
        return y.to(x.dtype).view(shape), None

    if initial_state is None:
        y = conv_in_compute_dtype(x, weight, cu_seqlens, bias, activation)
    else:
        y = _conv_with_initial_state(x, weight, bias, activation, initial_state, cu_seqlens)
    if residual is not None:
        y = y + residual.reshape(y.shape).to(y.dtype)
    final_state = _final_state(x, W, initial_state, cu_seqlens) if output_final_state else None
    return y.to(x.dtype).view(shape), final_state


def causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's decode step: one token per sequence (x ``[N, D]``, ``[1, N, D]`` or ``[N, 1, D]``);
    shifts the token into ``cache`` ``[N, D, W]`` IN PLACE and returns ``(y, cache)``."""
    name = "causal_conv1d_update"
    if weight is None:
        refuse(name, "weight", None)
    if cache is None:
        refuse(name, "cache", None)
    _check_activation(name, activation)
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.flatten(2)
    if x.dim() == 2:
        rows = x
    elif x.dim() == 3 and x.shape[0] == 1:
        rows = x[0]
    elif x.dim() == 3 and x.shape[1] == 1:
        rows = x[:, 0]
    else:
        raise ValueError(f"Unsupported input shape: {x.shape}")
    dtype = compute_dtype()
    window = torch.cat([cache[:, :, 1:].to(dtype), rows.to(dtype).unsqueeze(-1)], dim=-1)  # [N, D, W]
    y = (window * weight.to(dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(dtype)
    if activation is not None:
        y = torch.nn.functional.silu(y)
    if residual is not None:
        y = y + residual.reshape(y.shape).to(dtype)
    with torch.no_grad():
        cache.copy_(window)
    return y.to(x.dtype).view(shape), cache


def short_convolution_forward(
    self,
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    cache: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ShortConvolution.forward``, fla's control flow, on the module's own weight and bias."""
    B, T, *_ = x.shape
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if mask is not None:
        if cu_seqlens is not None:
            raise ValueError("`mask` and `cu_seqlens` cannot be provided at the same time")
        x = x.mul_(mask.unsqueeze(-1))  # in place, as fla
    # fla's decode path: autograd off and exactly one token per sequence
    if not torch.is_grad_enabled() and B * T == N and (cu_seqlens is None or bool((cu_seqlens.diff() == 1).all())):
        return self.step(x=x, residual=residual, cache=cache, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return causal_conv1d(
        x=x,
        weight=self.weight[:, 0],  # [D, 1, W] -> [D, W]
        bias=self.bias,
        residual=residual,
        initial_state=cache,
        output_final_state=output_final_state,
        activation=self.activation,
        backend="triton" if self.backend == "cuda" and cache is not None else self.backend,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        **kwargs,
    )


def short_convolution_step(
    self,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    cache: torch.Tensor | None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ShortConvolution.step``: the decode update (fla's CUDA and Triton steps compute the same)."""
    B, _, D, W = *x.shape, self.kernel_size[0]
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if cache is None:
        cache = x.new_zeros(N, D, W)
    y, cache = causal_conv1d_update(
        x=x, cache=cache, residual=residual, weight=self.weight[:, 0], bias=self.bias, activation=self.activation,
    )
    return y, (cache if output_final_state else None)


PATCHES = {
    "fla.modules.causal_conv1d.ops:causal_conv1d": causal_conv1d,
    "fla.modules.causal_conv1d.ops:causal_conv1d_update": causal_conv1d_update,
    "fla.modules.causal_conv1d.ops:ShortConvolution.forward": short_convolution_forward,
    "fla.modules.causal_conv1d.ops:ShortConvolution.step": short_convolution_step,
}
