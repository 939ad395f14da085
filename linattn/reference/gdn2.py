"""Gated DeltaNet 2 (GDN-2): the delta rule with a channel-wise erase gate and write gate.

Per value head, token by token (fla's naive_recurrent_gdn2):

    S_t = diag(exp g_t) S_{t-1}                       (g_t a log decay per key channel)
    S_t = S_t + k_t (w_t ⊙ v_t - S_tᵀ (b_t ⊙ k_t))ᵀ    (b_t erases per key channel, w_t writes per value channel)
    o_t = scale · S_tᵀ q_t

that is S_t = (I - k_t (b_t ⊙ k_t)ᵀ) diag(exp g_t) S_{t-1} + k_t (w_t ⊙ v_t)ᵀ; b = w = beta is KDA.

mode="recurrent" runs exactly that, one sequence and one token at a time: the ground truth.
mode="chunk" runs the same math in chunks of 64 tokens, in KDA's WY form with the erase key
b ⊙ k in the rows of the intra-chunk system and w ⊙ v on its right side:

    (I + strict_lower(A)) [U, W] = [w ⊙ v, (b ⊙ k)·exp(g)],  A[i, j] = Σ_d (b_i k_i)[d] k_j[d] exp(g_i[d] - g_j[d])

then v_new = U - W S_in, o = (q·exp g) S_in + Aqk v_new, S_out = exp(g_last) S_in + (k·exp(g_last - g))ᵀ v_new,
with g cumulative within the chunk: the delta rule reference's chunk form (chunked_delta_rule) with
erase gate b and write gate w. Packed sequences sit in a padded `[chunks, N·HV, 64, ...]` layout
whose padding (k = v = b = w = 0, g = 0) leaves each state untouched.

Value head j reads key head j // (HV // H) (q and k `[B, T, H, K]`); g and b are per value head.
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

from .delta_rule import MODES, chunked_delta_rule, l2norm


def gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    mode: str = "chunk",
    *,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN-2: q, k `[B,T,H,K]`; v and w (write gate) `[B,T,HV,V]`; g (log decay) and b (erase gate)
    `[B,T,HV,K]`; states `[N,HV,K,V]`.

    Returns (o `[B,T,HV,V]`, final_state `[N,HV,K,V]` or None), both in compute_dtype.
    scale None: K ** -0.5. use_qk_l2norm: fla's in-kernel l2norm (eps 1e-6) of q and k.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("b", b), ("w", w)):
        validate_floating(x, name)
    validate_compute_dtype(compute_dtype)
    require(mode in MODES, "mode", f"must be one of {MODES}, got {mode!r}")
    require(q.dim() == 4, "q", f"must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    validate_shape(k, (B, T, H, K), "k")
    require(v.dim() == 4 and tuple(v.shape[:2]) == (B, T), "v",
            f"must be [B, T, HV, V] with B={B}, T={T}, got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    require(HV % H == 0, "v", f"heads HV={HV} must be a multiple of the key heads H={H}")
    validate_shape(g, (B, T, HV, K), "g")
    validate_shape(b, (B, T, HV, K), "b")
    validate_shape(w, (B, T, HV, V), "w")
    require(scale is None or isinstance(scale, (int, float)), "scale", f"must be a number or None, got {scale!r}")
    bounds = sequence_bounds(B, T, cu_seqlens, name="q")
    N = len(bounds) - 1
    if initial_state is not None:
        validate_floating(initial_state, "initial_state")
        validate_shape(initial_state, (N, HV, K, V), "initial_state")

    scale = K ** -0.5 if scale is None else float(scale)
    cast = dict(dtype=compute_dtype, device=q.device)
    q, k, v, g, b, w = (x.to(**cast) for x in (q, k, v, g, b, w))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # one token stream [B*T, HV, ...]; key heads expanded to value heads
    G = HV // H
    q = (q * scale).repeat_interleave(G, dim=2).flatten(0, 1)
    k = k.repeat_interleave(G, dim=2).flatten(0, 1)
    v, g, b, w = (x.flatten(0, 1) for x in (v, g, b, w))
    state = initial_state.to(**cast) if initial_state is not None else q.new_zeros(N, HV, K, V)

    run = chunked_delta_rule if mode == "chunk" else _recurrent
    o, final_state = run(q, k, v, g, b, w, state, bounds)
    return o.reshape(B, T, HV, V), (final_state if output_final_state else None)


def _recurrent(q, k, v, g, b, w, state, bounds):
    """Token by token, one sequence at a time. Inputs `[tokens, HV, ...]`, state `[N, HV, K, V]`."""
    outputs, finals = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = state[n]  # [HV, K, V]
        # unbind once: indexing token t in the loop would make backward build a full-size gradient per token
        tokens = zip(*(x[bos:eos].unbind(0) for x in (q, k, v, g, b, w)))
        for q_t, k_t, v_t, g_t, b_t, w_t in tokens:
            S = S * g_t.exp()[..., None]
            u = w_t * v_t - torch.einsum("hk,hkv->hv", b_t * k_t, S)
            S = S + k_t[:, :, None] * u[:, None, :]
            outputs.append(torch.einsum("hk,hkv->hv", q_t, S))
        finals.append(S)
    o = torch.stack(outputs) if outputs else v.new_zeros(0, *v.shape[1:])
    return o, torch.stack(finals)
