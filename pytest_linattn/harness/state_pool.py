"""The state-pool mode of the continuation check: states live in a pool of slots, as a serving
engine keeps them, and every call names each sequence's slot.

Sequences arrive in order and take the lowest free slot (at most `max_live` at once); each step
runs one prefill call (the next chunk of every live sequence that still has chunks; a sequence's
first chunk is marked fresh: the client starts it from zero, whatever its slot holds) and one
decode call (the next token of every live sequence in its decode phase). A decode call is padded
to the next captured batch size with padding rows, as a CUDA-graph replay pads it: the padding
rows point in turn at a sentinel (-1), at slot 0, and at a free slot, and carry random inputs.
A finished sequence frees its slot, which the next waiting sequence takes. The pool starts
filled with random values, never zeros: a slot read without a reset, or written by a call that
did not schedule it, shows.

After every call, each live slot the call did not schedule must be bitwise unchanged (on every
rank); every token's output and every sequence's final state (its slot when it finishes) must
match one float64 full forward of the replicated layer from zero states, within rtol. A failure
names the call, the slot, the sequence and the token. No gradients (serving).

Under CP (contiguous layout, no sequence parallel) the pool is replicated over the CP ranks (TP-
sharded as at TP) and a call runs as a serving engine runs it: a prefill call's tokens are split
in contiguous pieces over the CP ranks, as the continuation check splits them (a call whose
tokens do not divide by cp gets a filler sequence, fresh, in a scratch slot after the others,
unchecked: `continuation_plans.cp_filler`), each sequence read from its slot and its final state
written to the pool on every rank; a decode call runs whole on every rank (the layer's decode
step). Every rank's pool is checked: the unscheduled slots, the final states, the snapshots; a
prefill token's output on the CP rank that held it, a decoded one on every CP rank.

Prefix mode (`block_size`): as an engine with prefix caching, every prefill chunk that ends on a
multiple of `block_size` tokens of its sequence also writes the state there into a snapshot slot
of its own (a prefix block), kept for the rest of the run; a sequence of `prefix_hits` starts
from another's snapshot (its first tokens are that sequence's, restored, not recomputed) and
computes only the rest. The prefill gets `snapshot_slots` and `prefix_slots` per sequence. Each
snapshot must equal the float64 state at its boundary; a prefix hit's outputs and final state
must equal the serial run of its whole sequence; no call may change a prefix block after the call
that wrote it (the shared-block rule: the call that reads it included). This module imports no
pytest.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import pickle
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import assert_parity, check_rtol
from .cases import ShardedLayer
from .continuation_plans import SequencePlan
from .continuation_report import cp_view, field_names
from .placement import Placement, as_cu_seqlens
from .serving_plans import (CAPTURE_SIZES, check_pool_placements, check_prefix_hits, describe_call, describe_fillers,
                            pool_schedule, snapshots_of, with_cp_fillers)
from .state_pool_rank import RankPool, rebuild_state, run_pool_on_rank

__all__ = ["StatePoolPath", "assert_state_pool_parity"]


@dataclasses.dataclass(frozen=True)
class StatePoolPath:
    """How a client's layer runs against a state pool, for `assert_state_pool_parity`. Callables
    module-level (pickled by reference to the ranks). A pool is a tuple of tensors (the state's
    fields), each `[P, ...]`: one row per slot, in the TP rank's layout (`shard_state`).

    prefill(module, x, cu_seqlens, pool, slots, fresh, placement) -> y
        One chunk of each of N sequences, packed `[1, T, hidden]`; slots `[N]` int64 their slots;
        fresh `[N]` bool: the sequence starts here, from zero (its slot holds a previous
        sequence's state). Reads and writes the scheduled slots of `pool` in place.
        Prefix mode (a block_size given) adds the keywords `snapshot_slots` `[N]` int64: the slot
        where the sequence's state at the chunk's end (a block boundary) is to be written too, -1
        for none; and `prefix_slots` `[N]` int64: the snapshot a prefix hit starts from (instead of
        its own slot, which holds a previous sequence's state), -1 for none; it may not change it.
        Under CP: x is this CP rank's contiguous piece of the call's T / cp tokens and y its
        outputs; cu_seqlens, slots, fresh (and the keywords) are the whole call's, a filler's last
        where the call holds one (fresh, in a scratch slot, -1 in the keywords), and every CP rank
        writes every sequence's state (linattn's layer returns the final states whole on every CP rank).
    decode(module, x, pool, slots, num_valid, placement) -> y
        One token of each row, x `[1, B, hidden]`, slots `[B]`: the first `num_valid` rows are
        sequences, the rest padding (slots: -1, 0 or a free slot). Returns y `[1, B, hidden]`
        (padding rows' outputs are ignored); writes the valid rows' slots, and no other. Under CP
        the whole decode batch on every CP rank.
    shard_state(state, placement, tp_rank), unshard_state(states, placement): as StatePath's.
    """

    layer: ShardedLayer
    prefill: Callable
    decode: Callable
    shard_state: Callable | None = None
    unshard_state: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"StatePoolPath.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        for field in ("prefill", "decode"):
            if not callable(getattr(self, field)):
                raise ValueError(f"StatePoolPath.{field} must be callable, got {getattr(self, field)!r}")
        if (self.shard_state is None) != (self.unshard_state is None):
            raise ValueError("StatePoolPath.shard_state and unshard_state are given together (or neither: tp = 1 only)")
        try:
            pickle.dumps(self)
        except Exception as exc:  # noqa: BLE001 - reported as bad input
            raise ValueError(f"StatePoolPath's callables must be module-level (spawn pickles them by reference): "
                             f"{exc}") from None


def assert_state_pool_parity(spawn, path: StatePoolPath, reference: torch.nn.Module, placements: Sequence[Placement],
                             cu_seqlens, *, plans: Sequence[SequencePlan], hidden_size: int, seed: int, rtol: float,
                             max_live: int | None = None, capture_sizes: Sequence[int] = CAPTURE_SIZES,
                             dtype: torch.dtype = torch.float64, block_size: int | None = None,
                             prefix_hits: dict | None = None, reference_forward: Callable | None = None,
                             name: str = "") -> None:
    """The client's pool path at every placement (TP, CP, TP x CP) against one float64 full forward of
    `reference` from zero states (the module docstring). max_live: sequences live at once
    (default half of them, at least 2: slots are freed and reused). capture_sizes: the decode batch
    sizes a graph is captured for; a decode call is padded to the next one. reference_forward(reference,
    x, cu_seqlens, state) -> (y, final_state), as the continuation check's. block_size: the prefix
    mode's block (module docstring); prefix_hits {n: (m, tokens)}: sequence n's first `tokens`
    tokens are sequence m's (m < n), restored from m's snapshot there; plans[n] covers the rest."""
    __tracebackhide__ = True
    if not isinstance(path, StatePoolPath):
        raise ValueError(f"path must be a StatePoolPath, got {type(path).__name__}")
    cu = as_cu_seqlens(cu_seqlens)
    bounds = [int(b) for b in cu.tolist()]
    N = len(bounds) - 1
    positive_int(hidden_size, "hidden_size")
    rtol = check_rtol(rtol)
    plans = list(plans)
    if len(plans) != N or not all(isinstance(pl, SequencePlan) for pl in plans):
        raise ValueError(f"plans must hold one SequencePlan per sequence ({N}), got {plans!r}")
    hits = check_prefix_hits(block_size, prefix_hits, plans, bounds)
    for n, pl in enumerate(plans):
        if pl.length != bounds[n + 1] - bounds[n] - hits.get(n, (0, 0))[1]:
            raise ValueError(f"plans[{n}] covers {pl.length} tokens ({pl}); sequence {n} has "
                             f"{bounds[n + 1] - bounds[n]}"
                             + (f", {hits[n][1]} of them a prefix hit" if n in hits else ""))
    max_live = max_live if max_live is not None else max(2, (N + 1) // 2)
    positive_int(max_live, "max_live")
    capture_sizes = tuple(sorted(capture_sizes))
    for c in capture_sizes:
        positive_int(c, "capture_sizes[...]")
    placements = check_pool_placements(placements, path, "the pool mode")

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, bounds[-1], hidden_size, generator=gen, dtype=torch.float64)
    for n, (m, tokens) in hits.items():  # a prefix hit's first tokens are the other sequence's
        x[:, bounds[n]:bounds[n] + tokens] = x[:, bounds[m]:bounds[m] + tokens]
    forward = reference_forward or (lambda ref, x_, cu_, s: ref(x_, cu_, s, output_final_state=True))
    ref_dtype = next(reference.parameters()).dtype
    with torch.no_grad():
        y_ref, probe = forward(reference, x.to(ref_dtype), cu, None)
    y_ref, ht_ref = y_ref.double(), [t.double() for t in probe]
    P = max_live + 1  # a slot always free: the padding rows' third target
    fields = [torch.randn((P,) + tuple(t.shape[1:]), generator=gen, dtype=torch.float64) for t in ht_ref]
    pool = type(probe)(*fields) if hasattr(probe, "_fields") else type(probe)(fields)
    calls = pool_schedule(plans, bounds, max_live, P, hidden_size, gen, capture_sizes, block_size, hits)
    snapshots = {s: (i, seq, t) for i, c in enumerate(calls) for seq, s, t in snapshots_of(c, bounds)}
    if snapshots:  # the prefix blocks: slots after the live ones, random until written
        fields = [torch.cat([f, torch.randn((len(snapshots),) + tuple(f.shape[1:]), generator=gen,
                                            dtype=torch.float64)]) for f in fields]
        pool = type(probe)(*fields) if hasattr(probe, "_fields") else type(probe)(fields)
        with torch.no_grad():
            expected = {s: [t.double()[0] for t in forward(reference, x[:, bounds[seq]:bounds[seq] + t].to(ref_dtype),
                                                            torch.tensor([0, t], dtype=torch.int32), None)[1]]
                        for s, (i, seq, t) in snapshots.items()}
    scratch = None
    if any(p.cp > 1 for p in placements):  # a scratch slot after the others: the CP fillers'
        scratch = pool[0].shape[0]
        pool = rebuild_state(probe, [torch.cat([f, torch.randn((1,) + tuple(f.shape[1:]), generator=gen,
                                                               dtype=torch.float64)]) for f in pool])
    label = f"{name}/" if name else ""
    reports = []
    for p in placements:
        placed = with_cp_fillers(calls, p.cp, hidden_size, gen, scratch) if p.cp > 1 else calls
        case = RankPool(path, p, {k: t.detach() for k, t in reference.named_parameters()}, x, pool, placed,
                        dtype, field_names(probe))
        results = spawn(run_pool_on_rank, p.size, case)
        prefix = _check_snapshots(p, path, plans, calls, results, snapshots, expected, rtol) if snapshots else []
        report = _check(f"{label}{p.name}/seed{seed}", p, path, plans, bounds, placed, results, y_ref, ht_ref, rtol,
                        prefix)
        if report:
            reports.append(report)
    if reports:
        raise AssertionError("\n\n".join(reports))


def _check(label, p, path, plans, bounds, calls, results, y_ref, ht_ref, rtol, prefix=()) -> str:
    failures = list(prefix)
    for r, result in enumerate(results):
        for i, slot, seq, field, diff in result["changed"]:
            failures.append(f"{describe_call(i, calls[i])} changed live slot {slot} (sequence {seq}, {plans[seq]}), "
                            f"which it did not schedule: field {field}, max |change| {diff:.2e} (rank {r})")
    where, holders, before = {}, {}, {}  # token -> (call, slot, sequence); slot -> last sequence; sequence -> previous
    for i, call in enumerate(calls):
        for t in call.tokens.tolist():
            seq = bisect.bisect_right(bounds, t) - 1
            slot = call.slots[call.sequences.index(seq)]
            where[t] = (i, slot, seq)
            if holders.get(slot, seq) != seq:
                before[seq] = holders[slot]
            holders[slot] = seq
    scale = float(torch.linalg.vector_norm(y_ref)) / math.sqrt(y_ref.shape[1]) or 1.0

    def located(t):
        i, slot, seq = where[t]
        holder = f"held before by sequence {before[seq]}" if seq in before else "its first holder"
        return (f"sequence {seq} ({plans[seq]}) token {t - bounds[seq]}, {describe_call(i, calls[i])}, its slot "
                f"{slot} ({holder})")

    unrun = [t for t in range(y_ref.shape[1]) if t not in where]  # a prefix hit's restored tokens
    for c, t_rank in ((c, t) for c in range(p.cp) for t in range(p.tp)):
        y = cp_view(results, "y", p, t_rank, c)
        per_token = torch.linalg.vector_norm((y - y_ref)[0], dim=-1) / scale
        per_token[unrun] = 0
        if c:  # a prefill token comes from the CP rank that held it: judged once, on CP rank 0's view
            per_token[~results[t_rank + p.tp * c]["decoded"]] = 0
        bad = torch.nonzero(~(per_token <= rtol)).flatten().tolist()
        if not bad:
            continue
        firsts = {}  # each wrong sequence's first wrong token
        for t in bad:
            firsts.setdefault(where[t][2], t)
        t = min(firsts.values(), key=lambda g: (g - bounds[where[g][2]], where[g][2]))
        failures.append(f"output{_rank_words(p, t_rank, c)}: {len(bad)} token(s) off; first wrong "
                        f"token: {located(t)}, error {float(per_token[t]):.1e} of the tokens' RMS norm; each wrong "
                        "sequence's first wrong token:\n" + "\n".join(f"    {located(g)}" for g in firsts.values()))
    names = field_names(results[0]["final"])

    def describe(tensor_name, index):
        return f"sequence {index[0]} ({plans[index[0]]}), element {tuple(index[1:])}"

    for c in range(p.cp):
        states = _unshard(path, p, [results[t + p.tp * c]["final"] for t in range(p.tp)])
        try:
            assert_parity(dict(zip(names, states)), dict(zip(names, ht_ref)), rtol=rtol,
                          name=f"{label} final state (the slot when the sequence ends)"
                               + (f" on cp_rank{c}" if p.cp > 1 else ""), describe=describe, activations=False)
        except AssertionError as exc:
            failures.append(str(exc))
    if not failures:
        return ""
    return (f"state-pool parity failed for {label}: {len(failures)} failing check(s)\n"
            + "".join(f"  {describe_call(i, c)}\n" for i, c in enumerate(calls)) + describe_fillers(calls) + "\n"
            + "\n".join(failures))


def _rank_words(p, t_rank, c) -> str:
    """' tp_rank1 (decoded on cp_rank0)': which rank's view a report line judges ('' for one rank)."""
    return "".join([f" tp_rank{t_rank}" if p.tp > 1 else "", f" (decoded on cp_rank{c})" if p.cp > 1 else ""])


def _unshard(path, p, per_tp_rank) -> list:
    """One CP rank's states (per TP rank) as the replicated layout's fields, float64."""
    return [t.double() for t in (per_tp_rank[0] if p.tp == 1 else path.unshard_state(per_tp_rank, p))]


def _check_snapshots(p, path, plans, calls, results, snapshots, expected, rtol) -> list[str]:
    """The prefix blocks changed after their call, then each snapshot against the float64 state
    at its boundary."""
    failures = []
    for r, result in enumerate(results):
        for i, slot, field, diff in result["changed_blocks"]:
            _, seq, t = snapshots[slot]
            read = calls[i].prefix_slots is not None and slot in calls[i].prefix_slots
            failures.append(f"{describe_call(i, calls[i])} changed prefix block slot {slot} (the snapshot of "
                            f"sequence {seq} at token {t})" + (", which it read from" if read else "")
                            + f": field {field}, max |change| {diff:.2e} (rank {r})")
    order = sorted(snapshots)
    like = results[0]["final"]
    names = field_names(like)
    for c in range(p.cp):  # the pool is whole on every CP rank: each rank's snapshots
        per_rank = [rebuild_state(like, [torch.stack([results[t + p.tp * c]["snapshots"][s][f] for s in order])
                                         for f in range(len(expected[order[0]]))]) for t in range(p.tp)]
        got = _unshard(path, p, per_rank)
        for k, slot in enumerate(order):
            i, seq, t = snapshots[slot]
            for field, a, e in zip(names, got, expected[slot]):
                err = float(torch.linalg.vector_norm(a[k] - e)) / (float(torch.linalg.vector_norm(e)) or 1.0)
                if not err <= rtol:
                    failures.append(f"{describe_call(i, calls[i])}: the snapshot of sequence {seq} ({plans[seq]}) at "
                                    f"token {t} in slot {slot} is not the state there: field {field} error {err:.1e}"
                                    + (f" (cp_rank{c})" if p.cp > 1 else ""))
    return failures
