"""Where the continuation check cuts its sequences (`SequencePlan`, `plan_cuts`) and the calls
that run them in order (`schedule`); how a report names the call that ran a token. This module
imports no pytest."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch

from linattn.checks import positive_int

from .continuation_rank import Call

__all__ = ["SequencePlan", "cp_filler", "describe_token", "plan_cuts", "schedule", "token_calls"]


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


def schedule(plans, bounds, cp, hidden_size, probe, gen) -> list[Call]:
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
        filler = cp_filler(sum(lengths), cp, hidden_size, gen, probe)
        if filler is not None:
            lengths.append(filler[0].shape[1])
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        calls.append(Call("prefill", k, tuple(sequences), torch.cat(tokens), cu, filler))
    for j in range(max(pl.decode for pl in plans)):
        sequences = tuple(n for n, pl in enumerate(plans) if j < pl.decode)
        tokens = torch.tensor([bounds[n + 1] - plans[n].decode + j for n in sequences])
        calls.append(Call("decode", j, sequences, tokens, None, None))
    return calls


def cp_filler(num_tokens, cp, hidden_size, gen, probe=None):
    """The filler sequence that pads a prefill call of `num_tokens` tokens to a multiple of cp
    (every CP rank holds num_tokens / cp of them, `continuation_rank.cp_share`): its input `[1,
    pad, hidden]` and, given `probe` (a state, one row per sequence), its initial state `[1, ...]`
    per field (None without one); both random (from `gen`), its results unchecked. None when
    num_tokens divides by cp already. The continuation check, the state-pool mode, speculative
    decoding and padded batches pad their prefill calls with it."""
    pad = -num_tokens % cp
    if not pad:
        return None
    x = torch.randn(1, pad, hidden_size, generator=gen, dtype=torch.float64)
    state = None if probe is None else [torch.randn((1,) + tuple(t.shape[1:]), generator=gen, dtype=torch.float64)
                                        for t in probe]
    return x, state


def token_calls(calls, T) -> list:
    """For every token of the batch, the position in `calls` of the call that ran it."""
    where = [None] * T
    for i, call in enumerate(calls):
        for t in call.tokens.tolist():
            where[t] = i
    return where


def describe_token(call, position, pl) -> str:
    """Where token `position` of a sequence cut by plan `pl` ran: its chunk or decode step."""
    if call.kind == "decode":
        return f"decode step {call.index + 1} of {pl.decode} (token {position})"
    start = sum(pl.chunks[:call.index])
    size = pl.chunks[call.index]
    origin = "from the initial state" if start == 0 else f"from the state after token {start - 1}"
    return (f"chunk {call.index + 1} of {len(pl.chunks)} (tokens {start}..{start + size - 1}, a {size}-token chunk "
            f"{origin}), token {position}")
