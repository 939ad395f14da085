"""A drafter in the speculative-decoding check (`SpecDecodePath.drafter`): a draft model, or an MTP
head, with a recurrent state of its own, beside the target's. An engine's drafter reads the same
tokens as the target: it prefills the prompt, proposes each round's drafts from its state (its
state advanced through the round's tokens, as a draft context's decode leaves it), and after the
target's accept must roll back to the accepted prefix, the rejected positions removed (llama.cpp's
`llama_memory_seq_rm` on the draft context). A rollback that fails and says nothing keeps stale
positions: the target's outputs and states stay right, and only the drafter's state shows it
(then its proposals, and the acceptance rate).

The check runs the drafter on the target's calls (a prefill call's chunks; a verify round's
tokens: the bonus token, the accepted ones, the rejected drafts; the accept's
`num_accepted_tokens`) in a pool of its own, random like the target's (sequence n in slot N - n;
with `slots_per_sequence` the first slot of its row: a drafter keeps one state per sequence; no
blocks). After every call the drafter's outputs and the state in every slot the call scheduled
must match the float64 serial run of `drafter_reference` over the sequence's committed tokens
(relative error per sequence and field, within rtol), and every other slot of its pool must be
bitwise unchanged; a report names the call (the prefill chunk or the verify round), the slot,
the sequence, the token and the field, each line saying it is the drafter's. Under CP the drafter
runs as the target does (a prefill call's tokens in pieces, its filler in the scratch slot; a
verify round whole on every rank). No gradients. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .cases import ShardedLayer, require_module_level

__all__ = ["SpecDrafter", "drafter_calls", "drafter_path"]

WHO = "the drafter's "  # how the report's lines name the drafter's outputs, states and slots


@dataclasses.dataclass(frozen=True)
class SpecDrafter:
    """A drafter with a recurrent state of its own, for `SpecDecodePath.drafter` (the module
    docstring). Callables module-level (spawn pickles them by reference). Its pool is a tuple of
    tensors (its state's fields), each `[P, ...]`, in the TP rank's layout.

    layer: its `ShardedLayer` (the draft layer; the same hidden size as the target's: it reads the
        same inputs), built on every rank, its weights those of the check's `drafter_reference`.
    prefill(module, x, cu_seqlens, pool, slots, fresh, placement) -> y: as StatePoolPath's, on the
        drafter's pool.
    propose(module, x, cu_seqlens, pool, slots, placement) -> y: a verify round's tokens of each of
        N sequences, packed as the target's verify gets them, from its slot's state: every token's
        output (what the drafts were proposed from). It may advance its slots (as a draft context's
        decode does) and keep what rollback needs, but changes no other slot.
    rollback(module, pool, slots, num_accepted_tokens, placement) -> None: num_accepted_tokens as
        the target's accept gets it; each slot must end holding the state after its sequence's
        first num_accepted_tokens tokens of the round (the rejected positions removed).
    shard_state(state, placement, tp_rank), unshard_state(states, placement): as StatePath's, for
        the drafter's state (both or neither: tp = 1 only).
    """

    layer: ShardedLayer
    prefill: Callable
    propose: Callable
    rollback: Callable
    shard_state: Callable | None = None
    unshard_state: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"SpecDrafter.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        for field in ("prefill", "propose", "rollback"):
            if not callable(getattr(self, field)):
                raise ValueError(f"SpecDrafter.{field} must be callable, got {getattr(self, field)!r}")
        if (self.shard_state is None) != (self.unshard_state is None):
            raise ValueError("SpecDrafter.shard_state and unshard_state are given together (or neither: tp = 1 only)")
        require_module_level(self)


def drafter_path(path):
    """The drafter of `path` (a SpecDecodePath) as a path of its own, for the ranks and the judge:
    its prefill, propose as verify, rollback as accept, one slot per sequence."""
    d = path.drafter
    return dataclasses.replace(path, layer=d.layer, prefill=d.prefill, verify=d.propose, accept=d.rollback,
                               shard_state=d.shard_state, unshard_state=d.unshard_state, slots_per_sequence=1,
                               read_state=None, state_dtypes=None, drafter=None)


def drafter_calls(calls) -> list:
    """The target's calls as the drafter runs them: each sequence's slot the first of its row (one
    state per sequence), a CP filler's likewise, no blocks."""
    return [dataclasses.replace(c, slots=tuple(_first(s) for s in c.slots), snapshot_slots=None,
                                snapshot_offsets=None,
                                filler=None if c.filler is None else (c.filler[0], _first(c.filler[1])))
            for c in calls]


def _first(slot):
    return slot if isinstance(slot, int) else slot[0]
