"""fla's short convolution (``causal_conv1d``, its decode step, ``ShortConvolution``) on
``linattn.reference.short_conv``.

fla's conventions, kept here:

- x ``[B, T, D]`` (or ``[B, T, H, K]`` with ``D = H*K``: flattened, returned in x's shape),
  weight ``[D, W]``, output ``act(conv(x) + bias) + residual`` in x's dtype.
- conv cache ``[N, D, W]`` (N sequences), x's dtype: the last W tokens of each sequence, slot
  ``W-1`` the newest; before the sequence's own tokens, the incoming cache's. Only its last
  ``W-1`` slots enter the convolution (slot 0 is shifted out), so slot 0's gradient is zero.
- ``cp_context``: each of the rank's intervals of the packed batch (one in fla's contiguous
  layout, two in its zigzag) takes its halo, the W-1 tokens before it in its first sequence,
  from the ranks holding them (one all-gather of every interval's last tokens, as
  ``linattn.parallel.cp.short_conv`` does for its piece); no cache in or out (fla asserts the same).

The cache paths build the extended packing and the final state with one gather each (their
index tensors cached per packing), never sequence by sequence.
"""

from __future__ import annotations

import functools

import torch

from linattn.emulation.patching import check_packing, compute_dtype, refuse
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


@functools.lru_cache(maxsize=64)
def _cache_plan(bounds: tuple, W: int, device: str):
    """The gathers of the cache paths for one packing, built once per (boundaries, W): a layer's
    q, k and v convs share them. Rows index ``cat([tokens, cache rows])``:

    - ext_cu, ext_source: the extended packing, each sequence's W-1 cached tokens (rows
      ``total + n*(W-1) + j``) then its own tokens;
    - keep: where the sequences' own tokens sit in it;
    - state_source ``[N*W]``: slot j of sequence n (length L) is its token ``L+j-W``, or the
      cache's slot ``L+j`` (rows ``total + n*W + L+j``) when ``L+j < W``.
    """
    cu = torch.tensor(bounds, dtype=torch.int64, device=device)
    lengths, N, total = cu.diff(), len(bounds) - 1, bounds[-1]
    sequences = torch.arange(N, device=device)
    ext_cu = cu + (W - 1) * torch.arange(N + 1, device=device)
    ext_seq = torch.repeat_interleave(sequences, lengths + (W - 1))
    offset = torch.arange(int(ext_cu[-1]), device=device) - ext_cu[:-1][ext_seq]  # place in the extended sequence
    ext_source = torch.where(offset < W - 1, total + ext_seq * (W - 1) + offset, cu[:-1][ext_seq] + offset - (W - 1))
    keep = torch.nonzero(offset >= W - 1).flatten()
    place = lengths[:, None] + torch.arange(W, device=device)  # [N, W]: index in (cache, tokens)
    state_source = torch.where(place < W, total + sequences[:, None] * W + place, cu[:-1, None] + place - W)
    return ext_cu, ext_source, keep, state_source.flatten()


def _bounds(x, cu_seqlens) -> tuple:
    B, T, _ = x.shape
    return tuple(cu_seqlens.tolist()) if cu_seqlens is not None else tuple(range(0, B * T + 1, T))


def _conv_with_initial_state(x, weight, bias, activation, initial_state, cu_seqlens):
    """The reference conv with each sequence's cached W-1 tokens prepended, then dropped: one
    gather builds the extended packing, one picks the sequences' own outputs back."""
    W = weight.shape[1]
    history = initial_state[:, :, 1:].transpose(1, 2).to(x.dtype)  # [N, W-1, D], oldest first
    if cu_seqlens is None:
        y = conv_in_compute_dtype(torch.cat([history, x], dim=1), weight, None, bias, activation)
        return y[:, W - 1:]
    ext_cu, source, keep, _ = _cache_plan(_bounds(x, cu_seqlens), W, str(x.device))
    D = x.shape[-1]
    extended = torch.cat([x.reshape(-1, D), history.reshape(-1, D)]).index_select(0, source)
    y = conv_in_compute_dtype(extended.unsqueeze(0), weight, ext_cu, bias, activation)
    return y.index_select(1, keep)


def _final_state(x, W, initial_state, cu_seqlens):
    """``[N, D, W]``: the last W entries of (incoming cache, sequence tokens) per sequence, one gather."""
    bounds, D = _bounds(x, cu_seqlens), x.shape[-1]
    *_, source = _cache_plan(bounds, W, str(x.device))
    N = len(bounds) - 1
    if initial_state is None:
        before = x.new_zeros(N * W, D)
    else:
        before = initial_state.to(x.dtype).transpose(1, 2).reshape(N * W, D)  # [N*W, D], oldest first
    states = torch.cat([x.reshape(-1, D), before]).index_select(0, source).view(N, W, D)
    return states.transpose(1, 2).contiguous()


def _cp_intervals(ctx) -> tuple[list[list[int]], int]:
    """(global starts of every rank's intervals of the packed batch, in local order; their length):
    one per rank in fla's contiguous layout, intervals r and 2cp-1-r in fla's zigzag."""
    total, cp = ctx.total_tokens, ctx.cp_size
    if ctx.layout == "contiguous":
        length = total // cp
        return [[r * length] for r in range(cp)], length
    length = total // (2 * cp)
    return [[r * length, (2 * cp - 1 - r) * length] for r in range(cp)], length


def _cp_conv_plan(ctx, W: int):
    """What this rank's CP conv gathers, for one context and width (cached on the fla context: a
    layer's q, k and v convs share it). None when no interval of any rank needs a halo (every
    rank agrees: the collective is skipped everywhere); else (intervals, length, tokens per tail,
    the halo's rows and places in the gathered tails, the extended packing's cu_seqlens, where the
    intervals' own tokens sit in it)."""
    starts, length = _cp_intervals(ctx)
    cu = ctx.cu_seqlens
    every = torch.tensor([s for rank_starts in starts for s in rank_starts])
    # tokens of each interval's first sequence before it (every rank computes every rank's)
    pre = every - cu[torch.searchsorted(cu, every, right=True) - 1]
    if W == 1 or length == 0 or not bool((pre > 0).any()):
        return None
    mine, n_tail = starts[ctx.cp_rank], min(W - 1, length)
    row_of = torch.empty(len(every), dtype=torch.int64)  # global interval index -> row of the gathered tails
    row_of[every // length] = torch.arange(len(every))
    halos, bounds, keep, offset = [], [], [], 0
    for i, start in enumerate(mine):
        halo_len = min(W - 1, int(pre[ctx.cp_rank * len(mine) + i]))
        pos = torch.arange(start - halo_len, start)  # the halo's global tokens
        interval = pos // length
        halos.append((row_of[interval], pos - (interval * length + length - n_tail)))
        local = torch.unique_consecutive(cu.clamp(min=start, max=start + length) - start)  # 0 .. length
        bounds.append(local + offset + halo_len)
        bounds[-1][0] = offset  # the halo joins the interval's first sequence
        keep.append((offset + halo_len, offset + halo_len + length))
        offset += halo_len + length
    return len(mine), length, n_tail, halos, torch.unique_consecutive(torch.cat(bounds)), keep


def _cp_conv(x, weight, bias, activation, cp_context):
    """The conv of this rank's tokens in fla's CP layout, each interval with its halo (the W-1
    tokens before it in its first sequence) prepended: one all-gather of every interval's last
    tokens (backward: one reduce-scatter), where moving the tokens into the contiguous piece and
    back takes an all-to-all each way (fla's zigzag)."""
    from linattn.emulation.cp import piece_context
    from linattn.parallel.cp.comm import all_gather_from_cp_ranks

    ctx, W = piece_context(cp_context), weight.shape[1]
    plans = cp_context.__dict__.setdefault("_linattn_conv_plans", {})
    if W not in plans:
        plans[W] = _cp_conv_plan(ctx, W)
    if plans[W] is None:  # no halo anywhere
        return conv_in_compute_dtype(x, weight, ctx.local_cu_seqlens_on(x.device), bias, activation)
    intervals, length, n_tail, halos, ext_cu, keep = plans[W]
    pieces = x[0].unflatten(0, (intervals, length))  # [intervals, length, D]
    tails = all_gather_from_cp_ranks(pieces[:, length - n_tail:], ctx.group).flatten(0, 1)  # [rows, n_tail, D]
    parts = []
    for (rows, places), piece in zip(halos, pieces):  # an empty halo's gather still joins the graph
        parts += [tails[rows.to(x.device), places.to(x.device)], piece]
    y = conv_in_compute_dtype(torch.cat(parts).unsqueeze(0), weight, ext_cu.to(x.device), bias, activation)
    kept = [y[:, a:b] for a, b in keep]  # the intervals' own tokens
    return kept[0] if len(kept) == 1 else torch.cat(kept, dim=1)


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
    if cp_context is None:  # under CP cu_seqlens is the whole batch's, x this rank's piece
        check_packing(name, x, cu_seqlens)
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
        y = _cp_conv(x, weight, bias, activation, cp_context)
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
