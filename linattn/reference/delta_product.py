"""Gated DeltaProduct: several delta-rule steps (Householder-like updates) per token.

Per value head, token t of a sequence with n = num_householder steps per token:

    S = diag(exp g_t) S                               (g_t a scalar log decay; none when g is None)
    for j in 0 .. n-1:
        S = S + beta_{t,j} k_{t,j} (v_{t,j} - Sᵀ k_{t,j})ᵀ
    o_t = scale · Sᵀ q_t

Keys, values and betas carry n steps per token, step-major within the token: step j of token t
is row t·n + j of k `[B, T·n, H, K]`, v `[B, T·n, HV, V]`, beta `[B, T·n, HV]` (fla's layout).

That is the gated delta rule over the stream of T·n steps with the token's decay on its first
step (log decay 0, a factor of exactly 1, on the others) and its query on its last step (the
other steps' outputs are dropped), as fla's chunk_ref computes it. So both forms are the gated
delta rule reference's, exact, on that stream: mode="recurrent" token by token, mode="chunk"
in chunks of 64 steps. Packed sequences: `cu_seqlens` counts tokens (steps: n times it).
"""

from __future__ import annotations

import torch

from linattn.checks import (
    positive_int,
    require,
    sequence_bounds,
    validate_compute_dtype,
    validate_floating,
    validate_shape,
)

from .delta_rule import gated_delta_rule


def gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    mode: str = "chunk",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q `[B,T,H,K]`; k `[B,T·n,H,K]`; v `[B,T·n,HV,V]`; g (log decay) `[B,T,HV]` or None (no
    decay); beta `[B,T·n,HV]`; states `[N,HV,K,V]`; n = num_householder.

    Returns (o `[B,T,HV,V]`, final_state `[N,HV,K,V]` or None), both in compute_dtype.
    scale None: K ** -0.5. Value head j reads key head j // (HV // H).
    """
    n = positive_int(num_householder, "num_householder")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        validate_floating(x, name)
    validate_compute_dtype(compute_dtype)
    require(q.dim() == 4, "q", f"must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    validate_shape(k, (B, T * n, H, K), "k")
    require(v.dim() == 4 and tuple(v.shape[:2]) == (B, T * n), "v",
            f"must be [B, T*num_householder, HV, V] with B={B}, T*num_householder={T * n}, got shape {tuple(v.shape)}")
    HV = v.shape[2]
    validate_shape(beta, (B, T * n, HV), "beta")
    if g is not None:
        validate_floating(g, "g")
        validate_shape(g, (B, T, HV), "g")
    sequence_bounds(B, T, cu_seqlens, name="q")  # checks cu_seqlens against the tokens, not the steps
    q_steps, g_steps = token_to_steps(q, g, HV, n, compute_dtype)
    o, final_state = gated_delta_rule(
        q_steps, k, v, g_steps, beta, scale=K ** -0.5 if scale is None else scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=None if cu_seqlens is None else cu_seqlens * n,
        use_qk_l2norm=use_qk_l2norm, mode=mode, compute_dtype=compute_dtype,
    )
    return last_step(o, n), final_state


def token_to_steps(q: torch.Tensor, g: torch.Tensor | None, HV: int, n: int, dtype: torch.dtype):
    """q `[B,T,H,K]` and g `[B,T,HV]` (None: no decay) on the stream of T·n steps, in `dtype`: q on
    each token's last step, g on its first, zeros elsewhere (a zero query reads nothing, a zero log
    decay keeps the state)."""
    q = q.to(dtype)
    B, T = q.shape[:2]
    g = q.new_zeros(B, T, HV) if g is None else g.to(dtype)
    q_steps = torch.cat([q.new_zeros(B, T, n - 1, *q.shape[2:]), q.unsqueeze(2)], dim=2)
    g_steps = torch.cat([g.unsqueeze(2), g.new_zeros(B, T, n - 1, HV)], dim=2)
    return q_steps.flatten(1, 2), g_steps.flatten(1, 2)


def last_step(o_steps: torch.Tensor, n: int) -> torch.Tensor:
    """Outputs `[B, T·n, ...]` of the step stream -> each token's `[B, T, ...]` (its last step's)."""
    return o_steps.unflatten(1, (-1, n)).select(2, n - 1)
