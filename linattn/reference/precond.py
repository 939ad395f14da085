"""Preconditioned delta rules (fla's precond_gated_delta_rule and precond_kda): the write key is
scaled per key channel by a preconditioner M_t computed from a running diagonal second moment
of the keys (the "ATK" state A), per key head:

    A_t = exp(g_atk_t) A_{t-1} + beta_atk_t k_t²                       (per key channel)
    s_t = r / (1 + |r|),  r = log(A_t + eps) - log_atk_scale           (a squash into (-1, 1))
    M_t = x^(-s_t),  kp_t = k_t ⊙ M_t                                   (M in (1/x, x))
    S_t = diag(exp g_t) S_{t-1};  S_t = S_t + kp_t (beta_t (v_t - S_tᵀ k_t))ᵀ
    o_t = scale · S_tᵀ q_t

k reads (erases), kp writes. That is GDN-2's recurrence with the write key kp, the erase gate
b = beta / M (b ⊙ kp = beta k) and the write gate w = beta, so the delta step runs in
linattn.reference.gdn2 (token by token or in chunks of 64, both exact) once the ATK scan gives M.
fla l2-normalises q and k before both (eps 1e-6) unless told otherwise; A acts on the normalised k.

GDN's decay g is per value head `[B,T,HV]`, KDA's per key channel `[B,T,HV,K]`; value head j reads
key head j // (HV // H), and the ATK state `[N,H,K]` belongs to the key heads.
"""

from __future__ import annotations

import math

import torch

from linattn.checks import require, sequence_bounds, validate_compute_dtype, validate_floating, validate_shape

from .delta_rule import MODES, l2norm
from .gdn2 import gdn2

DEFAULT_LOG_ATK_SCALE = -0.2  # fla's centre of the squash when log_atk_scale is None


def precond_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_atk: torch.Tensor,
    g: torch.Tensor,
    beta_atk: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | float | None = None,
    mode: str = "chunk",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Preconditioned gated delta rule, fla's argument order: q, k `[B,T,H,K]`; v `[B,T,HV,V]`;
    g_atk, beta_atk `[B,T,H]`; g (log decay), beta `[B,T,HV]`; states `[N,HV,K,V]`, A states `[N,H,K]`.

    Returns (o `[B,T,HV,V]`, final_state, final_A_state), the states None unless output_final_state.
    """
    require(g.dim() == 3, "g", f"must be [B, T, HV], got shape {tuple(g.shape)}")
    return _precond(q, k, v, g_atk, g[..., None], beta_atk, beta, scale, initial_state, initial_A_state,
                    output_final_state, cu_seqlens, use_qk_l2norm, x, eps, log_atk_scale, mode, compute_dtype)


def precond_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    g_atk: torch.Tensor,
    beta_atk: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | float | None = None,
    mode: str = "chunk",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Preconditioned KDA, fla's argument order: q, k `[B,T,H,K]`; v `[B,T,HV,V]`; g (log decay per
    key channel) `[B,T,HV,K]`; g_atk, beta_atk `[B,T,H]`; beta `[B,T,HV]`; states as
    precond_gated_delta_rule's."""
    require(g.dim() == 4, "g", f"must be [B, T, HV, K], got shape {tuple(g.shape)}")
    return _precond(q, k, v, g_atk, g, beta_atk, beta, scale, initial_state, initial_A_state,
                    output_final_state, cu_seqlens, use_qk_l2norm, x, eps, log_atk_scale, mode, compute_dtype)


def _precond(q, k, v, g_atk, g, beta_atk, beta, scale, initial_state, initial_A_state, output_final_state,
             cu_seqlens, use_qk_l2norm, x, eps, log_atk_scale, mode, compute_dtype):
    names = ("q", "k", "v", "g_atk", "g", "beta_atk", "beta")
    for name, t in zip(names, (q, k, v, g_atk, g, beta_atk, beta)):
        validate_floating(t, name)
    validate_compute_dtype(compute_dtype)
    require(mode in MODES, "mode", f"must be one of {MODES}, got {mode!r}")
    require(q.dim() == 4, "q", f"must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    validate_shape(k, (B, T, H, K), "k")
    require(v.dim() == 4 and tuple(v.shape[:2]) == (B, T), "v",
            f"must be [B, T, HV, V] with B={B}, T={T}, got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    require(HV % H == 0, "v", f"heads HV={HV} must be a multiple of the key heads H={H}")
    require(g.shape[-1] in (1, K) and tuple(g.shape[:3]) == (B, T, HV), "g",
            f"must be [B, T, HV] or [B, T, HV, K] with HV={HV}, got shape {tuple(g.shape)}")
    validate_shape(g_atk, (B, T, H), "g_atk")
    validate_shape(beta_atk, (B, T, H), "beta_atk")
    validate_shape(beta, (B, T, HV), "beta")
    require(isinstance(x, (int, float)) and x > 0, "x", f"must be a positive number, got {x!r}")
    require(scale is None or isinstance(scale, (int, float)), "scale", f"must be a number or None, got {scale!r}")
    bounds = sequence_bounds(B, T, cu_seqlens, name="q")
    N = len(bounds) - 1
    if initial_state is not None:
        validate_floating(initial_state, "initial_state")
        validate_shape(initial_state, (N, HV, K, V), "initial_state")
    if initial_A_state is not None:
        validate_floating(initial_A_state, "initial_A_state")
        validate_shape(initial_A_state, (N, H, K), "initial_A_state")

    cast = dict(dtype=compute_dtype, device=q.device)
    q, k, v, g_atk, g, beta_atk, beta = (t.to(**cast) for t in (q, k, v, g_atk, g, beta_atk, beta))
    if log_atk_scale is None:
        log_atk_scale = DEFAULT_LOG_ATK_SCALE
    if isinstance(log_atk_scale, (int, float)):
        center = torch.tensor(float(log_atk_scale), **cast)
    else:
        validate_floating(log_atk_scale, "log_atk_scale")
        validate_shape(log_atk_scale, (H,), "log_atk_scale")
        center = log_atk_scale.to(**cast)[:, None]  # [H, 1]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    A0 = initial_A_state.to(**cast) if initial_A_state is not None else k.new_zeros(N, H, K)

    A, final_A = _atk_scan(k, g_atk, beta_atk, A0, bounds)  # [B, T, H, K]
    squash = lambda r: r / (1.0 + r.abs())  # noqa: E731
    M = torch.exp(-math.log(x) * squash(torch.log(A + eps) - center))
    G = HV // H
    erase = beta[..., None] / M.repeat_interleave(G, dim=2)  # b ⊙ (k ⊙ M) = beta k
    write = beta[..., None].expand(B, T, HV, V)
    o, final_state = gdn2(q, k * M, v, g.expand(B, T, HV, K), erase, write, scale=scale,
                          initial_state=initial_state, output_final_state=output_final_state,
                          cu_seqlens=cu_seqlens, mode=mode, compute_dtype=compute_dtype)
    return o, final_state, (final_A if output_final_state else None)


def _atk_scan(k, g_atk, beta_atk, A0, bounds):
    """A_t per token `[B, T, H, K]` and the final A per sequence `[N, H, K]` (token by token)."""
    B, T, H, K = k.shape
    k2 = beta_atk[..., None] * k * k
    decay = g_atk.exp()[..., None]
    # one token stream; unbind once (indexing in the loop would build a full gradient per token)
    k2, decay = k2.flatten(0, 1).unbind(0), decay.flatten(0, 1).unbind(0)
    states, finals = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        A = A0[n]
        for t in range(bos, eos):
            A = decay[t] * A + k2[t]
            states.append(A)
        finals.append(A)
    A_all = torch.stack(states) if states else k.new_zeros(0, H, K)
    return A_all.reshape(B, T, H, K), torch.stack(finals)
