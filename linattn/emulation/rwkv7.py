"""The small Triton kernels fla 0.6.0's RWKV7Attention runs besides its recurrence, in torch.

    token_shift, fused_addcmul_rwkv7, fused_k_rwkv7, gate_output_correction

Each computes fla's formula (fla's own torch references beside its kernels) in ``compute_dtype()``
and returns the input's dtype, differentiable:

- token_shift: delta_t = x_{t-1} - x_t within each sequence; a sequence's first token takes the
  cache row of its sequence (``cache`` `[N, D]`) or zero; ``output_cache`` also returns each
  sequence's last token `[N, D]`. No ``cp_context`` in fla: a layer under CP takes the previous
  token across the rank boundary itself (a width-2 ``causal_conv1d`` with weights (1, -1) and
  ``cp_context`` is the same shift with its halo exchanged).
- fused_addcmul_rwkv7: hidden + delta · x_m for m in r, w, k, v, a, g (g None: None).
- fused_k_rwkv7: k + k · (a - 1) · k_a.
- gate_output_correction: (o + ((r · k · r_k).sum(-1) v).flatten) · g.

Refused: ``output_cache`` with a sequence of zero tokens (fla's kernel leaves its row unwritten).
"""

from __future__ import annotations

import torch

from linattn.checks import sequence_bounds

from .patching import check_packing, compute_dtype, refuse


def token_shift(
    x: torch.Tensor,
    cu_seqlens: torch.LongTensor | None = None,
    cache: torch.Tensor | None = None,
    output_cache: bool = False,
    chunk_indices: torch.LongTensor | None = None,
):
    """fla's token_shift: x `[B, T, D]` -> delta `[B, T, D]` (and the cache `[N, D]` with output_cache)."""
    if cu_seqlens is not None:
        assert x.dim() == 3, "Input must be [B, T, D]"
        assert x.shape[0] == 1, "Batch size must be 1 when using cu_seqlens"
        check_packing("token_shift", x, cu_seqlens)
    B, T, D = x.shape
    bounds = sequence_bounds(B, T, cu_seqlens)
    starts, ends = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:])
    nonempty = ends > starts
    if output_cache and not bool(nonempty.all()):
        refuse("token_shift", "output_cache", True, "with a sequence of zero tokens (fla leaves its cache row unwritten)")
    dtype = compute_dtype()
    flat = x.to(dtype).reshape(B * T, D)
    previous = torch.cat([flat.new_zeros(1, D), flat[:-1]])
    first = torch.zeros(B * T, dtype=torch.bool)
    first[starts[nonempty]] = True
    if cache is None:
        previous = previous.masked_fill(first[:, None].to(x.device), 0.0)
    else:
        # each sequence's first token reads its own cache row
        from_cache = flat.new_zeros(B * T, D).index_put((starts[nonempty].to(x.device),),
                                                        cache.to(dtype).reshape(-1, D)[nonempty.to(x.device)])
        previous = torch.where(first[:, None].to(x.device), from_cache, previous)
    delta = (previous - flat).to(x.dtype).view(B, T, D)
    if not output_cache:
        return delta
    return delta, x.reshape(B * T, D)[(ends - 1).to(x.device)].clone()


def fused_addcmul_rwkv7(
    hidden_states: torch.Tensor,
    delta: torch.Tensor,
    xr: torch.Tensor,
    xw: torch.Tensor,
    xk: torch.Tensor,
    xv: torch.Tensor,
    xa: torch.Tensor,
    xg: torch.Tensor | None = None,
):
    """fla's fused_addcmul_rwkv7: the six token mixes hidden + delta * x_m (the last None without xg)."""
    dtype = compute_dtype()
    h, d = hidden_states.to(dtype), delta.to(dtype)
    mixed = tuple(None if m is None else torch.addcmul(h, d, m.to(dtype)).to(hidden_states.dtype)
                  for m in (xr, xw, xk, xv, xa, xg))
    return mixed


def fused_k_rwkv7(k, a, ka, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla's fused_k_rwkv7: k + k * (a - 1) * ka."""
    dtype = compute_dtype()
    k64 = k.to(dtype)
    return k64.addcmul(k64 * (a.to(dtype) - 1), ka.to(dtype)).to(k.dtype)


def gate_output_correction(
    o: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    r_k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
) -> torch.Tensor:
    """fla's gate_output_correction: o `[B, T, H*D]`, r, k, v `[B, T, H, D]`, r_k `[H, D]`, g `[B, T, H*D]`."""
    dtype = compute_dtype()
    o64, r64, k64, v64, g64 = (t.to(dtype) for t in (o, r, k, v, g))
    correction = ((r64 * k64 * r_k.to(dtype)).sum(-1, keepdim=True) * v64).reshape(o.shape)
    return ((o64 + correction) * g64).to(o.dtype)


PATCHES = {
    "fla.modules.token_shift:token_shift": token_shift,
    "fla.ops.rwkv7.fused_addcmul:fused_addcmul_rwkv7": fused_addcmul_rwkv7,
    "fla.ops.rwkv7.fused_k_update:fused_k_rwkv7": fused_k_rwkv7,
    "fla.ops.rwkv7.gate_output_correction:gate_output_correction": gate_output_correction,
}
