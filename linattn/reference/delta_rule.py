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
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from linattn.heads import check_head_pairing

from linattn.checks import (
    require,
    sequence_bounds,
    validate_compute_dtype,
    validate_floating,
    validate_shape,
)

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
    gradient goes to g directly (_scalar_lower_decay, _channel_decayed_lower, _edge_decays): g_t
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
        decay = _scalar_lower_decay(g[..., 0])
        Akk = (erase_k @ k.transpose(-1, -2)) * decay
        Aqk = (q @ k.transpose(-1, -2)) * decay
    else:
        Akk, Aqk = _channel_decayed_lower((erase_k, q), k, g)
    decay_in, decay_out, decay_last = _edge_decays(g)
    rhs = torch.cat([v * write_gate, erase_k * decay_in], dim=-1)
    solved = torch.linalg.solve_triangular(Akk, rhs, upper=False, unitriangular=True)
    U, W = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    k_out = (k * decay_out).transpose(-1, -2)
    return U, W, q * decay_in, Aqk, decay_last.transpose(-1, -2), k_out


def _scalar_lower_decay(g):
    """GDN: exp(G_i - G_j) for i >= j, 0 above the diagonal; g `[.., C]` the per-token log decay, G its
    cumulative sum."""
    return _ScalarLowerDecay.apply(g)


class _ScalarLowerDecay(torch.autograd.Function):
    """D[i, j] = exp(G_i - G_j) = exp(g_{j+1} + .. + g_i) for i >= j, else 0 (G = cumsum(g), `[.., C]`).

    Backward: g_t is in D[i, j] exactly when j < t <= i, so with P = dD·D,
    dg_t = Σ_{i >= t} Σ_{j < t} P[i, j], a sum over the pairs whose span holds t only: no diagonal
    term, nothing that cancels (autograd's row sum minus column sum per G_i would). The D it takes
    there is exp of each span's own sum, summed down each column from token j + 1: G_i - G_j
    carries the rounding of G, which at G near -1000 in float32 is 1e-4 of a near-diagonal decay,
    and those are the terms g_t's gradient is made of. The forward's D stays as it was.
    """

    @staticmethod
    def forward(ctx, g):
        G = g.cumsum(-1)
        C = g.shape[-1]
        lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
        # every exponent taken is G_i - G_j with i >= j: never positive for a decay, so exp never overflows
        D = torch.where(lower, G[..., :, None] - G[..., None, :], -math.inf).exp()
        ctx.save_for_backward(g)
        return D

    @staticmethod
    @once_differentiable
    def backward(ctx, dD):
        (g,) = ctx.saved_tensors
        below = _strictly_lower(g)
        # on and above the diagonal the span sums are 0 (exp 1): those P[i, j] never reach a sum below
        P = dD * (g[..., :, None] * below).cumsum(-2).exp_()  # exp(g_{j+1} + .. + g_i)
        # through[i, c] = Σ_{j <= c} P[i, j]; dg_t = Σ_{i >= t} through[i, t - 1] (t = 0 holds no span)
        through = P.cumsum(-1)
        return F.pad((through[..., :-1] * below[:, :-1]).sum(-2), (1, 0))


def _strictly_lower(like):
    """1 where row > column, else 0: `[C, C]` for `like` `[.., C]`, in its dtype."""
    C = like.shape[-1]
    return torch.ones(C, C, dtype=like.dtype, device=like.device).tril_(-1)


def _edge_decays(g):
    """exp(G) `[.., C, D]`, exp(G_last - G) `[.., C, D]`, exp(G_last) `[.., 1, D]`: the decays from the chunk
    start through each token, from after each token through the chunk's last, and over the chunk; g
    the per-token log decay `[.., C, D]` (D = 1 or K), G its cumulative sum over the chunk."""
    return _EdgeDecays.apply(g)


class _EdgeDecays(torch.autograd.Function):
    """Backward to g directly: g_t is in G_i for i >= t (exp(G) and exp(G_last), the last's) and in
    G_last - G_j for j < t, so dg_t = Σ_{i >= t} X_i + Σ_{j < t} Y_j with X = dL/dG through exp(G)
    and Y = dL/d(G_last - G). Through G_last and G separately, the chunk's last token would get
    Σ_j Y_j - Y_last, its own k·exp(0) term both ways (O(1), cancelling). Y takes exp(G_last - G_j)
    from its span's own sum g_{j+1} + .. + g_last, not from a difference of G (as _ScalarLowerDecay)."""

    @staticmethod
    def forward(ctx, g):
        G = g.cumsum(-2)
        G_last = G[..., -1:, :]
        decay_in = G.exp()
        ctx.save_for_backward(g, decay_in)
        return decay_in, (G_last - G).exp(), G_last.exp()

    @staticmethod
    @once_differentiable
    def backward(ctx, d_in, d_out, d_last):
        g, decay_in = ctx.saved_tensors
        X = d_in * decay_in
        X[..., -1:, :] += d_last * decay_in[..., -1:, :]  # exp(G_last) is exp(G)'s last
        Y = d_out * F.pad(_suffix_sums(g[..., 1:, :]), (0, 0, 0, 1)).exp_()
        return _suffix_sums(X) + F.pad(Y[..., :-1, :], (0, 0, 1, 0)).cumsum(-2)  # Σ_{i >= t} X_i + Σ_{j < t} Y_j


def _suffix_sums(x):
    """Σ_{i >= t} x_i along the tokens (dim -2)."""
    return x.flip(-2).cumsum(-2).flip(-2)


def _channel_decayed_lower(rows_list, b, g):
    """KDA: for each a in rows_list, M[i, j] = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d]) for j <= i, else 0;
    g `[.., C, K]` the per-token log decay, G its cumulative sum."""
    # rows interleaved per token, [.., C, R, K]: each level then takes all R matrices in one bmm
    return list(_ChannelDecayedLower.apply(b, g, torch.stack(rows_list, dim=-2)).unbind(-2))


class _ChannelDecayedLower(torch.autograd.Function):
    """exp(G_i - G_j) per channel does not factor stably as exp(G_i)·exp(-G_j) (exp(-G_j) overflows
    for strong decays). So the lower triangle is cut into quarters by halving: at level h (h = C/2,
    C/4, .., 1) each block of 2h tokens has a lower-left h×h quarter that factors through the first
    token r of its second half, exp(G_i - G_r)·exp(G_r - G_j), both exponents never positive; the
    quarters of all levels plus the diagonal tile the lower triangle exactly.

    Forward and backward are written out (under no_grad) rather than left to autograd: every level
    works on strided views of the same contiguous tensors and writes its quarters in place, where
    autograd would materialize a full-size zero gradient per view and a cat per level.

    The backward takes each quarter's exponents as sums of their own spans of g (_LevelSpans: the
    rows' g_{r+1} + .. + g_i, the columns' g_{j+1} + .. + g_r) rather than as differences of G,
    which carry G's rounding (in float32 at G near -1000, 1e-4 of a near-diagonal decay; the
    forward keeps them), and sends the gate's gradient back through those sums to g: every term
    g_t receives comes from a span that holds t, none from the diagonal (which holds no g), nothing
    cancels.
    Shapes: b, g (per-token log decay) `[.., C, K]`, rows `[.., C, R, K]`, M `[.., C, R, C]`.
    """

    @staticmethod
    def forward(ctx, b, g, rows):
        b, rows = b.contiguous(), rows.contiguous()
        G = g.cumsum(-2)
        M = rows.new_zeros(*rows.shape[:-1], rows.shape[-3])
        torch.diagonal(M, dim1=-3, dim2=-1).copy_((rows * b.unsqueeze(-2)).sum(-1).transpose(-1, -2))
        for h in _halving_levels(G.shape[-2]):
            G_first, G_second = _block_halves(G, h)
            ref = G_second[..., :1, :]
            scaled_rows, cols = _level_factors(b, rows, h, (G_second - ref).exp(), (ref - G_first).exp())
            _lower_left_quarters(M, h).copy_((scaled_rows @ cols.transpose(-1, -2)).unflatten(-2, (h, -1)))
        # backward recomputes the level factors: as fast as keeping them (fresh memory costs page
        # faults), and the forward holds nothing beyond its inputs
        ctx.save_for_backward(b, g, rows)
        return M

    @staticmethod
    @once_differentiable
    def backward(ctx, dM):
        b, g, rows = ctx.saved_tensors
        # contiguous first: broadcasting the strided diagonal itself is slow
        diag = torch.diagonal(dM, dim1=-3, dim2=-1).transpose(-1, -2).contiguous().unsqueeze(-1)  # [.., C, R, 1]
        d_rows = diag * b.unsqueeze(-2)
        db = _sum_over_rows(diag * rows)
        spans = _LevelSpans(g.contiguous())
        for h in _halving_levels(b.shape[-2]):
            row_decay, col_decay = spans.decays[h]
            scaled_rows, cols = _level_factors(b, rows, h, row_decay, col_decay)
            # contiguous: a strided operand sends bmm down a slow per-matrix path
            d_quarter = _lower_left_quarters(dM, h).contiguous().flatten(-3, -2)  # [.., C/2h, h·R, h]
            # h = 1: outer products, which bmm runs far slower than a broadcast multiply
            d_scaled_rows = d_quarter @ cols if h > 1 else d_quarter * cols
            d_scaled_cols = (d_quarter.transpose(-1, -2) @ scaled_rows if h > 1
                             else (d_quarter * scaled_rows).sum(-2, keepdim=True))
            _block_halves(d_rows, h, -3)[1].addcmul_(d_scaled_rows.unflatten(-2, (h, -1)), row_decay.unsqueeze(-2))
            _block_halves(db, h)[0].addcmul_(d_scaled_cols, col_decay)
            spans.backward_level(h, scaled_rows, d_scaled_rows, cols, d_scaled_cols)
        return db, spans.dg, d_rows


class _LevelSpans:
    """The exponents of every level's quarters as sums over their spans of g `[.., C, K]`:

        rows    A_h[i] = g_{r+1} + .. + g_i   (i in a block's second half, r its first token)
        columns B_h[j] = g_{j+1} + .. + g_r   (j in the first half)

    with, in each aligned run of h tokens from s, A_h[s + p] = g_{s+1} + .. + g_{s+p} and
    B_h[s + p] = g_{s+p+1} + .. + g_{s+h} (through the next run's first token; g_C = 0). A run of
    2h is made from its two runs of h, from h = 1 (A_1 = 0, B_1[s] = g_{s+1}) upward:
    A_2h = A_h on the first run, A_h[first's last] + g_{second's first} + A_h on the second;
    B_2h = B_h on the first run + B_h[second's first], B_h on the second. One elementwise step per
    level, no scan along the tokens. The decays are built in exp space (exp(A_2h) = exp(A_h)·..),
    each a product of exp(g_t) over its own span, never a difference of cumulative sums.

    `decays[h]` = (exp(A_h) on the second halves, exp(B_h) on the first halves), `[.., C/2h, h, K]`
    each. backward_level(h, ..) takes level h's exponent gradients (C/2 first, down to 1) and
    passes them back down the same construction (sums only); `dg` after level 1.
    """

    def __init__(self, g):
        self.d_after, self.d_before = torch.zeros_like(g), torch.zeros_like(g)
        self.decays = {}
        # exp(A_2h) on the second run = exp(A_h) there · exp(A_h[first's last]) · exp(g_{second's first}),
        # exp(B_2h) on the first = exp(B_h) there · exp(B_h[second's first]); one exp per token
        decay = g.exp()
        after, before = torch.ones_like(g), F.pad(decay[..., 1:, :], (0, 0, 0, 1), value=1.0)
        levels = list(_halving_levels(g.shape[-2]))[::-1]  # 1, 2, .., C/2
        for h in levels:
            (a_first, a_second), (b_first, b_second) = _block_halves(after, h), _block_halves(before, h)
            if h == levels[-1]:
                self.decays[h] = a_second, b_first
                break
            self.decays[h] = a_second.clone(), b_first.clone()  # runs of 2h from runs of h, in place
            a_second *= a_first[..., -1:, :] * _block_halves(decay, h)[1][..., :1, :]
            b_first *= b_second[..., :1, :]

    def backward_level(self, h, scaled_rows, d_scaled_rows, cols, d_scaled_cols):
        """Level h's exponent gradients from its factors and their gradients (the rows' summed over
        the row sets; at h = 1 the rows' span is empty), then undo the step that made runs of h from
        runs of h/2."""
        if h > 1:
            d_exponents = _block_halves(self.d_after, h)[1]  # [.., C/2h, h, K]
            for x, dx in zip(*(t.unflatten(-2, (h, -1)).unbind(-2) for t in (scaled_rows, d_scaled_rows))):
                d_exponents.addcmul_(x, dx)
        _block_halves(self.d_before, h)[0].addcmul_(cols, d_scaled_cols)
        if h > 1:
            half = h // 2
            (a_first, a_second), (b_first, b_second) = (_block_halves(self.d_after, half),
                                                        _block_halves(self.d_before, half))
            from_after = a_second.sum(-2, keepdim=True)
            a_first[..., -1:, :] += from_after
            b_second[..., :1, :] += b_first.sum(-2, keepdim=True)
            # the g_{second's first} of A's step: to the B entry that is just that g (B at the first
            # run's last token, from here down; added after the first run's sum, which must not hold it)
            b_first[..., -1:, :] += from_after

    @property
    def dg(self):
        """After level 1: A_1 is constant, B_1[s] = g_{s+1}."""
        return F.pad(self.d_before[..., :-1, :], (0, 0, 1, 0))


def _level_factors(b, rows, h, row_decay, col_decay):
    """Level h's scaled rows `[.., C/2h, h·R, K]` and scaled columns `[.., C/2h, h, K]`."""
    scaled_rows = (_block_halves(rows, h, -3)[1] * row_decay.unsqueeze(-2)).flatten(-3, -2)
    return scaled_rows, _block_halves(b, h)[0] * col_decay


def _sum_over_rows(x):
    """x.sum(-2) over the R row sets of `[.., R, K]`, as adds: a reduction over a middle dim is slow."""
    return sum(x.unbind(-2))


def _halving_levels(C):
    """h = C/2, C/4, .., 1."""
    h = C // 2
    while h >= 1:
        yield h
        h //= 2


def _block_halves(x, h, token_dim=-2):
    """Views of the first and second h tokens of every block of 2h along token_dim (negative):
    [.., C, ..] -> 2 × [.., C/2h, h, ..]."""
    blocks = x.unflatten(token_dim, (-1, 2, h))
    return blocks.select(token_dim - 1, 0), blocks.select(token_dim - 1, 1)


def _lower_left_quarters(M, h):
    """View of the lower-left h×h quarter of every diagonal 2h×2h block of M `[.., C, R, C]`:
    `[.., C/2h, h, R, h]`."""
    m = M.shape[-1] // (2 * h)
    blocks = torch.diagonal(M.unflatten(-1, (m, 2 * h)).unflatten(-4, (m, 2 * h)), dim1=-5, dim2=-2)
    return blocks[..., h:, :, :h, :].movedim(-1, -4)  # from [.., 2h, R, 2h, C/2h]
