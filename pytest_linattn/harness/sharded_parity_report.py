"""What `assert_sharded_parity` says beside a failing check (pytest_linattn.harness.sharded_parity):
the layouts differ (the ranks' outputs are the replicated layer's on the batch read in another
layout, with the first token where they disagree), the packing was lost, shard and unshard
disagree, and under a failing output or input gradient the first wrong token of each CP rank.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .cases import ParityCase
from .placement import (LAYOUT_WORDS, LAYOUTS, as_cu_seqlens, check_fits, padded_cu_seqlens, rank_token_index,
                        real_positions)


def reference_forward(case: ParityCase, x):
    ref = case.reference
    return case.reference_forward(ref, x, case.cu_seqlens) if case.reference_forward else ref(x, case.cu_seqlens)


def gather_tokens(holders, ref, case, what):
    """The whole batch `[1, T, ...]` from the (tp_rank, cp_rank) -> tensor pieces in `holders`;
    tokens nobody holds stay NaN (never passes). A padded placement's pads are dropped."""
    __tracebackhide__ = True
    held = int(padded_cu_seqlens(case.cu_seqlens, case.placement)[-1])
    full = torch.full((ref.shape[0], held, *ref.shape[2:]), math.nan, dtype=torch.float64)
    for (t, c), piece in holders.items():
        index = rank_token_index(case.cu_seqlens, case.placement, t, c)
        if piece is None or tuple(piece.shape) != (1, index.numel(), *ref.shape[2:]):
            raise AssertionError(f"{case.name} {what}: TP rank {t}, CP rank {c} returned shape "
                                 f"{None if piece is None else tuple(piece.shape)}; its tokens are "
                                 f"{(1, index.numel(), *ref.shape[2:])}")
        full[:, index] = piece.double()
    return full[:, real_positions(case.cu_seqlens, case.placement)]


def layout_note(case: ParityCase, results) -> str:
    """For a failing CP case: a line saying the layouts differ when the ranks' outputs are the
    replicated layer's on the batch as the layer saw it in another layout that fits the packing
    (rank r, handed this placement's tokens, took them for that layout's), else "". A layer fed
    another layout than its own fails everywhere with O(1) errors, like any bug; this tells which."""
    p = case.placement
    if p.cp == 1 or p.padded:
        return ""
    bounds = [int(b) for b in case.cu_seqlens.tolist()]
    holders = [(t, c) for c in range(p.cp) for t in (range(p.tp) if p.sequence_parallel else [0])]
    for layout in LAYOUTS:
        other = dataclasses.replace(p, cp_layout=layout)
        try:
            check_fits(bounds, other)
        except ValueError:
            continue
        moves = [(rank_token_index(case.cu_seqlens, p, t, c), rank_token_index(case.cu_seqlens, other, t, c),
                  results[t + p.tp * c][0]) for t, c in holders]
        if layout == p.cp_layout or all(torch.equal(mine, seen) for mine, seen, _ in moves):
            continue
        x_seen = torch.empty_like(case.x)
        for mine, seen, _ in moves:
            x_seen[:, seen] = case.x[:, mine]
        with torch.no_grad():
            y_seen = reference_forward(case, x_seen.to(next(case.reference.parameters()).dtype)).double()
        y = torch.full_like(y_seen, math.nan)
        for _, seen, piece in moves:
            if piece is None or tuple(piece.shape) != (1, seen.numel(), *y_seen.shape[2:]):
                return ""
            y[:, seen] = piece.double()
        error = float(torch.linalg.vector_norm(y - y_seen) / torch.linalg.vector_norm(y_seen))
        if error <= case.rtol:  # NaN never passes
            return (f"the layouts differ: the layer lays tokens out as cp_layout={layout!r} does "
                    f"({LAYOUT_WORDS[layout]}), this placement as {p.cp_layout!r} does ({LAYOUT_WORDS[p.cp_layout]}). "
                    f"Its outputs are the replicated layer's on the batch read in {layout!r} order (error "
                    f"{error:.1e}); {first_disagreement(bounds, holders, moves, p, layout)}: test it with "
                    f"Placement(cp_layout={layout!r}), or give the layer this layout")
    return ""


def first_disagreement(bounds, holders, moves, placement, layout) -> str:
    """Where two token layouts first disagree: the first token (global order) a rank holds at a
    local position where `layout` has another token, named with the rank and the other token."""
    def where(t):
        n = max(i for i in range(len(bounds) - 1) if bounds[i] <= t)
        return f"seq {n} token {t - bounds[n]} (global {t})"

    slots = [(int(a), holder, i, int(b)) for holder, (mine, seen, _) in zip(holders, moves)
             for i, (a, b) in enumerate(zip(mine.tolist(), seen.tolist())) if a != b]
    token, (tp_rank, cp_rank), i, other = min(slots)
    rank = f"CP rank {cp_rank}" + (f", TP rank {tp_rank}" if placement.sequence_parallel else "")
    return (f"the two first disagree at {where(token)}, which this placement hands to {rank} as its local token {i}, "
            f"where {layout!r} has {where(other)}")


def packing_note(case: ParityCase, results) -> str:
    """For a failing CP case of several packed sequences: a line saying the packing was lost when
    the ranks' outputs are the replicated layer's on the batch as one sequence (cu_seqlens [0, T]),
    else "". The sharded layer then ran its pieces without the packed boundaries (they did not
    reach its CP context or its ops): state and conv run from one document into the next."""
    p = case.placement
    bounds = [int(b) for b in case.cu_seqlens.tolist()]
    if p.cp == 1 or p.padded or len(bounds) <= 2:
        return ""
    whole = torch.tensor([0, bounds[-1]], dtype=case.cu_seqlens.dtype)
    ref = case.reference
    x = case.x.to(next(ref.parameters()).dtype)
    with torch.no_grad():
        y_one = (case.reference_forward(ref, x, whole) if case.reference_forward else ref(x, whole)).double()
    holders = {(t, c): results[t + p.tp * c][0] for c in range(p.cp)
               for t in (range(p.tp) if p.sequence_parallel else [0])}
    try:
        y = gather_tokens(holders, y_one, case, "output")
    except AssertionError:
        return ""
    error = float(torch.linalg.vector_norm(y - y_one) / torch.linalg.vector_norm(y_one))
    if not error <= case.rtol:  # NaN never passes
        return ""
    return (f"the packing was lost: the ranks' outputs are the replicated layer's on the batch as one sequence "
            f"(cu_seqlens [0, {bounds[-1]}], error {error:.1e}), not on its {len(bounds) - 1} packed sequences: the "
            f"sharded layer runs its pieces without the boundaries (they did not reach its CP context or its ops), "
            f"so state and conv run from one document into the next")


def first_wrong_tokens(actual, expected, cu_seqlens, ranks, rtol) -> str:
    """The first token (in global order) whose error, relative to the tokens' RMS norm, is over
    `rtol` (NaN always), overall or, given `ranks` ({rank kind: the rank holding each token}), on
    each rank: where a rank's state, halo or boundaries went wrong first. One line."""
    scale = float(torch.linalg.vector_norm(expected.double())) / math.sqrt(max(expected.shape[1], 1)) or 1.0
    per_token = torch.linalg.vector_norm((actual.double() - expected.double())[0].flatten(1), dim=1) / scale
    bad = (~(per_token <= rtol)).tolist()
    bounds = [int(b) for b in as_cu_seqlens(cu_seqlens).tolist()]

    def where(t):
        n = max(i for i in range(len(bounds) - 1) if bounds[i] <= t)
        return f"seq {n} token {t - bounds[n]} (global {t})"

    if not ranks:
        first = next((t for t, b in enumerate(bad) if b), None)
        return "first wrong token: " + ("none" if first is None else where(first))
    holders = list(zip(*(r.tolist() for r in ranks.values())))
    firsts = {}
    for t, holder in enumerate(holders):
        firsts.setdefault(holder, None)
        if bad[t] and firsts[holder] is None:
            firsts[holder] = t
    words = []
    for holder in sorted(firsts):
        rank = ", ".join(f"{kind} {r}" for kind, r in zip(ranks, holder))
        words.append(f"{rank} at " + ("none" if firsts[holder] is None else where(firsts[holder])))
    return "first wrong token per rank: " + "; ".join(words)


def shard_note(case: ParityCase) -> str:
    """For a failing TP case: a line saying the client's `shard` and `unshard` disagree, when the
    TP ranks' shards of the reference's weights, put back together by `unshard`, are not the
    weights (each such parameter named, with the rows that come back wrong and the first wrong
    element in the layer's words), else "". The ranks then compute with other weights than the ones
    their gradients are compared as: every tensor fails, and this says where it starts."""
    p, layer = case.placement, case.layer
    if p.tp == 1 or layer.shard is None or layer.unshard is None:
        return ""
    weights = {n: q.detach() for n, q in case.reference.named_parameters()}
    try:
        back = layer.unshard([layer.shard(weights, p, t) for t in range(p.tp)], p)
    except Exception:  # noqa: BLE001 - a client whose unshard takes gradients only: no note
        return ""
    wrong = []
    for name, w in weights.items():
        b = back.get(name) if isinstance(back, dict) else None
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != tuple(w.shape) or w.dim() == 0:
            continue
        differs = b.detach().double().cpu() != w.double().cpu()
        if not bool(differs.any()):
            continue
        rows = differs.reshape(w.shape[0], -1).any(1).tolist()
        runs, start = [], None
        for i, r in enumerate(rows + [False]):
            if r and start is None:
                start = i
            elif not r and start is not None:
                runs.append(f"{start}..{i - 1}" if i - 1 > start else f"{start}")
                start = None
        index = tuple(int(i) for i in torch.nonzero(differs)[0])
        described = layer.describe_grad_element(name, index, p) if layer.describe_grad_element else None
        first = f"{described} at index {index}" if described else f"index {index}"
        wrong.append(f"{name} (rows {', '.join(runs)} of {w.shape[0]} differ; first: {first})")
    if not wrong:
        return ""
    return (f"shard and unshard disagree: unshard of the TP ranks' shards is not the reference's weight in "
            f"{'; '.join(wrong)}. Each rank computes with other weights than its gradients are compared as: fix "
            f"the shard function (or unshard) of these parameters first")


def token_ranks(holders, case) -> dict | None:
    """{"CP rank": .., "TP rank": ..} of every token, for the kinds that split the tokens here
    (zigzag and SP make the holder something other than token // (T / cp))."""
    p, T = case.placement, int(padded_cu_seqlens(case.cu_seqlens, case.placement)[-1])
    cp_rank, tp_rank = torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64)
    for t, c in holders:
        index = rank_token_index(case.cu_seqlens, p, t, c)
        cp_rank[index], tp_rank[index] = c, t
    real = real_positions(case.cu_seqlens, p)  # a padded placement's real tokens
    cp_rank, tp_rank = cp_rank[real], tp_rank[real]
    ranks = {}
    if p.cp > 1:
        ranks["CP rank"] = cp_rank
    if p.sequence_parallel:
        ranks["TP rank"] = tp_rank
    return ranks or None
