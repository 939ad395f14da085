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

At TP each rank holds its heads' state (the client's `shard_state`); at CP each prefill call is
split contiguously over the CP ranks (a continued prefill: each sequence starts from its state on
whichever rank it starts; a call whose token count does not divide by cp gets a filler sequence,
unchecked), the states come back whole on every rank, and the decode steps run on every rank.
The backward runs call by call; a prefill call's state gradients, each CP rank's share, are
summed over the CP ranks before they reach the previous call (whose final states take a whole
gradient on every rank); a decode step is whole on every rank, and checked on each.

A failure names the sequence, its cuts, the call, and the first token (in the sequence's order)
that is off: the first wrong token says where the state went wrong. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import assert_parity, check_rtol
from .cases import StatePath
from .continuation_rank import Call, RankContinuation, run_continuation_on_rank
from .placement import Placement, as_cu_seqlens

__all__ = ["SequencePlan", "assert_continuation_parity", "plan_cuts"]


@dataclasses.dataclass(frozen=True)
class SequencePlan:
    """How one sequence is cut: prefill chunk lengths in order, then `decode` tokens one at a time."""

    chunks: tuple[int, ...]
    decode: int

    def __post_init__(self):
        if not self.chunks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.chunks):
            raise ValueError(f"SequencePlan.chunks must be positive ints (at least one chunk), got {self.chunks!r}")
        if isinstance(self.decode, bool) or not isinstance(self.decode, int) or self.decode < 0:
            raise ValueError(f"SequencePlan.decode must be an int >= 0, got {self.decode!r}")

    @property
    def length(self) -> int:
        return sum(self.chunks) + self.decode

    def __str__(self) -> str:
        cuts = "+".join(str(c) for c in self.chunks)
        return f"chunks {cuts}" + (f", then {self.decode} decode steps" if self.decode else "")


def plan_cuts(lengths: Sequence[int], *, conv_width: int, chunk_size: int = 64, decode: int = 2,
              seed: int = 0) -> list[SequencePlan]:
    """A plan for every sequence, rotating through the cuts where carried states break: a 1-token
    first chunk then W-1 tokens then chunk_size+1 (vLLM #51483: a 1-token first chunk taken for a
    decode); W, chunk_size-1, then a 1-token chunk mid-sequence; chunk_size then a random cut;
    W-1 then two random cuts. A plan is cut short where its sequence ends; every sequence keeps
    `decode` tokens for the decode steps (fewer when it is too short: at least one chunk stays)."""
    positive_int(conv_width, "conv_width")
    positive_int(chunk_size, "chunk_size")
    W, C, rng = conv_width, chunk_size, random.Random(seed)
    recipes = [
        lambda: [1, max(W - 1, 1), C + 1],
        lambda: [W, C - 1 or 1, 1],
        lambda: [C, rng.randint(1, C)],
        lambda: [max(W - 1, 1), rng.randint(1, C), rng.randint(1, 2 * C)],
    ]
    plans = []
    for n, length in enumerate(lengths):
        positive_int(length, f"lengths[{n}]")
        decoded = min(decode, length - 1)
        room, chunks = length - decoded, []
        for size in recipes[n % len(recipes)]():
            if room <= 0:
                break
            chunks.append(min(size, room))
            room -= chunks[-1]
        if room:
            chunks.append(room)
        plans.append(SequencePlan(tuple(chunks), decoded))
    return plans


def assert_continuation_parity(spawn, path: StatePath, reference: torch.nn.Module, placements: Sequence[Placement],
                               cu_seqlens, *, hidden_size: int, seed: int, rtol: float, conv_width: int,
                               chunk_size: int = 64, decode: int = 2, plans: Sequence[SequencePlan] | None = None,
                               dtype: torch.dtype = torch.float64, reference_forward: Callable | None = None,
                               name: str = "") -> None:
    """The client's layer (`path`) at every placement, its sequences cut into chunks and decode
    steps (`plans`, default `plan_cuts(...)`), against one full forward of `reference` (the
    replicated layer, float64) from the same random initial states: every token's output, the
    final states, and for a differentiable path the gradients of the inputs and initial states,
    within `rtol` (relative Frobenius error per tensor). AssertionError naming the sequence, its
    cuts, the call and the first token that is off.

    reference_forward(reference, x, cu_seqlens, state) -> (y, final_state): one full forward from
    `state` (None: zeros); default `reference(x, cu_seqlens, state, output_final_state=True)`.
    x, dy, the initial states and dht are drawn from N(0, 1) seeded by `seed` (in the names).
    Placements: tp and cp, contiguous CP layout, no sequence parallel.
    """
    __tracebackhide__ = True
    if not isinstance(path, StatePath):
        raise ValueError(f"path must be a StatePath, got {type(path).__name__}")
    cu = as_cu_seqlens(cu_seqlens)
    bounds = [int(b) for b in cu.tolist()]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    positive_int(hidden_size, "hidden_size")
    rtol = check_rtol(rtol)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if min(lengths) < 1:
        raise ValueError(f"cu_seqlens must hold no empty sequence, got {bounds}")
    placements = list(placements)
    if not placements or not all(isinstance(p, Placement) for p in placements):
        raise ValueError("placements must be a non-empty sequence of Placement")
    for p in placements:
        if p.cp_layout != "contiguous" or p.sequence_parallel:
            raise ValueError(f"placement {p.name}: the continuation check runs contiguous CP without sequence parallel")
        if p.tp > 1 and path.shard_state is None:
            raise ValueError(f"placement {p.name}: tp > 1 needs StatePath.shard_state and unshard_state")
    decode = 0 if path.no_decode else decode
    plans = list(plans) if plans is not None else plan_cuts(lengths, conv_width=conv_width, chunk_size=chunk_size,
                                                            decode=decode, seed=seed)
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
        _, probe = forward(reference, x.to(ref_dtype), cu, None)
    h0 = _like(probe, lambda t: torch.randn(t.shape, generator=gen, dtype=torch.float64))
    dht = _like(probe, lambda t: torch.randn(t.shape, generator=gen, dtype=torch.float64))
    expected = _reference_run(forward, reference, x, dy, cu, h0, dht, path.differentiable)

    label = f"{name}/" if name else ""
    for p in placements:
        calls = _schedule(plans, bounds, p.cp, hidden_size, probe, gen)
        case = RankContinuation(path, p, {n: t.detach() for n, t in reference.named_parameters()}, x, dy, h0, dht,
                                calls, dtype)
        results = spawn(run_continuation_on_rank, p.size, case)
        _check(f"{label}{p.name}/seed{seed}", p, plans, bounds, calls, results, expected, path, rtol)


def _default_reference_forward(reference, x, cu_seqlens, state):
    return reference(x, cu_seqlens, state, output_final_state=True)


def _like(state, make):
    """A state of `state`'s type with every field made by `make(field)`."""
    fields = [make(t) for t in state]
    return type(state)(*fields) if hasattr(state, "_fields") else type(state)(fields)


def _field_names(state) -> list[str]:
    return list(state._fields) if hasattr(state, "_fields") else [f"state[{i}]" for i in range(len(state))]


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
    return dict(y=y.detach().double(), ht=[t.detach().double() for t in ht],
                dx=x.grad.double() if differentiable else None,
                dh0=[t.grad.double() for t in h0] if differentiable else None)


def _schedule(plans, bounds, cp, hidden_size, probe, gen) -> list[Call]:
    """The calls in order: prefill call k over every sequence's k-th chunk, then decode step j over
    every sequence's j-th decoded token; under CP a filler sequence pads a prefill call to a
    multiple of cp tokens (its input and initial state random, its results unchecked)."""
    calls = []
    for k in range(max(len(pl.chunks) for pl in plans)):
        sequences, tokens, lengths = [], [], []
        for n, pl in enumerate(plans):
            if k < len(pl.chunks):
                start = bounds[n] + sum(pl.chunks[:k])
                sequences.append(n)
                tokens.append(torch.arange(start, start + pl.chunks[k]))
                lengths.append(pl.chunks[k])
        pad = -sum(lengths) % cp
        filler = None
        if pad:
            filler = (torch.randn(1, pad, hidden_size, generator=gen, dtype=torch.float64),
                      [torch.randn((1,) + tuple(t.shape[1:]), generator=gen, dtype=torch.float64) for t in probe])
            lengths.append(pad)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        calls.append(Call("prefill", k, tuple(sequences), torch.cat(tokens), cu, filler))
    for j in range(max(pl.decode for pl in plans)):
        sequences = tuple(n for n, pl in enumerate(plans) if j < pl.decode)
        tokens = torch.tensor([bounds[n + 1] - plans[n].decode + j for n in sequences])
        calls.append(Call("decode", j, sequences, tokens, None, None))
    return calls


def _token_calls(calls, T) -> list:
    """For every token of the batch, the call that ran it."""
    where = [None] * T
    for call in calls:
        for t in call.tokens.tolist():
            where[t] = call
    return where


def _describe_token(call, position, pl) -> str:
    """Where token `position` of a sequence cut by plan `pl` ran: its chunk or decode step."""
    if call.kind == "decode":
        return f"decode step {call.index + 1} of {pl.decode} (token {position})"
    start = sum(pl.chunks[:call.index])
    size = pl.chunks[call.index]
    origin = "from the initial state" if start == 0 else f"from the state after token {start - 1}"
    return (f"chunk {call.index + 1} of {len(pl.chunks)} (tokens {start}..{start + size - 1}, a {size}-token chunk "
            f"{origin}), token {position}")


def _first_wrong_token(actual, expected, bounds, plans, calls, rtol) -> str:
    """The first token, in sequence order (earliest position; the lowest sequence on a tie), whose
    error relative to the tokens' RMS norm exceeds rtol; NaN counts as wrong."""
    scale = float(torch.linalg.vector_norm(expected)) / math.sqrt(max(expected.shape[1], 1)) or 1.0
    per_token = torch.linalg.vector_norm((actual - expected)[0].flatten(1), dim=1) / scale
    bad = ~(per_token <= rtol)
    if not bool(bad.any()):
        return ""
    where = _token_calls(calls, expected.shape[1])
    firsts = []
    for n in range(len(bounds) - 1):
        hits = torch.nonzero(bad[bounds[n]:bounds[n + 1]]).flatten()
        if hits.numel():
            firsts.append((int(hits[0]), n))
    position, n = min(firsts)
    t = bounds[n] + position
    wrong = sorted(n2 for _, n2 in firsts)
    return (f"first wrong token: sequence {n} ({plans[n]}), {_describe_token(where[t], position, plans[n])}, "
            f"error {float(per_token[t]):.1e} of the tokens' RMS norm; sequences with a wrong token: {wrong}")


def _check(label, p, plans, bounds, calls, results, expected, path, rtol) -> None:
    __tracebackhide__ = True
    tp, cp = p.tp, p.cp
    cu = torch.tensor(bounds, dtype=torch.int32)
    failures = []

    def collect(check, *args, **kwargs):
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            failures.append(str(exc))

    def tokens(what, ref, t, c):
        """The batch's tokens as rank (t, c) sees them: prefill tokens from the CP rank holding
        them, decoded ones from CP rank c (every CP rank decodes the whole batch)."""
        full = torch.full(tuple(ref.shape), math.nan, dtype=torch.float64)
        for c2 in range(cp):
            r = results[t + tp * c2]
            mine = r["held"] & ~r["decoded"] if c2 != c else r["held"]
            full[:, mine] = r[what][:, mine].double()
        return full

    def check_tokens(what, ref, t, c):
        full = tokens(what, ref, t, c)
        where = "".join([f" tp_rank{t}" if tp > 1 else "", f" (decoded on cp_rank{c})" if cp > 1 else ""])
        try:
            assert_parity(full, ref, rtol=rtol, name=f"{label} {'output' if what == 'y' else what}{where}",
                          cu_seqlens=cu)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_first_wrong_token(full, ref, bounds, plans, calls, rtol)}") from None

    def describe(tensor_name, index):
        n = index[0]
        return f"sequence {n} ({plans[n]}), element {tuple(index[1:])}"

    names = _field_names(results[0]["ht"])
    for c in range(cp):
        for t in range(tp):
            collect(check_tokens, "y", expected["y"], t, c)
            if path.differentiable:
                collect(check_tokens, "dx", expected["dx"], t, c)
        states = _unshard(path, p, [results[t + tp * c]["ht"] for t in range(tp)])
        where = f" on cp_rank{c}" if cp > 1 else ""
        collect(assert_parity, dict(zip(names, states)), dict(zip(names, expected["ht"])), rtol=rtol,
                name=f"{label} final state{where}", describe=describe, activations=False)
    if path.differentiable:
        dh0 = _unshard(path, p, [results[t]["dh0"] for t in range(tp)])  # whole on every CP rank: CP rank 0's
        collect(assert_parity, dict(zip(names, dh0)), dict(zip(names, expected["dh0"])), rtol=rtol,
                name=f"{label} dh0 (gradient of the initial state)", describe=describe, activations=False)
    if failures:
        raise AssertionError(f"continuation parity failed for {label}: {len(failures)} failing check(s)\n"
                             + "".join(f"  sequence {n}: {pl}\n" for n, pl in enumerate(plans)) + "\n"
                             + "\n\n".join(failures))


def _unshard(path, p, states):
    if p.tp == 1:
        return [t.double() for t in states[0]]
    return [t.double() for t in path.unshard_state(list(states), p)]
