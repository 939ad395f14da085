"""The continuation check: a layer's outputs and carried states may not depend on where its
sequences were cut into calls, or across ranks.

Every packed sequence is cut into prefill chunks (`plan_cuts`: a 1-token first chunk, W-1 and W
tokens, the kernel chunk size and its neighbours, a 1-token chunk in the middle, random cuts),
then its last tokens are decoded one at a time. The calls run in order on the ranks: prefill call
k packs the k-th chunk of every sequence that has one, each from the state its previous call
left; then decode step j takes the j-th decoded token of every sequence that has one. Every
token's output, the final states and (for a differentiable path) the gradients of the inputs and
of the initial states (the loss is sum(y * dy) + sum(final state * dht)) are compared with one
full forward of the replicated layer from the same initial states, in float64.

The reference is called once with `state=None` first (no grad) to learn the state: its fields
and their shapes, one row per sequence; the random initial states and their cotangents are
drawn in those shapes. A state field the full forward leaves without a gradient (it never reads
the initial value) has a zero gradient, on the ranks and in the reference alike.

At TP each rank holds its heads' state (the client's `shard_state`); at CP each prefill call is
split contiguously over the CP ranks (a continued prefill: each sequence starts from its state on
whichever rank it starts; a call whose token count does not divide by cp gets a filler sequence,
unchecked), the states come back whole on every rank, and the decode steps run on every rank.
The backward runs call by call; a prefill call's state gradients, each CP rank's share, are
summed over the CP ranks before they reach the previous call (whose final states take a whole
gradient on every rank: `continuation_report.CP_GRADIENT_RULE`); a decode step is whole on every
rank, and checked on each.

A failure names the sequence, its cuts, the call, and for outputs the first token (in the
sequence's order) that is off: the first wrong token says where the state went wrong; for input
gradients the call whose backward goes wrong first (the latest wrong token). Every placement is
checked and reported. A case whose outputs barely move when an initial state field moves cannot
see a bug in carrying that field: `StateInvisibleWarning`. This module imports no pytest:

    continuation         the entry, the reference run, the visibility warning
    continuation_plans   the cuts and the calls
    continuation_report  the comparisons of one placement and their words
    continuation_rank    what each rank runs
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .cases import StatePath
from .continuation_plans import SequencePlan, plan_cuts, schedule
from .continuation_rank import RankContinuation, run_continuation_on_rank
from .continuation_report import check_placement, field_names
from .placement import Placement, as_cu_seqlens, check_one_stage, check_placements, check_seed

__all__ = ["SequencePlan", "StateInvisibleWarning", "assert_continuation_parity", "plan_cuts"]

# an initial-state field whose flip moves the outputs by less than this many rtol: invisible
VISIBLE_RTOLS = 100


class StateInvisibleWarning(UserWarning):
    """The case's outputs barely depend on a field of the initial state: a bug in carrying that
    field from call to call would pass the continuation check."""


def assert_continuation_parity(spawn, path: StatePath, reference: torch.nn.Module, placements: Sequence[Placement],
                               cu_seqlens, *, hidden_size: int, seed: int, rtol: float, conv_width: int | None = None,
                               chunk_size: int = 64, decode: int = 2, plans: Sequence[SequencePlan] | None = None,
                               dtype: torch.dtype = torch.float64, reference_forward: Callable | None = None,
                               name: str = "") -> None:
    """The client's layer (`path`) at every placement, its sequences cut into chunks and decode
    steps (`plans`, default `plan_cuts(..., conv_width=conv_width, chunk_size=chunk_size)`), against
    one full forward of `reference` (the replicated layer, float64) from the same random initial
    states: every token's output, the final states, and for a differentiable path the gradients of
    the inputs and initial states, within `rtol` (relative Frobenius error per tensor).
    AssertionError naming every failing placement, the sequence, its cuts, the call and the token.

    reference_forward(reference, x, cu_seqlens, state) -> (y, final_state): one full forward from
    `state`; default `reference(x, cu_seqlens, state, output_final_state=True)`. It is called
    first with state=None (zeros), without grad, to learn the state's fields and shapes.
    conv_width: needed for the default plans only (they cut at W-1 and W tokens).
    x, dy, the initial states and dht are drawn from N(0, 1) seeded by `seed` (in the names).
    Placements: tp and cp, contiguous CP layout, no sequence parallel. Warns
    (`StateInvisibleWarning`) when flipping a field of the initial state barely moves the outputs.
    """
    __tracebackhide__ = True
    if not isinstance(path, StatePath):
        raise ValueError(f"path must be a StatePath, got {type(path).__name__}")
    cu = as_cu_seqlens(cu_seqlens)
    bounds = [int(b) for b in cu.tolist()]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    positive_int(hidden_size, "hidden_size")
    rtol = check_rtol(rtol)
    check_seed(seed)
    if min(lengths) < 1:
        raise ValueError(f"cu_seqlens must hold no empty sequence, got {bounds}")
    placements = check_placements(placements)
    for p in placements:
        check_one_stage(p, "the continuation check")
        if p.cp_layout != "contiguous" or p.sequence_parallel:
            raise ValueError(f"placement {p.name}: the continuation check runs contiguous CP without sequence parallel")
        if p.tp > 1 and path.shard_state is None:
            raise ValueError(f"placement {p.name}: tp > 1 needs StatePath.shard_state and unshard_state")
    decode = 0 if path.no_decode else decode
    if plans is None:
        if conv_width is None:
            raise ValueError("conv_width is required unless plans= gives the cuts (the default plans cut at W-1 "
                             "and W tokens)")
        plans = plan_cuts(lengths, conv_width=conv_width, chunk_size=chunk_size, decode=decode, seed=seed)
    plans = list(plans)
    if len(plans) != len(lengths) or any(not isinstance(pl, SequencePlan) for pl in plans):
        raise ValueError(f"plans must hold one SequencePlan per sequence ({len(lengths)}), got {plans!r}")
    for n, (pl, length) in enumerate(zip(plans, lengths)):
        if pl.length != length:
            raise ValueError(f"plans[{n}] covers {pl.length} tokens ({pl}); sequence {n} has {length}")
        if pl.decode and path.no_decode:
            raise ValueError(f"plans[{n}] decodes {pl.decode} tokens, but the StatePath has no decode path")

    gen = torch.Generator().manual_seed(seed)
    T = bounds[-1]
    x, dy = (torch.randn(1, T, hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    forward = reference_forward or _default_reference_forward
    ref_dtype = next(reference.parameters()).dtype
    with torch.no_grad():
        _, probe = forward(reference, x.to(ref_dtype), cu, None)  # the state's fields and shapes
    h0 = _like(probe, lambda t: torch.randn(t.shape, generator=gen, dtype=torch.float64))
    dht = _like(probe, lambda t: torch.randn(t.shape, generator=gen, dtype=torch.float64))
    expected = _reference_run(forward, reference, x, dy, cu, h0, dht, path.differentiable)

    label = f"{name}/" if name else ""
    _warn_where_the_state_is_invisible(forward, reference, x, cu, h0, expected, rtol, f"{label}seed{seed}")
    reports, passed = [], []
    for p in placements:
        calls = schedule(plans, bounds, p.cp, hidden_size, probe, gen)
        case = RankContinuation(path, p, {n: t.detach() for n, t in reference.named_parameters()}, x, dy, h0, dht,
                                calls, dtype)
        results = spawn(run_continuation_on_rank, p.size, case)
        report = check_placement(f"{label}{p.name}/seed{seed}", p, plans, bounds, calls, results, expected, path,
                                 rtol, _unshard)
        (reports if report else passed).append((p.name, report))
    if reports:
        raise AssertionError(
            f"continuation parity failed at {len(reports)} of {len(placements)} placement(s): "
            f"{', '.join(n for n, _ in reports)}" + (f" (passed: {', '.join(n for n, _ in passed)})" if passed else "")
            + "\n\n" + "\n\n".join(r for _, r in reports))


def _default_reference_forward(reference, x, cu_seqlens, state):
    return reference(x, cu_seqlens, state, output_final_state=True)


def _rebuild(like, fields):
    return type(like)(*fields) if hasattr(like, "_fields") else type(like)(fields)


def _like(state, make):
    """A state of `state`'s type with every field made by `make(field)`."""
    return _rebuild(state, [make(t) for t in state])


def _reference_run(forward, reference, x, dy, cu, h0, dht, differentiable):
    dtype = next(reference.parameters()).dtype
    # detach first: for a float64 reference .to() returns the caller's tensor itself, whose
    # requires_grad would then reach the ranks (their non-float64 copies would not be leaves)
    x = x.detach().to(dtype).requires_grad_(differentiable)
    h0 = _like(h0, lambda t: t.detach().to(dtype).requires_grad_(differentiable))
    with torch.enable_grad():
        y, ht = forward(reference, x, cu, h0)
        if differentiable:
            loss = (y * dy.to(dtype)).sum() + sum((a * b.to(dtype)).sum() for a, b in zip(ht, dht))
            loss.backward()

    def grad(leaf):  # a leaf the forward never reads has a zero gradient (the ranks fill it so too)
        return (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).double()

    return dict(y=y.detach().double(), ht=[t.detach().double() for t in ht],
                dx=grad(x) if differentiable else None, dh0=[grad(t) for t in h0] if differentiable else None,
                unread={i for i, t in enumerate(h0) if differentiable and t.grad is None})


def _warn_where_the_state_is_invisible(forward, reference, x, cu, h0, expected, rtol, label) -> None:
    """StateInvisibleWarning for every initial-state field whose flip (negated) moves the outputs
    by less than VISIBLE_RTOLS * rtol of their norm: a call that restarts that field from zero,
    or reads another sequence's, would pass too. A field the full forward never reads (no
    gradient at all: written by every call, as a last-token cache) carries nothing to restart."""
    dtype = next(reference.parameters()).dtype
    y = expected["y"]
    norm = float(torch.linalg.vector_norm(y)) or 1.0
    names = field_names(h0)
    base = [t.detach().to(dtype) for t in h0]
    for i, name in enumerate(names):
        if i in expected["unread"]:
            continue
        flipped = _rebuild(h0, [-t if j == i else t for j, t in enumerate(base)])
        with torch.no_grad():
            y_flipped, _ = forward(reference, x.to(dtype), cu, flipped)
        moved = float(torch.linalg.vector_norm(y_flipped.double() - y)) / norm
        if not moved >= VISIBLE_RTOLS * rtol:
            warnings.warn(StateInvisibleWarning(
                f"continuation check {label}: the outputs barely see the initial state's field '{name}': negating it "
                f"moves them by {moved:.1e} of their norm (rtol {rtol:.0e}), so a call that restarts '{name}' from "
                "zero, or reads another sequence's, would pass the check as well. The state decays (or is "
                "overwritten) before it reaches an output: slow the layer's decay in this case (its gate weights, "
                "A_log, dt_bias), or give it inputs that read the state."), stacklevel=3)


def _unshard(path, p, states):
    if p.tp == 1:
        return [t.double() for t in states[0]]
    return [t.double() for t in path.unshard_state(list(states), p)]
