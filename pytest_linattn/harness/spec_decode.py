"""The speculative-decoding mode of the state-pool check: verify calls that run K draft tokens of
every sequence in one call and accept j <= K of them, as a serving engine's MTP or draft-model
verify step does.

Every sequence holds a slot of a pool (sequence n in slot N - n; slot 0 stays free) that starts
filled with random values, never zeros (slot 0 and the CP scratch slots, held by no sequence,
with large ones: `serving_plans.free_fill`). The pool's fields are in the ranks' dtype, or per
field in the path's `state_dtypes` (a float32 recurrent pool under bf16 ranks), and what the
check keeps of them between calls keeps those dtypes.

The calls run in order: prefill call k packs the k-th chunk of every sequence that has one (its
first chunk marked fresh: it starts from zero, whatever its slot holds), then verify round r runs
K tokens of every sequence that has a round r: the sequence's next j tokens (accepted), then
K - j random drafts (rejected). A plan's `drafts` gives a sequence its own number of drafts per
round (a mixed call: rows that drafted nothing run beside rows that did, as an engine batches
them; each row's live state wherever the client keeps it). The client's verify
computes all K tokens from the slot's state; its accept then gets `num_accepted_tokens` `[N]` and
must leave each slot holding the state after the sequence's j-th accepted token (j = 0: the state
before the call), as vLLM's and fla's `num_accepted_tokens` interface does.

Two options of the path serve a vLLM-like client, whose kernel keeps the rollback itself.
`bonus_token`: every verify call starts with the sequence's next token, always accepted (the token
the previous step sampled), so a call runs 1 + K tokens and accept gets 1 + j: fla's and vLLM's
kernels read column `num_accepted_tokens - 1`, never before the row. `slots_per_sequence` S > 1:
each sequence holds a row of S slots (column c of sequence n in slot 1 + c*N + N-1-n), the kernel
writes every token's state to a slot of the row, and the path's `read_state` says where each
sequence's state is after a call (vLLM: column num_accepted_tokens - 1); nothing is copied back.

The reference is the float64 serial run of the replicated layer: every sequence token by token
from zero states, its output and state after every token. After every call, every token's output
(a draft's: the reference's from the serial state before it) and every scheduled slot's state
must match it within rtol (relative error per sequence and field); every slot the call did not
schedule must be bitwise unchanged. A rejected draft leaves no trace: the slot after the call and
every later output show it if it does. A failure names the call, the slot, the sequence and the
token. No gradients (serving).

Under CP (contiguous layout, no sequence parallel) the pool is replicated over the CP ranks and a
prefill call's tokens are split in contiguous pieces over them, as in the state-pool mode (a
filler sequence, fresh, in a scratch slot after the others where they do not divide by cp); a
verify call and its accept run whole on every rank (the layer's decode step). Every rank's slots
are checked; a prefill token's output on the CP rank that held it, a verify call's on every CP
rank. Blocks at every `block_size` committed tokens (prefix caching): `spec_blocks`. A drafter with
a recurrent state of its own, proposing and rolling back beside the target (`drafter`):
`spec_drafter`. The judge and its words: `spec_decode_report`. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .cases import ShardedLayer, require_module_level
from .continuation_report import field_names
from .placement import Placement
from .spec_blocks import check_block_plans, check_spec_snapshots, with_block_snapshots
from .spec_decode_rank import RankSpec, SpecCall, run_spec_on_rank
from .spec_decode_report import check_spec_calls, describe_call
from .spec_drafter import WHO, SpecDrafter, drafter_calls, drafter_path
from .serving_plans import (check_pool_placements, check_state_dtype_names, check_state_dtypes, free_fill,
                            with_cp_fillers)

__all__ = ["SpecDecodePath", "SpecDrafter", "SpecPlan", "assert_spec_decode_parity", "serial_run", "spec_schedule"]


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """One sequence: prefill chunk lengths in order, then one verify round per entry of
    `accepted`, each accepting that many of its drafts. `drafts`: the drafts of each round (default
    None: K, the check's num_draft, every round); a round of 0 drafts (the draft model proposed
    nothing: the row runs its bonus token only, with `bonus_token`) in a call whose other rows
    have drafts is a mixed verify call."""

    chunks: tuple[int, ...]
    accepted: tuple[int, ...]
    drafts: tuple[int, ...] | None = None

    def __post_init__(self):
        if not self.chunks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.chunks):
            raise ValueError(f"SpecPlan.chunks must be positive ints (at least one chunk), got {self.chunks!r}")
        if any(isinstance(j, bool) or not isinstance(j, int) or j < 0 for j in self.accepted):
            raise ValueError(f"SpecPlan.accepted must be ints >= 0 (drafts accepted per verify round), "
                             f"got {self.accepted!r}")
        if self.drafts is not None:
            drafts = tuple(self.drafts)
            if (len(drafts) != len(self.accepted)
                    or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in drafts)):
                raise ValueError(f"SpecPlan.drafts must be ints >= 0, one per verify round ({len(self.accepted)}), "
                                 f"got {self.drafts!r}")
            if any(j > d for j, d in zip(self.accepted, drafts)):
                raise ValueError(f"SpecPlan.accepted must not exceed the round's drafts: accepted "
                                 f"{list(self.accepted)}, drafts {list(drafts)}")
            object.__setattr__(self, "drafts", drafts)

    def drafts_of(self, round_: int, num_draft: int) -> int:
        """The drafts of verify round `round_` (0-based)."""
        return num_draft if self.drafts is None else self.drafts[round_]

    @property
    def length(self) -> int:
        return sum(self.chunks) + sum(self.accepted)

    def __str__(self) -> str:
        drafts = "" if self.drafts is None else f" of drafts {list(self.drafts)}"
        return f"chunks {'+'.join(map(str, self.chunks))}, then verify rounds accepting {list(self.accepted)}{drafts}"


@dataclasses.dataclass(frozen=True)
class SpecDecodePath:
    """How a client's layer runs prefill and verify against a state pool, for
    `assert_spec_decode_parity`. Callables module-level (spawn pickles them by reference). A pool
    is a tuple of tensors (the state's fields), each `[P, ...]`, in the TP rank's layout.

    prefill(module, x, cu_seqlens, pool, slots, fresh, placement) -> y: as StatePoolPath's (under
        CP: this CP rank's piece of the call's tokens, the rest whole).
    verify(module, x, cu_seqlens, pool, slots, placement) -> y
        K tokens (1 + K with bonus_token) of each of N sequences, packed `[1, N*K, hidden]`
        (cu_seqlens every K; a plan's `drafts` makes them differ per row: a mixed call, rows of 0
        drafts running the bonus token alone), each from its slot's state; returns every token's output. It may
        keep what accept needs (per-token states, on the module or in spare slots) but must
        change no slot other than `slots`.
    accept(module, pool, slots, num_accepted_tokens, placement) -> None
        num_accepted_tokens `[N]` int64 in 0..K (1..K+1 with bonus_token): leave each slot holding
        the state after its sequence's first num_accepted_tokens tokens of the last verify call.
    shard_state(state, placement, tp_rank), unshard_state(states, placement): as StatePath's.
    bonus_token: each verify call runs the sequence's next token, always accepted, then K drafts.
    slots_per_sequence: S; with S > 1 `slots` is `[N, S]` (each sequence's row of slots) in every
        call, and read_state(module, pool, slots, placement) -> the sequences' states (the
        pool's type, fields `[N, ...]`): where each one continues from after the call.
    state_dtypes: {field name: torch.dtype}, the pool's dtype of those fields (e.g. {"recurrent":
        torch.float32} under bf16 ranks); the others in the ranks' dtype. Default None: all.
    drafter: a `SpecDrafter` (`spec_drafter`): a draft model with its own recurrent state, run on the
        same calls in a pool of its own, proposing and rolling back; checked against the serial run
        of the check's `drafter_reference`. Default None: the target alone.
    """

    layer: ShardedLayer
    prefill: Callable
    verify: Callable
    accept: Callable
    shard_state: Callable | None = None
    unshard_state: Callable | None = None
    bonus_token: bool = False
    slots_per_sequence: int = 1
    read_state: Callable | None = None
    state_dtypes: dict | None = dataclasses.field(default=None, hash=False)  # a dict: left out of the hash
    drafter: SpecDrafter | None = None

    def __post_init__(self):
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"SpecDecodePath.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        if not isinstance(self.bonus_token, bool):
            raise ValueError(f"SpecDecodePath.bonus_token must be a bool, got {self.bonus_token!r}")
        positive_int(self.slots_per_sequence, "SpecDecodePath.slots_per_sequence")
        if self.slots_per_sequence > 1 and not callable(self.read_state):
            raise ValueError(f"SpecDecodePath.read_state must be callable with slots_per_sequence > 1 (where each "
                             f"sequence's state is in its row of slots), got {self.read_state!r}")
        for field in ("prefill", "verify", "accept"):
            if not callable(getattr(self, field)):
                raise ValueError(f"SpecDecodePath.{field} must be callable, got {getattr(self, field)!r}")
        if (self.shard_state is None) != (self.unshard_state is None):
            raise ValueError("SpecDecodePath.shard_state and unshard_state are given together "
                             "(or neither: tp = 1 only)")
        object.__setattr__(self, "state_dtypes", check_state_dtypes(self.state_dtypes, "SpecDecodePath"))
        if self.drafter is not None and not isinstance(self.drafter, SpecDrafter):
            raise ValueError(f"SpecDecodePath.drafter must be a SpecDrafter or None, got {type(self.drafter).__name__}")
        require_module_level(self)


def assert_spec_decode_parity(spawn, path: SpecDecodePath, reference: torch.nn.Module,
                              placements: Sequence[Placement], plans: Sequence[SpecPlan], *, num_draft: int,
                              hidden_size: int, seed: int, rtol: float, dtype: torch.dtype = torch.float64,
                              reference_forward: Callable | None = None, block_size: int | None = None,
                              drafter_reference: torch.nn.Module | None = None,
                              drafter_forward: Callable | None = None, name: str = "") -> None:
    """The client's verify-and-accept path at every placement (TP, CP, TP x CP) against the float64 serial run
    of `reference` (the module docstring). num_draft: K, the drafts of every verify call.
    reference_forward(reference, x, cu_seqlens, state) -> (y, final_state), as the continuation
    check's (state None: zeros). block_size: blocks at every B committed tokens (`spec_blocks`).
    drafter_reference, drafter_forward: the drafter's replicated layer and how to call it (as
    reference's), with the path's `drafter` (`spec_drafter`) and only then.
    AssertionError naming the call, slot, sequence and token (and field: the drafter's lines say so)."""
    __tracebackhide__ = True
    if not isinstance(path, SpecDecodePath):
        raise ValueError(f"path must be a SpecDecodePath, got {type(path).__name__}")
    positive_int(num_draft, "num_draft")
    positive_int(hidden_size, "hidden_size")
    rtol = check_rtol(rtol)
    plans = list(plans)
    if not plans or not all(isinstance(pl, SpecPlan) for pl in plans):
        raise ValueError(f"plans must be a non-empty sequence of SpecPlan, got {plans!r}")
    for n, pl in enumerate(plans):
        if any(j > num_draft for j in pl.accepted):
            raise ValueError(f"plans[{n}].accepted must lie in 0..num_draft ({num_draft}), got {list(pl.accepted)}")
        if pl.drafts is not None and any(d > num_draft for d in pl.drafts):
            raise ValueError(f"plans[{n}].drafts must lie in 0..num_draft ({num_draft}), got {list(pl.drafts)}")
        if pl.drafts is not None and 0 in pl.drafts and not path.bonus_token:
            raise ValueError(f"plans[{n}].drafts has a round of 0 drafts, which runs no token without the path's "
                             f"bonus_token (a row of 0 drafts runs its bonus token alone)")
    if (path.drafter is None) != (drafter_reference is None):
        raise ValueError("drafter_reference (the drafter's float64 replicated layer) is given with the path's "
                         f"drafter, and only then: path.drafter is {'None' if path.drafter is None else 'set'}, "
                         f"drafter_reference is {'None' if drafter_reference is None else 'set'}")
    if drafter_forward is not None and path.drafter is None:
        raise ValueError("drafter_forward is for the path's drafter; the path has none")
    placements = check_pool_placements(placements, path, "the spec-decode mode")
    if block_size is not None:
        check_block_plans(plans, num_draft, path.bonus_token, block_size)

    gen = torch.Generator().manual_seed(seed)
    lengths = [pl.length + (len(pl.accepted) if path.bonus_token else 0) for pl in plans]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    x = torch.randn(1, bounds[-1], hidden_size, generator=gen, dtype=torch.float64)
    forward = reference_forward or _forward
    serial_y, serial_states = serial_run(forward, reference, x, bounds)
    check_state_dtype_names(path, field_names(serial_states))
    N = len(plans)
    S = path.slots_per_sequence
    # under CP, slots after the others for the fillers (a row of S like a sequence's)
    scratch = (N * S + 1 if S == 1 else tuple(range(N * S + 1, N * S + 1 + S))) \
        if any(p.cp > 1 for p in placements) else None
    size = N * S + 1 + (S if scratch is not None else 0)
    calls = spec_schedule(plans, bounds, x, num_draft, gen, bonus_token=path.bonus_token,
                          slots_per_sequence=path.slots_per_sequence)
    calls, snapshots = with_block_snapshots(calls, block_size, size) if block_size else (calls, {})
    fields = [torch.randn((size + len(snapshots),) + tuple(t.shape[2:]), generator=gen, dtype=torch.float64)
              for t in serial_states]
    unheld = [0] + list(range(N * S + 1, size))  # slot 0 (free) and the CP scratch slots; blocks random until written
    for f in fields:
        f[unheld] = free_fill(f[unheld])
    probe = serial_states
    pool = type(probe)(*fields) if hasattr(probe, "_fields") else type(probe)(fields)
    K = (num_draft, int(path.bonus_token))  # how a call's rows are described
    expected = [_expected(forward, reference, call, bounds, serial_y, serial_states, probe) for call in calls]
    drafter = None
    if path.drafter is not None:  # its own serial run and pool: the target's slots less blocks, random likewise
        d_forward = drafter_forward or _forward
        try:
            d_y, d_states = serial_run(d_forward, drafter_reference, x, bounds)
        except (RuntimeError, ValueError) as exc:  # a shape error: the drafter reads the target's inputs
            raise ValueError(f"drafter_reference must take the target's inputs ([1, T, hidden_size] with hidden_size "
                             f"{hidden_size}); its serial run failed: {exc}") from None
        d_fields = [torch.randn((size,) + tuple(t.shape[2:]), generator=gen, dtype=torch.float64) for t in d_states]
        for f in d_fields:
            f[unheld] = free_fill(f[unheld])
        drafter = dict(path=drafter_path(path), pool=_rebuild(d_states, d_fields), names=field_names(d_states),
                       weights={k: t.detach() for k, t in drafter_reference.named_parameters()},
                       expected=[_expected(d_forward, drafter_reference, call, bounds, d_y, d_states, d_states)
                                 for call in calls])
    label = f"{name}/" if name else ""
    reports = []
    for p in placements:
        placed = with_cp_fillers(calls, p.cp, hidden_size, gen, scratch) if p.cp > 1 else calls
        d_case = None if drafter is None else RankSpec(drafter["path"], p, drafter["weights"], drafter["pool"],
                                                       drafter_calls(placed), dtype, drafter["names"])
        case = RankSpec(path, p, {k: t.detach() for k, t in reference.named_parameters()}, pool, placed, dtype,
                        field_names(probe), d_case)
        results = spawn(run_spec_on_rank, p.size, case)
        blocks = (check_spec_snapshots(p, path, plans, placed, snapshots, results, serial_states, pool, rtol,
                                       lambda i, c: describe_call(i, c, K), field_names(probe)) + (set(snapshots),)
                  if snapshots else ([], [], ()))
        reports.append(check_spec_calls(f"{label}{p.name}/seed{seed}", p, path, plans, placed, expected, results,
                                        rtol, K, field_names(probe), blocks))
        if drafter is not None:
            reports.append(check_spec_calls(f"{label}{p.name}/seed{seed}, the drafter (its own state pool)", p,
                                            drafter["path"], plans, d_case.calls, drafter["expected"],
                                            [r["drafter"] for r in results], rtol, K, drafter["names"], who=WHO))
    reports = [r for r in reports if r]
    if reports:
        raise AssertionError("\n\n".join(reports))


def _forward(ref, x, cu_seqlens, state):
    return ref(x, cu_seqlens, state, output_final_state=True)


def serial_run(forward, reference, x, bounds):
    """Every sequence token by token from zero states: outputs `[1, T, hidden]` (float64), and
    states per field `[N, L + 1, ...]` (index i: the state after the sequence's first i tokens)."""
    dtype = next(reference.parameters()).dtype
    N, L = len(bounds) - 1, max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    y = torch.zeros(tuple(x.shape), dtype=torch.float64)
    states, rows = None, None
    with torch.no_grad():
        for i in range(L):
            active = [n for n in range(N) if bounds[n] + i < bounds[n + 1]]
            cu = torch.arange(len(active) + 1, dtype=torch.int32)
            tokens = torch.tensor([bounds[n] + i for n in active])
            state = None if rows is None else _rebuild(rows, [f[active, i].to(dtype) for f in states])
            y_i, new = forward(reference, x[:, tokens].to(dtype), cu, state)
            if states is None:  # the state's fields and shapes, learnt from the first call
                rows = new
                states = [torch.zeros((N, L + 1) + tuple(t.shape[1:]), dtype=torch.float64) for t in new]
            y[:, tokens] = y_i.double()
            for f, t in zip(states, new):
                f[active, i + 1] = t.double()
            for f in states:  # a finished sequence keeps its final state
                for n in range(N):
                    if bounds[n] + i >= bounds[n + 1]:
                        f[n, i + 1] = f[n, i]
    return y, _rebuild(rows, states)


def spec_schedule(plans, bounds, x, num_draft, gen, *, bonus_token=False, slots_per_sequence=1) -> list[SpecCall]:
    """The calls in order (module docstring): the prefill calls, then the verify rounds. With
    slots_per_sequence S > 1 a call's slots are rows of S slots; with bonus_token a verify call's
    `accepted` counts the bonus token (1 + j)."""
    N, K, b, S = len(plans), num_draft, int(bonus_token), slots_per_sequence
    slot = {n: N - n if S == 1 else tuple(1 + c * N + N - 1 - n for c in range(S)) for n in range(N)}
    consumed, calls = [0] * N, []
    for k in range(max(len(pl.chunks) for pl in plans)):
        seqs = [n for n in range(N) if k < len(plans[n].chunks)]
        sizes = [plans[n].chunks[k] for n in seqs]
        parts = [x[:, bounds[n] + consumed[n]:bounds[n] + consumed[n] + s] for n, s in zip(seqs, sizes)]
        calls.append(SpecCall("prefill", k, tuple(seqs), tuple(slot[n] for n in seqs), torch.cat(parts, dim=1),
                              _cu(sizes), tuple(k == 0 for _ in seqs), None, tuple(consumed[n] for n in seqs)))
        for n, s in zip(seqs, sizes):
            consumed[n] += s
    for r in range(max((len(pl.accepted) for pl in plans), default=0)):
        seqs = [n for n in range(N) if r < len(plans[n].accepted)]
        parts, sizes = [], []
        for n in seqs:
            j, d = plans[n].accepted[r], plans[n].drafts_of(r, K)
            start = bounds[n] + consumed[n]
            parts += [x[:, start:start + b + j], torch.randn(1, d - j, x.shape[2], generator=gen, dtype=torch.float64)]
            sizes.append(b + d)
        calls.append(SpecCall("verify", r, tuple(seqs), tuple(slot[n] for n in seqs), torch.cat(parts, dim=1),
                              _cu(sizes), None, tuple(b + plans[n].accepted[r] for n in seqs),
                              tuple(consumed[n] for n in seqs)))
        for n in seqs:
            consumed[n] += b + plans[n].accepted[r]
    return calls


def _cu(sizes):
    return torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)


def _expected(forward, reference, call, bounds, serial_y, serial_states, probe):
    """A call's expected outputs (its sequences' tokens from the serial run; a draft's from the
    serial state before the call, through the reference) and states after it (per field `[N, ...]`)."""
    dtype = next(reference.parameters()).dtype
    rows = torch.tensor(call.sequences)
    starts = torch.tensor(call.starts)
    before = _rebuild(probe, [f[rows, starts].to(dtype) for f in serial_states])
    with torch.no_grad():
        y, _ = forward(reference, call.x.to(dtype), call.cu_seqlens, before)
    y = y.double().clone()
    cu = call.cu_seqlens.tolist()
    kept = []
    for i, (n, start) in enumerate(zip(call.sequences, call.starts)):
        j = cu[i + 1] - cu[i] if call.kind == "prefill" else call.accepted[i]
        y[:, cu[i]:cu[i] + j] = serial_y[:, bounds[n] + start:bounds[n] + start + j]
        kept.append(start + j)
    states = [f[rows, torch.tensor(kept)] for f in serial_states]
    return dict(y=y, states=states)


def _rebuild(like, fields):
    return type(like)(*fields) if hasattr(like, "_fields") else type(like)(fields)
