"""The decays of the chunked delta rule (linattn.reference.delta_rule's chunk form), each exp of
a span of the per-token log decays g, with a backward that sends every span's gradient to the g_t
it holds directly: no cancelling totals through the cumulative decay G (see _chunk_terms there).

    scalar_lower_decay(g)          GDN: exp(G_i - G_j) for i >= j, 0 above
    channel_decayed_lower(rows, b, g)  KDA: rows_i · b_j · exp(G_i - G_j) per key channel, i >= j
    edge_decays(g)                 exp(G), exp(G_last - G), exp(G_last)
"""

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["channel_decayed_lower", "edge_decays", "scalar_lower_decay"]


def scalar_lower_decay(g):
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


def edge_decays(g):
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


def channel_decayed_lower(rows_list, b, g):
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
