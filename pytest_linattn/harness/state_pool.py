"""The state-pool mode of the continuation check: states live in a pool of slots, as a serving
engine keeps them, and every call names each sequence's slot.

Sequences arrive in order and take the lowest free slot (at most `max_live` at once); each step
runs one prefill call (the next chunk of every live sequence that still has chunks; a sequence's
first chunk is marked fresh: the client starts it from zero, whatever its slot holds) and one
decode call (the next token of every live sequence in its decode phase). A decode call is padded
to the next captured batch size with padding rows, as a CUDA-graph replay pads it, with random
inputs; the padding rows point where the path's `padding_slot` says (default: in turn at a
sentinel (-1), at slot 0, and at a free slot). A path's `reserved_slots` (vLLM's null block 0)
are never given to a sequence. A finished sequence frees its slot, which the next waiting
sequence takes. The pool starts filled with random values, never zeros, the slots no sequence
holds (the spare slot, reserved slots, the CP scratch slot) with large ones (`free_fill`): a
slot read without a reset, or written by a call that did not schedule it, shows.

Every placement runs the schedule on two pools: one with a spare slot (`max_live` + 1 slots for
the sequences: the lowest-free-first rule never gives the last one out) and a full one (as many
slots as sequences live at once: while sequences wait every slot is live, the last one too, so a
write through -1, which indexes the last slot, lands in a live sequence's). A path whose padding
rows point at a free slot (`padding_slot="free"`) runs the spare pool only.

After every call, every slot the call did not schedule, live or free, must be bitwise unchanged
(on every rank; the reserved slots, the engine's scratch, excepted); every token's output and
every sequence's final state (its slot when it finishes) must match one float64 full forward of
the replicated layer from zero states, within rtol. A failure names the call, the slot (live or
free), the sequence and the token; the output's headline is the earliest call that goes wrong
(the lowest wrong position after it where that is another token). No gradients (serving).

The pool's fields are in the ranks' dtype, or per field in the path's `state_dtypes` (vLLM's
`mamba_ssm_cache_dtype=float32`: a float32 recurrent pool under a bf16 layer); what the check
keeps between calls (the pool, the final states, the snapshots) keeps those dtypes.

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
that wrote it (the shared-block rule: the call that reads it included). A path with
`inner_snapshots` (an engine whose snapshot cadence is shorter than its chunks) also snapshots
every block boundary strictly inside a chunk (the prefill gets `inner_snapshot_slots` and
`inner_snapshot_offsets`); those snapshots are checked the same way, a hit may start from any of
them, and chunks need not end on block boundaries. Block tables, per-group hit lengths, mixed
prefill and decode rows in one call, admissions and rejected loads: `pool_modes`. This module
imports no pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .cases import ShardedLayer, require_module_level
from .continuation_plans import SequencePlan
from .continuation_report import field_names
from .placement import Placement, as_cu_seqlens
from .pool_modes import check_group_hits, check_pool_options, check_rejected_hits, restored_blocks
from .serving_plans import (CAPTURE_SIZES, check_hits_served, check_pool_placements, check_prefix_hits,
                            check_state_dtype_names, check_state_dtypes, free_fill, pool_schedule, sequence_slots,
                            snapshots_of, with_cp_fillers)
from .state_pool_rank import RankPool, rebuild_state, run_pool_on_rank
from .state_pool_report import check_pool_run, check_snapshots

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
        With `inner_snapshots` also `inner_snapshot_slots` and `inner_snapshot_offsets`, each
        `[N, B]` int64 (B the call's most, possibly 0; rows padded with -1): for each block
        boundary strictly inside the sequence's chunk, in token order, the slot where the state
        there is to be written and its offset in the chunk (the chunk's tokens before it: the state
        after x[cu_seqlens[n] : cu_seqlens[n] + offset]). Under CP (no inner snapshots): x is this
        CP rank's contiguous piece of the call's T / cp tokens and y its outputs; cu_seqlens,
        slots, fresh (and the keywords) are the whole call's, a filler's last where the call holds
        one (fresh, in a scratch slot, -1 in the keywords), and every CP rank writes every
        sequence's state (linattn's layer returns the final states whole on every CP rank).
    decode(module, x, pool, slots, num_valid, placement) -> y
        One token of each row, x `[1, B, hidden]`, slots `[B]`: the first `num_valid` rows are
        sequences, the rest padding (slots: `padding_slot`'s). Returns y `[1, B, hidden]`
        (padding rows' outputs are ignored); writes the valid rows' slots, and no other (a
        reserved slot excepted). Under CP the whole decode batch on every CP rank.
    shard_state(state, placement, tp_rank), unshard_state(states, placement): as StatePath's.
    state_dtypes: {field name: torch.dtype}, the pool's dtype of those fields (e.g. {"recurrent":
        torch.float32} under bf16 ranks); the others in the ranks' dtype. Default None: all.
    padding_slot: where a decode's padding rows point, the engine's convention: -1 (sglang's
        PAD_SLOT_ID), 0 or another reserved slot (vLLM's null block 0), "free" (the lowest free
        slot). Default None: -1, slot 0 and a free slot in turn.
    reserved_slots: slots never given to a sequence, the engine's scratch (vLLM: (0,)): a call may
        change them; every other slot it does not schedule must stay bitwise unchanged. Default ().
    capture(module, pool, batch_size, placement) -> replay: captured steps, as a CUDA-graph runner
        decodes (give `decode` None then). Called once per padded batch size, at that size's first
        decode call: the client sets up its static buffers (on CUDA it captures its decode of
        `batch_size` rows into a torch.cuda.CUDAGraph); `replay(x, slots, num_valid) -> y` then runs
        every decode call of that size, refilling the static buffers from the call's inputs (as
        decode's). Between the replays of one size the batch's layout changes (its valid rows,
        their slots, the padding rows), as between a captured graph's replays in an engine.
    inner_snapshots: prefix mode only, CP 1 only: snapshots also at every block boundary strictly
        inside a chunk (an engine whose snapshot cadence is shorter than its prefill chunk: sglang's
        mamba_track, FlashInfer's mid-prefill states), passed as `inner_snapshot_slots` and
        `inner_snapshot_offsets`; each is checked against the float64 state at its boundary, a
        prefix hit may start from any snapshot, and chunks need not end on block boundaries.
        Plans whose chunks cross no inner boundary are refused (the option would check nothing).
        Default False: snapshots only where a chunk ends on a block boundary (vLLM's align mode).
    block_tables: prefix mode, CP 1: the prefill gets `block_table` and `num_computed_tokens` instead
        of `prefix_slots` and maps token counts to blocks itself (`pool_modes`). Default False.
    mixed_calls: each step's decode rows run in its prefill call, after the prefill rows, as 1-token
        rows; the prefill gets `decode_rows` `[N]` bool (`pool_modes`). Default False.
    admit(module, pool, slots, load_slots, loaded, placement) -> None: called before the prefill call
        that runs sequences' first chunks, for those sequences: what each admission loads (a prefix
        hit's snapshot, -1 none) and whether the load goes through (`rejected_hits`: `pool_modes`);
        may change the admitted slots only. Default None: no admission step.
    """

    layer: ShardedLayer
    prefill: Callable
    decode: Callable
    shard_state: Callable | None = None
    unshard_state: Callable | None = None
    state_dtypes: dict | None = dataclasses.field(default=None, hash=False)  # a dict: left out of the hash
    padding_slot: int | str | None = None
    reserved_slots: tuple = ()
    capture: Callable | None = None
    inner_snapshots: bool = False
    block_tables: bool = False
    mixed_calls: bool = False
    admit: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"StatePoolPath.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        if not callable(self.prefill):
            raise ValueError(f"StatePoolPath.prefill must be callable, got {self.prefill!r}")
        if (self.decode is None) == (self.capture is None):
            raise ValueError("StatePoolPath takes decode or capture (captured steps), one of them: got "
                             + ("both" if self.decode is not None else "neither"))
        for field in ("decode", "capture"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ValueError(f"StatePoolPath.{field} must be callable, got {getattr(self, field)!r}")
        if (self.shard_state is None) != (self.unshard_state is None):
            raise ValueError("StatePoolPath.shard_state and unshard_state are given together (or neither: tp = 1 only)")
        object.__setattr__(self, "state_dtypes", check_state_dtypes(self.state_dtypes, "StatePoolPath"))
        reserved = self.reserved_slots
        if not (isinstance(reserved, (tuple, list)) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                            for s in reserved) and len(set(reserved)) == len(reserved)):
            raise ValueError(f"StatePoolPath.reserved_slots must be distinct slot indices >= 0 (slots never given to a "
                             f"sequence, the engine's scratch; vLLM's null block: (0,)), got {reserved!r}")
        object.__setattr__(self, "reserved_slots", tuple(reserved))
        for flag in ("inner_snapshots", "block_tables", "mixed_calls"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"StatePoolPath.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.admit is not None and not callable(self.admit):
            raise ValueError(f"StatePoolPath.admit must be callable or None, got {self.admit!r}")
        pad = self.padding_slot
        if not (pad is None or pad == "free" or (isinstance(pad, int) and not isinstance(pad, bool)
                                                  and (pad in (-1, 0) or pad in self.reserved_slots))):
            raise ValueError(f"StatePoolPath.padding_slot must be -1 (a sentinel), 0, a reserved slot or 'free' "
                             f"(a free slot); None: -1, slot 0 and a free slot in turn; got {pad!r}")
        require_module_level(self)


def assert_state_pool_parity(spawn, path: StatePoolPath, reference: torch.nn.Module, placements: Sequence[Placement],
                             cu_seqlens, *, plans: Sequence[SequencePlan], hidden_size: int, seed: int, rtol: float,
                             max_live: int | None = None, capture_sizes: Sequence[int] = CAPTURE_SIZES,
                             dtype: torch.dtype = torch.float64, block_size: int | None = None,
                             prefix_hits: dict | None = None, reference_forward: Callable | None = None,
                             group_hits: dict | None = None, rejected_hits: dict | None = None,
                             name: str = "") -> None:
    """The client's pool path at every placement (TP, CP, TP x CP) against one float64 full forward of
    `reference` from zero states (the module docstring). max_live: sequences live at once
    (default half of them, at least 2: slots are freed and reused). capture_sizes: the decode batch
    sizes a graph is captured for; a decode call is padded to the next one. reference_forward(reference,
    x, cu_seqlens, state) -> (y, final_state), as the continuation check's. block_size: the prefix
    mode's block (module docstring); prefix_hits {n: (m, tokens)}: sequence n's first `tokens`
    tokens are sequence m's (m < n), restored from m's snapshot there; plans[n] covers the rest.
    With the path's `inner_snapshots` a hit may start from any block boundary of m's chunks.
    group_hits {n: tokens} (the path's `block_tables`): hit n's layer group has cached m's blocks up
    to `tokens`, past where the engine resumes; rejected_hits {n: (m, tokens)} (the path's `admit`):
    sequence n's admission tries m's snapshot at `tokens`, the load is rejected, n runs from its
    first token (`pool_modes`)."""
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
    inner = path.inner_snapshots
    hits = check_prefix_hits(block_size, prefix_hits, plans, bounds, inner)
    check_pool_options(path, block_size, group_hits, rejected_hits, placements)
    groups = check_group_hits(group_hits, hits, plans, block_size)
    rejected = check_rejected_hits(rejected_hits, hits, plans, bounds, block_size) if rejected_hits else {}
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
    if inner and any(p.cp > 1 for p in placements):
        raise ValueError(f"StatePoolPath.inner_snapshots runs at cp 1 only (a CP rank holds a piece of a chunk, not "
                         f"the states inside it); got {[p.name for p in placements if p.cp > 1]}")

    reserved = path.reserved_slots
    full_count = min(max_live, N)  # the full pool: as many slots as sequences live at once
    if any(r >= full_count + len(reserved) for r in reserved):
        raise ValueError(f"StatePoolPath.reserved_slots {list(reserved)}: a reserved slot must lie among the pool's "
                         f"first {full_count + len(reserved)} slots (the reserved ones and the {full_count} of the "
                         f"sequences live at once)")

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, bounds[-1], hidden_size, generator=gen, dtype=torch.float64)
    for n, (m, tokens) in {**hits, **rejected}.items():  # a prefix hit's first tokens are the other sequence's
        x[:, bounds[n]:bounds[n] + tokens] = x[:, bounds[m]:bounds[m] + tokens]
    forward = reference_forward or (lambda ref, x_, cu_, s: ref(x_, cu_, s, output_final_state=True))
    ref_dtype = next(reference.parameters()).dtype
    with torch.no_grad():
        y_ref, probe = forward(reference, x.to(ref_dtype), cu, None)
    y_ref, ht_ref = y_ref.double(), [t.double() for t in probe]
    check_state_dtype_names(path, field_names(probe))
    boundary_states = {}  # (sequence, token) -> the float64 state there: a snapshot's expected value

    def state_at(seq, t):
        if (seq, t) not in boundary_states:
            with torch.no_grad():
                boundary_states[seq, t] = [f.double()[0] for f in forward(
                    reference, x[:, bounds[seq]:bounds[seq] + t].to(ref_dtype), torch.tensor([0, t], dtype=torch.int32),
                    None)[1]]
        return boundary_states[seq, t]

    def output_from(tokens, state):  # the reference's outputs of one sequence's `tokens` from `state`
        cu_one = torch.tensor([0, tokens.shape[1]], dtype=torch.int32)
        return forward(reference, tokens.to(ref_dtype), cu_one, rebuild_state(probe, [f[None].to(ref_dtype)
                                                                                    for f in state]))[0]

    use_cp = any(p.cp > 1 for p in placements)
    kinds = [("spare", max_live + 1, gen)]  # a slot always free: the padding rows' free target
    if path.padding_slot != "free":
        kinds.append(("full", full_count, torch.Generator().manual_seed(seed + 1)))
    pools = [_pool_run(kind, count, g, probe, ht_ref, path, plans, bounds, max_live, hidden_size, capture_sizes,
                       block_size, hits, use_cp, state_at, dict(group_hits=groups, rejected_hits=rejected))
             for kind, count, g in kinds]
    label = f"{name}/" if name else ""
    reports = []
    for p in placements:
        for run in pools:
            placed = with_cp_fillers(run.calls, p.cp, hidden_size, run.gen, run.scratch) if p.cp > 1 else run.calls
            case = RankPool(path, p, {k: t.detach() for k, t in reference.named_parameters()}, x, run.pool, placed,
                            dtype, field_names(probe))
            results = spawn(run_pool_on_rank, p.size, case)
            prefix = (check_snapshots(p, path, plans, bounds, run, results, rtol, state_at)
                      if run.snapshots else [])
            if path.block_tables:  # a hit whose first computed token is off: which block it restored
                prefix += restored_blocks(run.calls, hits, bounds, block_size, results[0]["y"], y_ref, rtol, state_at,
                                          output_from, x)
            report = check_pool_run(f"{label}{p.name}/seed{seed}" + ("/full-pool" if run.kind == "full" else ""), p,
                                    path, plans, bounds, placed, results, y_ref, ht_ref, rtol, prefix, run)
            if report:
                reports.append(report)
    if reports:
        raise AssertionError("\n\n".join(reports))


@dataclasses.dataclass(frozen=True)
class _PoolRun:
    """One pool the schedule runs on: kind "spare" (a slot always free) or "full"; its initial
    fields (replicated layout, float64), calls, snapshots (slot -> (call, sequence, token)) and
    their expected states, the CP scratch slot (None without CP), the generator of its CP
    fillers, the sequences' slots and the reserved ones."""

    kind: str
    pool: tuple
    calls: list
    snapshots: dict
    expected: dict
    scratch: int | None
    gen: torch.Generator
    sequence_slots: tuple
    reserved: tuple
    max_live: int

    def describe(self) -> str:
        size = self.pool[0].shape[0]
        words = [f"{len(self.sequence_slots)} for the sequences ({self.max_live} live at most"
                 + (": a slot always spare)" if self.kind == "spare" else ": full while sequences wait)")]
        if self.reserved:
            words.append(f"reserved {list(self.reserved)}")
        if self.snapshots:
            words.append(f"prefix snapshots {min(self.snapshots)}..{max(self.snapshots)}")
        if self.scratch is not None:
            words.append(f"CP scratch {self.scratch}")
        return f"  a pool of {size} slots: {', '.join(words)}\n"


def _pool_run(kind, count, gen, probe, ht_ref, path, plans, bounds, max_live, hidden_size, capture_sizes, block_size,
              hits, use_cp, state_at, options) -> _PoolRun:
    """The pool `kind` with `count` slots for the sequences (and the path's reserved slots), its
    schedule and snapshots; random fields, the slots no sequence holds at `free_fill`'s."""
    reserved = path.reserved_slots
    seq_slots = sequence_slots(count, reserved)
    P = count + len(reserved)
    fields = [torch.randn((P,) + tuple(t.shape[1:]), generator=gen, dtype=torch.float64) for t in ht_ref]
    calls = pool_schedule(plans, bounds, max_live, P, hidden_size, gen, capture_sizes, block_size, hits,
                          padding_slot=path.padding_slot, reserved_slots=reserved, inner_snapshots=path.inner_snapshots,
                          block_tables=path.block_tables, mixed_calls=path.mixed_calls,
                          admission=path.admit is not None, **options)
    check_hits_served(calls, hits)
    snapshots = {s: (i, seq, t) for i, c in enumerate(calls) for seq, s, t in snapshots_of(c, bounds)}
    expected = {}
    if snapshots:  # the prefix blocks: slots after the live ones, random until written
        fields = [torch.cat([f, torch.randn((len(snapshots),) + tuple(f.shape[1:]), generator=gen,
                                            dtype=torch.float64)]) for f in fields]
        expected = {s: state_at(seq, t) for s, (i, seq, t) in snapshots.items()}
    scratch = None
    if use_cp:  # a scratch slot after the others: the CP fillers'
        scratch = fields[0].shape[0]
        fields = [torch.cat([f, torch.randn((1,) + tuple(f.shape[1:]), generator=gen, dtype=torch.float64)])
                  for f in fields]
    held = {s for c in calls for s in c.live.values()}
    unheld = [s for s in range(fields[0].shape[0]) if s not in held and s not in snapshots]
    for f in fields:
        f[unheld] = free_fill(f[unheld])
    return _PoolRun(kind, rebuild_state(probe, fields), calls, snapshots, expected, scratch, gen, tuple(seq_slots),
                    tuple(reserved), max_live)
