"""Gated delta rule (GDN, scalar decay per head) and KDA (decay per key channel), two ways.

Per value head, token by token (fla's naive recurrence):

    S_t = diag(exp g_t) S_{t-1}                       (exp g_t a scalar for GDN)
    S_t = S_t + beta_t k_t (v_t - S_tᵀ k_t)ᵀ
    o_t = scale · S_tᵀ q_t

mode="recurrent" runs exactly that, one sequence and one token at a time: the ground truth.
mode="chunk" runs the same math in chunks of 64 tokens (WY form, as fla's chunk kernels): the
intra-chunk work is batched over the chunks of every sequence at once (in cache-sized groups of
chunks), and only a short loop over the chunk index carries the state. Packed sequences are
scattered into a padded `[chunks, N, HV, 64, ...]` layout whose padding (k = v = 0, beta = 0,
g = 0) leaves each state untouched.

Value head j reads key head j // (HV // H), as fla groups heads for GVA (head_pairing="grouped");
with head_pairing="tiled" it reads key head j % H (linattn.heads).
"""

import math

import torch

from linattn.heads import check_head_pairing

from linattn.checks import (
    require,
    sequence_bounds,
    validate_compute_dtype,
    validate_floating,
    validate_shape,
)

from .chunk_decays import channel_decayed_lower, edge_decays, scalar_lower_decay

CHUNK_SIZE = 64
MODES = ("chunk", "recurrent")
GROUP_BYTES = 1 << 20  # chunks go through the intra-chunk work in groups of about this size
L2NORM_EPS = 1e-6  # fla.modules.l2norm default, used by use_qk_l2norm_in_kernel


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    mode: str = "chunk",
    *,
    compute_dtype: torch.dtype = torch.float64,
    head_pairing: str = "grouped",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN: q, k `[B,T,H,K]`, v `[B,T,HV,V]`, g (log decay) and beta `[B,T,HV]`, states `[N,HV,K,V]`.
    head_pairing: which key head each value head reads (linattn.heads.HEAD_PAIRINGS).

    Returns (o `[B,T,HV,V]`, final_state `[N,HV,K,V]` or None), both in compute_dtype.
    """
    return _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm, mode, compute_dtype, per_channel_decay=False, head_pairing=head_pairing)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    mode: str = "chunk",
    *,
    compute_dtype: torch.dtype = torch.float64,
    head_pairing: str = "grouped",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA: as gated_delta_rule but g (log decay per key channel) is `[B,T,HV,K]`."""
    return _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm, mode, compute_dtype, per_channel_decay=True, head_pairing=head_pairing)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x²) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm, mode, compute_dtype, per_channel_decay, head_pairing="grouped"):
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        validate_floating(x, name)
    validate_compute_dtype(compute_dtype)
    require(mode in MODES, "mode", f"must be one of {MODES}, got {mode!r}")
    check_head_pairing(head_pairing)
    require(q.dim() == 4, "q", f"must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    validate_shape(k, (B, T, H, K), "k")
    require(v.dim() == 4 and tuple(v.shape[:2]) == (B, T), "v",
            f"must be [B, T, HV, V] with B={B}, T={T}, got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    require(HV % H == 0, "v", f"heads HV={HV} must be a multiple of the key heads H={H}")
    validate_shape(g, (B, T, HV, K) if per_channel_decay else (B, T, HV), "g")
    validate_shape(beta, (B, T, HV), "beta")
    require(scale is None or isinstance(scale, (int, float)), "scale", f"must be a number or None, got {scale!r}")
    bounds = sequence_bounds(B, T, cu_seqlens, name="q")
    N = len(bounds) - 1
    if initial_state is not None:
        validate_floating(initial_state, "initial_state")
        validate_shape(initial_state, (N, HV, K, V), "initial_state")

    scale = K ** -0.5 if scale is None else float(scale)
    cast = dict(dtype=compute_dtype, device=q.device)
    q, k, v, g, beta = (x.to(**cast) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # flatten the batch into one token stream [B*T, HV, ...]; key heads expanded to value heads:
    # each key head's G copies side by side (grouped: j // G) or the H key heads G times (tiled: j % H)
    G = HV // H
    if head_pairing == "grouped":
        q, k = (q * scale).repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    else:
        q, k = (q * scale).repeat(1, 1, G, 1), k.repeat(1, 1, G, 1)
    q, k = q.flatten(0, 1), k.flatten(0, 1)
    v = v.flatten(0, 1)
    g = (g if per_channel_decay else g.unsqueeze(-1)).flatten(0, 1)  # [B*T, HV, K or 1]
    beta = beta.flatten(0, 1)
    state = initial_state.to(**cast) if initial_state is not None else q.new_zeros(N, HV, K, V)

    if mode == "chunk":
        beta = beta[..., None]  # [B*T, HV, 1]: the delta rule erases and writes with the same gate
        o, final_state = chunked_delta_rule(q, k, v, g, beta, beta, state, bounds)
    else:
        o, final_state = _recurrent(q, k, v, g, beta, state, bounds)
    return o.reshape(B, T, HV, V), (final_state if output_final_state else None)


def _recurrent(q, k, v, g, beta, state, bounds):
    """Token by token, one sequence at a time. Inputs `[tokens, HV, ...]`, state `[N, HV, K, V]`."""
    outputs, finals = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = state[n]  # [HV, K, V]
        # unbind once: indexing token t in the loop would make backward build a full-size gradient per token
        tokens = zip(*(x[bos:eos].unbind(0) for x in (q, k, v, g, beta)))
        for q_t, k_t, v_t, g_t, beta_t in tokens:
            S = S * g_t.exp()[..., None]
            u = beta_t[:, None] * (v_t - torch.einsum("hk,hkv->hv", k_t, S))
            S = S + k_t[:, :, None] * u[:, None, :]
            outputs.append(torch.einsum("hk,hkv->hv", q_t, S))
        finals.append(S)
    o = torch.stack(outputs) if outputs else v.new_zeros(0, *v.shape[1:])
    return o, torch.stack(finals)


def chunked_delta_rule(q, k, v, g, erase_gate, write_gate, state, bounds):
    """The gated delta rule with an erase and a write gate, in chunks of CHUNK_SIZE tokens (WY form):

        S_t = diag(exp g_t) S_{t-1};  S_t = S_t + k_t (write_gate_t ⊙ v_t - S_tᵀ (erase_gate_t ⊙ k_t))ᵀ;  o_t = S_tᵀ q_t

    GDN and KDA take both gates = beta `[.., 1]`; GDN-2 erases per key channel and writes per value
    channel. Inputs `[tokens, HV, ...]` (q already scaled), g `[tokens, HV, 1 or K]`, state
    `[N, HV, K, V]`, bounds the sequences' token boundaries. All sequences go at once through a
    padded `[chunks, N·HV, C, ...]` layout; the padding (zero inputs, g = 0) leaves each state untouched.
    Returns (o `[tokens, HV, V]`, final state `[N, HV, K, V]`).
    """
    C = CHUNK_SIZE
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    N, HV, K, V = state.shape
    num_chunks = max(1, math.ceil(max(lengths) / C))
    seq = torch.repeat_interleave(torch.arange(N, device=q.device), torch.tensor(lengths, device=q.device))
    pos = torch.arange(q.shape[0], device=q.device) - torch.tensor(bounds[:-1], device=q.device)[seq]
    # token -> (chunk, sequence, head, place in chunk); chunk-major so the loop's slices are contiguous
    slot = (pos // C, seq, slice(None), pos % C)

    def to_chunks(x):  # [tokens, HV, D] -> [chunks, N·HV, C, D], zero padding
        padded = x.new_zeros(num_chunks, N, HV, C, x.shape[-1])
        padded[slot] = x
        return padded.flatten(1, 2)

    # groups of chunks small enough to stay in cache: batched intra-chunk work per group, then the
    # state pass over the group's chunks (split once: slicing in a loop would make backward build
    # a full-size gradient per slice)
    group = max(1, GROUP_BYTES // (N * HV * C * max(K, V) * q.element_size()))
    groups = zip(*(to_chunks(x).split(group) for x in (q, k, v, g, erase_gate, write_gate)))
    S, outputs = state.reshape(N * HV, K, V), []
    for chunk_terms in (_chunk_terms(*group_inputs) for group_inputs in groups):
        for U_c, W_c, q_c, Aqk_c, decay_c, k_c in zip(*(x.unbind(0) for x in chunk_terms)):
            v_new = torch.baddbmm(U_c, W_c, S, alpha=-1)
            # in place on fresh products: bmm and mul save their inputs, not their outputs
            outputs.append((q_c @ S).baddbmm_(Aqk_c, v_new))
            S = (decay_c * S).baddbmm_(k_c, v_new)
    o = torch.stack(outputs).view(num_chunks, N, HV, C, V)[slot]
    return o, S.view(N, HV, K, V)


def _chunk_terms(q, k, v, g, erase_gate, write_gate):
    """Per chunk, what the state pass needs: U, W, q·exp(G), Aqk, exp(G_last), (k·exp(G_last - G))ᵀ,
    G the log decay from the chunk start through each token (the cumulative sum of g, the per-token
    log decay `[.., C, K or 1]`).

    WY form, with the erase key e = erase_gate ⊙ k:
    (I + strict_lower(Akk)) [U, W] = [write_gate ⊙ v, e·exp(G)], Akk[i, j] = Σ_d e_i[d] k_j[d] exp(G_i[d] - G_j[d]);
    a chunk then takes v_new = U - W S_in, o = (q·exp G) S_in + Aqk v_new and
    S_out = exp(G_last) S_in + (k·exp(G_last - G))ᵀ v_new.

    Every decay here is exp of a span of g (tokens j+1..i, the chunk start..i, j+1..last), and its
    gradient goes to g directly (scalar_lower_decay, channel_decayed_lower, edge_decays): g_t
    receives the terms of the spans that hold it. Through G instead, autograd would give
    dL/dG_i = (what exp(.. + G_i) sends) - (what exp(G_i - ..) sends) and sum that over i >= t: the
    two sides share the terms of the spans that do not hold g_t (the diagonal exp(0) = 1, the chunk's
    last k·exp(G_last - G_last)), O(1) each, and where a head decays fast g_t's true gradient is far
    below their rounding (in float32 at strong decay: A_log's and dt_bias's gradients up to 5e-4 off).
    """
    # intra-chunk pair products decayed from token j to token i, for i >= j (Akk's diagonal is
    # never read: the solve takes it as unit)
    erase_k = k * erase_gate
    if g.shape[-1] == 1:
        decay = scalar_lower_decay(g[..., 0])
        Akk = (erase_k @ k.transpose(-1, -2)) * decay
        Aqk = (q @ k.transpose(-1, -2)) * decay
    else:
        Akk, Aqk = channel_decayed_lower((erase_k, q), k, g)
    decay_in, decay_out, decay_last = edge_decays(g)
    rhs = torch.cat([v * write_gate, erase_k * decay_in], dim=-1)
    solved = torch.linalg.solve_triangular(Akk, rhs, upper=False, unitriangular=True)
    U, W = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    k_out = (k * decay_out).transpose(-1, -2)
    return U, W, q * decay_in, Aqk, decay_last.transpose(-1, -2), k_out
