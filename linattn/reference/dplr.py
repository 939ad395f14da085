"""The diagonal-plus-low-rank (DPLR) delta rule, and RWKV-7's op written through it.

Per head, token t of a sequence (fla's convention: the state S is `[K, V]`, keys on its rows):

    S_t = diag(exp gk_t) S_{t-1} + b_t (a_tᵀ S_{t-1}) + k_t v_tᵀ      = (D_t + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ
    o_t = scale · S_tᵀ q_t

(fla writes it transposed, S_t = S_{t-1} (D_t + a_t b_tᵀ) + v_t k_tᵀ.) The low-rank term reads the
state before the token's decay, as fla's naive recurrence and kernels do. RWKV-7 is that rule with
q = r, gk = w (log decay), a = -kk, b = kk · a_iclr (its in-context learning rate), scale 1.

Recurrent form, one sequence and one token at a time over every head at once; `reverse` runs each
sequence from its last token to its first (fla's fused recurrent option). Differentiable; float64
whatever the input dtype. q, k, a, b, gk `[B, T, H, K]`; v `[B, T, H, V]`; states `[N, H, K, V]`.
"""

from __future__ import annotations

import torch

from linattn.checks import (
    require,
    sequence_bounds,
    validate_compute_dtype,
    validate_floating,
    validate_shape,
)

__all__ = ["dplr_delta_rule", "rwkv7", "rwkv7_kk_a"]


def dplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's DPLR delta rule. Returns (o `[B,T,H,V]`, final_state `[N,H,K,V]` or None), both in
    compute_dtype. scale None: K ** -0.5 (fla's chunk_dplr_delta_rule default)."""
    names = ("q", "k", "v", "a", "b", "gk")
    for name, x in zip(names, (q, k, v, a, b, gk)):
        validate_floating(x, name)
    validate_compute_dtype(compute_dtype)
    require(q.dim() == 4, "q", f"must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, x in (("k", k), ("a", a), ("b", b), ("gk", gk)):
        validate_shape(x, (B, T, H, K), name)
    require(v.dim() == 4 and tuple(v.shape[:3]) == (B, T, H), "v",
            f"must be [B, T, H, V] with B={B}, T={T}, H={H}, got shape {tuple(v.shape)}")
    V = v.shape[3]
    require(scale is None or isinstance(scale, (int, float)), "scale", f"must be a number or None, got {scale!r}")
    require(isinstance(reverse, bool), "reverse", f"must be a bool, got {reverse!r}")
    bounds = sequence_bounds(B, T, cu_seqlens, name="q")
    N = len(bounds) - 1
    if initial_state is not None:
        validate_floating(initial_state, "initial_state")
        validate_shape(initial_state, (N, H, K, V), "initial_state")

    scale = K ** -0.5 if scale is None else float(scale)
    cast = dict(dtype=compute_dtype, device=q.device)
    # one token stream [B*T, H, ...]
    q, k, v, a, b, gk = (x.to(**cast).flatten(0, 1) for x in (q, k, v, a, b, gk))
    state = initial_state.to(**cast) if initial_state is not None else q.new_zeros(N, H, K, V)
    o, final_state = _recurrent(q * scale, k, v, a, b, gk, state, bounds, reverse)
    return o.reshape(B, T, H, V), (final_state if output_final_state else None)


def rwkv7(r, w, k, v, a, b, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
          cu_seqlens=None, reverse: bool = False, *, compute_dtype: torch.dtype = torch.float64):
    """fla's chunk_rwkv7 / fused_recurrent_rwkv7: the DPLR rule with q = r, gk = w (log decay)."""
    return dplr_delta_rule(r, k, v, a, b, w, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens, reverse=reverse,
                           compute_dtype=compute_dtype)


def rwkv7_kk_a(r, w, k, v, kk, a, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
               cu_seqlens=None, reverse: bool = False, *, compute_dtype: torch.dtype = torch.float64):
    """fla's fused_mul_recurrent_rwkv7: RWKV-7 from its normalised key kk and in-context rate a,
    the DPLR rule with a = -kk, b = kk · a (products formed in compute_dtype)."""
    validate_floating(kk, "kk")
    validate_floating(a, "a")
    kk, a = kk.to(compute_dtype), a.to(compute_dtype)
    return rwkv7(r, w, k, v, -kk, kk * a, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, reverse=reverse,
                 compute_dtype=compute_dtype)


def _recurrent(q, k, v, a, b, gk, state, bounds, reverse):
    """Token by token, one sequence at a time. Inputs `[tokens, H, ...]`, state `[N, H, K, V]`."""
    o = [None] * q.shape[0]
    finals = []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = state[n]  # [H, K, V]
        # unbind once: indexing token t in the loop would make backward build a full-size gradient per token
        tokens = list(zip(*(x[bos:eos].unbind(0) for x in (q, k, v, a, b, gk))))
        places = range(bos, eos)
        if reverse:
            tokens, places = tokens[::-1], places[::-1]
        for t, (q_t, k_t, v_t, a_t, b_t, gk_t) in zip(places, tokens):
            aS = torch.einsum("hk,hkv->hv", a_t, S)  # a_tᵀ S_{t-1}, before the decay
            S = gk_t.exp()[..., None] * S + b_t[..., None] * aS[:, None, :] + k_t[..., None] * v_t[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q_t, S)
        finals.append(S)
    out = torch.stack(o) if o else v.new_zeros(0, *v.shape[1:])
    return out, torch.stack(finals)
