"""Packed-sequence boundaries (`cu_seqlens`) that exercise the places context parallelism breaks.

`packed_seqlens(total_tokens, num_seqs, seed=..., cp_size=..., layout=...)` returns int32
boundaries `[0, ..., total_tokens]`, random but seeded, that always contain the cases a CP
implementation gets wrong (checked by `describe`):

- a sequence of length 1 (when min_len == 1): a piece shorter than any conv halo or chunk;
- contiguous layout, cp_size > 1 (each rank holds total_tokens / cp_size consecutive tokens):
  a boundary exactly on a shard edge (that rank must start from zero state and no halo),
  a boundary strictly inside a shard, and a sequence spanning at least 3 shards (cp_size >= 3:
  a middle rank without any boundary must relay the state) or, for cp_size == 2, both shards.
  One packing cannot hold both a shard-edge boundary and a sequence spanning every shard: for
  cp_size 2 and 3 the default keeps the spanning sequence (3 shards for cp 3, 2 for cp 2) and
  `edge_boundary=True` trades it for the edge boundary (cp 3 then spans 2 shards, cp 2 none).
  For cp_size >= 4 both are always there.
- zigzag layout (defined in linattn.parallel.cp.layout): every length is a multiple of
  2·cp_size, so min_len rounds up to one and the shortest possible sequence (one token per
  chunk) is included when min_len <= 2·cp_size.
  A length-1 sequence is impossible there.
- fla-zigzag layout (fla's build_cp_context(layout="zigzag"): the whole batch in 2·cp_size
  intervals, rank r holding intervals r and 2·cp_size-1-r; see pytest_linattn.harness.placement):
  the contiguous coverage over the 2·cp_size intervals (total_tokens divisible by 2·cp_size),
  so a sequence crosses intervals held by different ranks and a boundary sits on an interval edge.

Requests that cannot be met raise ValueError naming the parameter. `seed=None` means
DEFAULT_SEED, so an unseeded call is reproducible too.

`fragment_seqlens(name, cp_size, ...)` returns the named fragment tables CP implementations are
checked on (FRAGMENTS): fixed, not random, each the one way documents fall on the ranks' pieces
that a CP exchange gets wrong when it assumes otherwise:

- "uneven-pieces": every document crosses a piece edge off its middle, so its two pieces differ
  in length on every rank pair (rank r's last document keeps P - r tokens of it, P = T / cp);
- "empty-document": zero-length documents in cu_seqlens (repeated boundaries) at the batch's
  start, on a piece edge and at the end, between documents that cross the edges;
- "document-per-rank": one whole document per rank, every boundary on a piece edge: nothing
  crosses a rank, so a rank that takes state or a halo from its neighbour anyway shows.

Contiguous layout (fla-zigzag: the same over its 2·cp_size intervals); the zigzag layout cuts every
document into 2·cp_size equal chunks, so only "empty-document" (lengths multiples of 2·cp_size,
zeros among them) is one of its tables. This module imports no pytest.
"""

from __future__ import annotations

import numpy as np
import torch

from linattn.checks import positive_int, validate_cu_seqlens

DEFAULT_SEED = 20260
LAYOUTS = ("contiguous", "zigzag", "fla-zigzag")
FRAGMENTS = {
    "uneven-pieces": "every document crosses a piece edge off its middle: its pieces on the two ranks differ in length",
    "empty-document": "zero-length documents (repeated boundaries) at the start, on a piece edge and at the end",
    "document-per-rank": "one whole document per rank: every boundary on a piece edge, nothing crosses a rank",
}
_TRIES = 48


def packed_seqlens(total_tokens: int, num_seqs: int | None = None, *, seed: int | None = None,
                   min_len: int = 1, cp_size: int = 1, layout: str = "contiguous",
                   edge_boundary: bool | None = None) -> torch.Tensor:
    """Seeded int32 cu_seqlens of `num_seqs` sequences packing `total_tokens` tokens.

    num_seqs: how many sequences; None picks 3 + 2·cp_size, clamped to what fits.
    seed: any int; None means DEFAULT_SEED. Same arguments, same result.
    min_len: shortest allowed sequence (zigzag: rounded up to a multiple of 2·cp_size).
    cp_size, layout: the context-parallel split the boundaries are made to stress.
    edge_boundary: cp_size 2 or 3 only: True asks for a shard-edge boundary instead of a
        sequence spanning every shard (see the module docstring); None/False keep the span.
    """
    total_tokens = positive_int(total_tokens, "total_tokens")
    if num_seqs is not None:
        num_seqs = positive_int(num_seqs, "num_seqs")
    min_len = positive_int(min_len, "min_len")
    cp_size = positive_int(cp_size, "cp_size")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if edge_boundary not in (None, True, False):
        raise ValueError(f"edge_boundary must be None, True or False, got {edge_boundary!r}")
    if layout == "fla-zigzag":  # the contiguous coverage over the 2·cp_size intervals
        if total_tokens % (2 * cp_size):
            raise ValueError(f"total_tokens={total_tokens} must be divisible by 2*cp_size={2 * cp_size} "
                             f"(layout='fla-zigzag')")
        return packed_seqlens(total_tokens, num_seqs, seed=seed, min_len=min_len, cp_size=2 * cp_size,
                              edge_boundary=edge_boundary)
    if seed is None:
        seed = DEFAULT_SEED
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    rng = np.random.default_rng(int(seed))

    # Zigzag: plan in units of 2·cp tokens, as an unsharded packing of units.
    unit = 2 * cp_size if layout == "zigzag" else 1
    if total_tokens % (cp_size * (2 if layout == "zigzag" else 1)):
        raise ValueError(f"total_tokens={total_tokens} must be divisible by "
                         f"{'2*cp_size' if layout == 'zigzag' else 'cp_size'}={cp_size * (2 if layout == 'zigzag' else 1)}")
    units = total_tokens // unit
    min_units = -(-min_len // unit)
    if num_seqs is not None and num_seqs * min_units > units:
        raise ValueError(f"num_seqs={num_seqs} too many: {num_seqs} sequences of at least "
                         f"{min_units * unit} tokens (min_len) do not fit in total_tokens={total_tokens}")
    target = num_seqs if num_seqs is not None else 3 + 2 * cp_size
    fixed = num_seqs is not None
    if layout == "zigzag" or cp_size == 1:
        features = _Features(units, 1, min_units, span=0, edge=False, inside=False)
    else:
        if total_tokens // cp_size < 2:
            raise ValueError(f"total_tokens={total_tokens} leaves fewer than 2 tokens per CP shard: "
                             f"no boundary can fall strictly inside a shard")
        if cp_size >= 4:
            span, edge = 3, True
        elif edge_boundary:
            span, edge = cp_size - 1, True
        else:
            span, edge = cp_size, False
        features = _Features(total_tokens, cp_size, min_len, span=span, edge=edge, inside=True)
    bounds = _solve(features, target, fixed, rng, total_tokens, unit)
    return torch.tensor([b * unit for b in bounds], dtype=torch.int32)


class _Features:
    """Where the required boundaries go, for `length` slots cut into `shards` shards."""

    def __init__(self, length, shards, min_len, *, span, edge, inside):
        self.length, self.shards, self.m = length, shards, min_len
        self.shard = length // shards
        self.span, self.edge, self.inside = span, edge, inside
        self.short = min_len == 1  # want a length-1 (one-unit) sequence

    def sample(self, rng, mode):
        """(anchors, locked) for one try, or None when this try's choices leave no room.
        mode: 'random', 'short' (shortest span: most room) or 'merge' (fewest regions)."""
        T, S, m, cp = self.length, self.shard, self.m, self.shards
        anchors, locked = {0, T}, set()
        if self.span:
            n = self.span
            starts = [j for j in range(cp - n + 1) if not self.edge or j >= 1 or j + n <= cp - 1]
            if not starts:
                return None
            j0 = int(rng.choice(starts)) if mode == "random" else starts[0]
            edge = None
            if self.edge:
                ks = list(range(1, j0 + 1)) + list(range(j0 + n, cp))
                edge = (int(rng.choice(ks)) if mode == "random" else (j0 + n if j0 + n < cp else j0)) * S
                anchors.add(edge)
            prev_a = max(a for a in anchors if a <= j0 * S)
            next_a = min(a for a in anchors if a >= (j0 + n) * S)
            # Span start strictly inside shard j0 (the "inside a shard" boundary), end in shard
            # j0+n-1 or later, so it touches >= n shards.
            a_lo, a_hi = max(prev_a + m, j0 * S + 1), (j0 + 1) * S - 1
            b_lo, b_hi = (j0 + n - 1) * S + 1, next_a - m
            if a_lo > a_hi:
                return None
            b_choices = ([b_lo, b_hi] if b_lo <= b_hi else []) + [next_a]
            if mode == "random":
                a = int(rng.integers(a_lo, a_hi + 1))
                b = int(rng.integers(b_lo, b_hi + 1)) if b_lo <= b_hi and rng.random() < 0.75 else next_a
            else:
                a = a_hi
                b = b_choices[0] if mode == "short" else next_a
            anchors |= {a, b}
            locked.add((a, b))
        elif self.edge:  # cp == 2 with edge_boundary: edge at S plus a boundary inside a shard
            anchors.add(S)
            # Candidates: [m, S - m] in shard 0 and [S + m, T - m] in shard 1 (never S itself).
            n0, n1 = max(0, S - 2 * m + 1), max(0, T - S - 2 * m + 1)
            if n0 + n1 == 0:
                return None
            r = int(rng.integers(n0 + n1)) if mode == "random" else 0
            anchors.add(m + r if r < n0 else S + m + r - n0)
        if self.short:
            regions = [(lo, hi) for lo, hi in _regions(anchors) if (lo, hi) not in locked]
            if not regions:
                return None
            if any(hi - lo == 1 for lo, hi in regions):
                lo, hi = next(r for r in regions if r[1] - r[0] == 1)
            else:
                lo, hi = regions[int(rng.integers(len(regions)))] if mode == "random" else regions[0]
            p = int(rng.integers(lo, hi)) if mode == "random" else lo
            anchors |= {p, p + 1}
            locked.add((p, p + 1))
        return anchors, locked


def _regions(anchors):
    pts = sorted(anchors)
    return [(lo, hi) for lo, hi in zip(pts, pts[1:]) if hi > lo]


def _solve(features, target, fixed, rng, total_tokens, unit):
    m = features.m
    lowest, highest = None, None
    modes = ["random"] * _TRIES + ["short", "merge"]
    for mode in modes:
        plan = features.sample(rng, mode)
        if plan is None:
            continue
        anchors, locked = plan
        regions = [(lo, hi, (lo, hi) in locked) for lo, hi in _regions(anchors)]
        if any(not lk and hi - lo < m for lo, hi, lk in regions):
            continue
        rooms = [0 if lk else (hi - lo) // m - 1 for lo, hi, lk in regions]
        least, most = len(regions), len(regions) + sum(rooms)
        lowest = least if lowest is None else min(lowest, least)
        highest = most if highest is None else max(highest, most)
        n = target if fixed else min(max(target, least), most)
        if least <= n <= most:
            return _fill(regions, rooms, n, m, rng)
    if lowest is None:
        raise ValueError(f"min_len={m * unit} is too long for the coverage: with total_tokens={total_tokens} and "
                         f"cp_size={features.shards if unit == 1 else unit // 2} no packing can hold the "
                         f"required boundaries (see pytest_linattn.seqlens)")
    raise ValueError(f"num_seqs={target} cannot be met: this coverage needs between {lowest} and "
                     f"{highest} sequences for total_tokens={total_tokens}, min_len={m * unit}")


def _fill(regions, rooms, n, m, rng):
    """Cut each free region into its share of the n sequences, lengths >= m, at random."""
    extra = n - len(regions)
    shares = rng.multivariate_hypergeometric(rooms, extra) if extra else np.zeros(len(regions), dtype=np.int64)
    bounds = [0]
    for (lo, hi, lk), share in zip(regions, shares):
        k = 1 + int(share)
        spare = hi - lo - k * m
        # Stars and bars: k-1 bars among spare + k - 1 slots give a uniform composition.
        bars = np.sort(rng.choice(spare + k - 1, size=k - 1, replace=False)) if k > 1 else np.array([], dtype=np.int64)
        parts = np.diff(np.concatenate([[-1], bars, [spare + k - 1]])) - 1 + m
        for p in parts:
            bounds.append(bounds[-1] + int(p))
    return bounds


def cu_seqlens_bounds(cu_seqlens, name: str = "cu_seqlens") -> list[int]:
    """The boundaries of a packing as ints, checked by `linattn.checks.validate_cu_seqlens`'s
    rules; the end is not checked against a token count (a caller that knows one does)."""
    packed = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 0
    ends_at = int(cu_seqlens[-1]) if packed and not cu_seqlens.is_complex() else 0
    return validate_cu_seqlens(cu_seqlens, ends_at, name)


def describe(cu_seqlens, cp_size: int = 1, layout: str = "contiguous") -> dict:
    """Which of the coverage properties a cu_seqlens has, for a given CP split.

    Always: num_seqs, total_tokens, min_len, max_len, has_length_one.
    contiguous: boundary_on_shard_edge, boundary_inside_shard, max_shards_spanned (most CP
    shards one sequence touches). fla-zigzag: the same over the 2·cp_size intervals (its shards).
    zigzag: unit (2·cp_size), lengths_divisible, has_shortest (a sequence of exactly one unit).
    """
    cp_size = positive_int(cp_size, "cp_size")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "fla-zigzag":
        return describe(cu_seqlens, 2 * cp_size)
    bounds = cu_seqlens_bounds(torch.as_tensor(cu_seqlens).reshape(-1))
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    T = bounds[-1]
    out = {"num_seqs": len(lengths), "total_tokens": T, "min_len": min(lengths), "max_len": max(lengths),
           "has_length_one": 1 in lengths}
    if layout == "zigzag":
        unit = 2 * cp_size
        out.update(unit=unit, lengths_divisible=all(n % unit == 0 for n in lengths),
                   has_shortest=unit in lengths)
        return out
    if T % cp_size:
        raise ValueError(f"cu_seqlens total {T} must be divisible by cp_size={cp_size}")
    S = T // cp_size
    inner = bounds[1:-1]
    spans = [(-(-b // S) - a // S) for a, b in zip(bounds, bounds[1:]) if b > a]
    out.update(boundary_on_shard_edge=cp_size > 1 and any(b % S == 0 and 0 < b < T for b in inner),
               boundary_inside_shard=cp_size > 1 and any(b % S for b in inner),
               max_shards_spanned=max(spans))
    return out


def fragment_seqlens(name: str, cp_size: int, *, layout: str = "contiguous", piece_tokens: int = 8) -> torch.Tensor:
    """The int32 cu_seqlens of fragment table `name` (FRAGMENTS) for `cp_size` ranks of
    `piece_tokens` tokens each (T = cp_size * piece_tokens), in `layout` (module docstring).
    With P the piece length (fla-zigzag: an interval, piece_tokens / 2) and S the pieces:

    uneven-pieces      boundaries at r * (P + 1), r = 1 .. S-1 (needs P > S - 1)
    empty-document     [0, 0, a, P, P, P + b, T, T] (a = P // 2 + 1, b = P // 3 + 1): empty documents
                       first, on the first piece edge and last (zigzag: [0, 0, u, u, 3u, 3u, T, T]
                       in units u = 2 * cp_size)
    document-per-rank  [0, P, 2P, .., T]
    """
    if name not in FRAGMENTS:
        raise ValueError(f"name must be one of {sorted(FRAGMENTS)}, got {name!r}")
    cp_size = positive_int(cp_size, "cp_size")
    piece_tokens = positive_int(piece_tokens, "piece_tokens")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    T = cp_size * piece_tokens
    if layout == "zigzag":
        if name != "empty-document":
            raise ValueError(f"name {name!r} is a table of contiguous pieces: the zigzag layout cuts every document "
                             f"into 2*cp_size equal chunks over all ranks (its table is 'empty-document')")
        u = 2 * cp_size
        if T % u or T < 4 * u:
            raise ValueError(f"piece_tokens={piece_tokens} must make T = cp_size * piece_tokens a multiple of "
                             f"2*cp_size={u} of at least 4 of them (zigzag: every length a multiple of 2*cp_size)")
        return torch.tensor([0, 0, u, u, 3 * u, 3 * u, T, T], dtype=torch.int32)
    if layout == "fla-zigzag" and piece_tokens % 2:
        raise ValueError(f"piece_tokens={piece_tokens} must be even for layout='fla-zigzag' (a rank's piece is two "
                         f"intervals)")
    S, P = (2 * cp_size, piece_tokens // 2) if layout == "fla-zigzag" else (cp_size, piece_tokens)
    if name == "document-per-rank":
        bounds = [r * P for r in range(S + 1)]
    elif name == "uneven-pieces":
        if S < 2:
            raise ValueError(f"cp_size={cp_size}: uneven-pieces needs 2 pieces or more (a document crossing an edge)")
        if P <= S - 1:
            raise ValueError(f"piece_tokens={piece_tokens} too short: uneven-pieces needs pieces of more than "
                             f"{S - 1} tokens (its boundaries sit at r * (P + 1)), layout={layout!r} gives {P}")
        bounds = [0] + [r * (P + 1) for r in range(1, S)] + [T]
    else:  # empty-document
        if P < 3:
            raise ValueError(f"piece_tokens={piece_tokens} too short: empty-document needs pieces of 3 tokens or more "
                             f"(a document inside the first one), layout={layout!r} gives {P}")
        a, b = P // 2 + 1, P // 3 + 1
        bounds = [0, 0, a, P, P] + ([P + b, T, T] if S > 1 else [])
    return torch.tensor(bounds, dtype=torch.int32)
