"""Gated delta rule (GDN, scalar decay per head) and KDA (decay per key channel), two ways.

Per value head, token by token (fla's naive recurrence):

    S_t = diag(exp g_t) S_{t-1}                       (exp g_t a scalar for GDN)
    S_t = S_t + beta_t k_t (v_t - S_tᵀ k_t)ᵀ
    o_t = scale · S_tᵀ q_t

mode="recurrent" runs exactly that, one sequence and one token at a time: the ground truth.
mode="chunk" runs the same math in chunks of 64 tokens (WY form, as fla's chunk kernels): all
intra-chunk work is batched over every chunk of every sequence, and only a short loop over the
chunk index carries the state. Packed sequences are scattered into a padded `[N, L]` layout whose
padding (k = v = 0, beta = 0, g = 0) leaves each state untouched.

Value head j reads key head j // (HV // H), as fla groups heads for GVA.
"""

import math

import torch

from .checks import (
    require,
    sequence_bounds,
    validate_compute_dtype,
    validate_floating,
    validate_shape,
)

CHUNK_SIZE = 64
MODES = ("chunk", "recurrent")
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN: q, k `[B,T,H,K]`, v `[B,T,HV,V]`, g (log decay) and beta `[B,T,HV]`, states `[N,HV,K,V]`.

    Returns (o `[B,T,HV,V]`, final_state `[N,HV,K,V]` or None), both in compute_dtype.
    """
    return _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm, mode, compute_dtype, per_channel_decay=False)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA: as gated_delta_rule but g (log decay per key channel) is `[B,T,HV,K]`."""
    return _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm, mode, compute_dtype, per_channel_decay=True)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x²) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm, mode, compute_dtype, per_channel_decay):
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
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
    # flatten the batch into one token stream [B*T, HV, ...]; key heads expanded to value heads
    G = HV // H
    q = (q * scale).repeat_interleave(G, dim=2).flatten(0, 1)
    k = k.repeat_interleave(G, dim=2).flatten(0, 1)
    v = v.flatten(0, 1)
    g = (g if per_channel_decay else g.unsqueeze(-1)).flatten(0, 1)  # [B*T, HV, K or 1]
    beta = beta.flatten(0, 1)
    state = initial_state.to(**cast) if initial_state is not None else q.new_zeros(N, HV, K, V)

    run = _chunked if mode == "chunk" else _recurrent
    o, final_state = run(q, k, v, g, beta, state, bounds)
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


def _chunked(q, k, v, g, beta, state, bounds):
    """Chunked WY form over a padded `[N, HV, chunks, C, ...]` layout of all sequences at once."""
    C = CHUNK_SIZE
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    N, num_chunks = len(lengths), max(1, math.ceil(max(lengths) / C))
    seq = torch.repeat_interleave(torch.arange(N, device=q.device), torch.tensor(lengths, device=q.device))
    pos = torch.arange(q.shape[0], device=q.device) - torch.tensor(bounds[:-1], device=q.device)[seq]

    def to_chunks(x):  # [tokens, HV, ...] -> [N, HV, chunks, C, ...], zero padding
        padded = x.new_zeros(N, num_chunks * C, *x.shape[1:]).index_put((seq, pos), x)
        return padded.unflatten(1, (num_chunks, C)).movedim(3, 1)

    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
    g = g.cumsum(-2)  # log decay from the chunk start through each token, [.., C, K or 1]
    g_last = g[..., -1:, :]

    # intra-chunk pair products, decayed from column token j to row token i (i >= j)
    if g.shape[-1] == 1:
        Akk, Aqk = _scalar_decayed_lower(q, k, g[..., 0])
    else:
        Akk = _channel_decayed_lower(k, k, g, inclusive=False)
        Aqk = _channel_decayed_lower(q, k, g, inclusive=True)

    # WY form: (I + diag(beta) Akk) [U, W] = diag(beta) [v, k·exp(g)]; a chunk then needs
    # v_new = U - W S_in, o = (q·exp g) S_in + Aqk v_new, S_out = exp(g_last) S_in + (k·exp(g_last - g))ᵀ v_new
    beta = beta[..., None]
    rhs = torch.cat([beta * v, beta * k * g.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(beta * Akk, rhs, upper=False, unitriangular=True)
    U, W = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    q_in = q * g.exp()
    k_out = k * (g_last - g).exp()
    state_decay = g_last.exp().transpose(-1, -2)  # [.., K or 1, 1]

    # unbind once: indexing chunk c in the loop would make backward build a full-size gradient per chunk
    per_chunk = zip(*(x.unbind(2) for x in (U, W, q_in, Aqk, state_decay, k_out.transpose(-1, -2))))
    S, outputs = state, []
    for U_c, W_c, q_c, Aqk_c, decay_c, k_c in per_chunk:
        v_new = U_c - W_c @ S
        outputs.append(q_c @ S + Aqk_c @ v_new)
        S = decay_c * S + k_c @ v_new
    o = torch.stack(outputs, dim=2).flatten(2, 3).movedim(1, 2)  # [N, L, HV, V]
    return o[seq, pos], S


def _scalar_decayed_lower(q, k, g):
    """GDN: strictly lower k·k and lower-with-diagonal q·k products, times exp(g_i - g_j)."""
    C = g.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    strict = lower.tril(-1)
    # every exponent is g_i - g_j with i >= j: never positive for a decay, so exp never overflows
    decay = torch.where(lower, g[..., :, None] - g[..., None, :], 0.0).exp()
    Akk = (k @ k.transpose(-1, -2)) * decay * strict
    Aqk = (q @ k.transpose(-1, -2)) * decay * lower
    return Akk, Aqk


def _channel_decayed_lower(a, b, g, inclusive):
    """KDA: M[i, j] = sum_d a_i[d] b_j[d] exp(g_i[d] - g_j[d]) for j < i (j <= i if inclusive), else 0.

    exp(g_i - g_j) per channel does not factor stably as exp(g_i)·exp(-g_j) (exp(-g_j) overflows
    for strong decays), so split the block in halves recursively: the lower-left quarter factors
    through the first token r of the second half, exp(g_i - g_r)·exp(g_r - g_j), both exponents
    never positive; the two diagonal halves recurse (batched together) down to single tokens.
    """
    n = a.shape[-2]
    if n == 1:
        diagonal = (a * b).sum(-1)[..., None]
        return diagonal if inclusive else torch.zeros_like(diagonal)
    h = n // 2
    split = lambda x: x.unflatten(-2, (2, h))  # noqa: E731  (the two halves as a batch dim)
    halves = _channel_decayed_lower(split(a), split(b), split(g), inclusive)
    ref = g[..., h:h + 1, :]
    rows = a[..., h:, :] * (g[..., h:, :] - ref).exp()
    cols = b[..., :h, :] * (ref - g[..., :h, :]).exp()
    lower_left = rows @ cols.transpose(-1, -2)
    top = torch.cat([halves[..., 0, :, :], torch.zeros_like(lower_left)], dim=-1)
    bottom = torch.cat([lower_left, halves[..., 1, :, :]], dim=-1)
    return torch.cat([top, bottom], dim=-2)
