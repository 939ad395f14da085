"""A prefill/decode disaggregation client of linattn's layer for
`pytest_linattn.harness.assert_state_handoff_parity`: the layer's own prefill and decode calls (as
`cases.layer_parity.linattn_state_path`), and a handoff that puts the prefill ranks' states back
together as the replicated layer's (`unshard_layer_state`: each conv section, q, k and v, by its
own heads) and takes the target rank's heads of each section (`shard_layer_state`).

`linattn_handoff_path(config, handoff=...)`: the harness's StateHandoffPath for a config; a planted
bug replaces the handoff (a module-level function taking the config first: spawn pickles it by
reference, through functools.partial).
"""

from __future__ import annotations

import functools

from cases.layer_parity import linattn_layer
from linattn.layers import shard_layer_state, unshard_layer_state
from pytest_linattn.harness import StateHandoffPath

__all__ = ["handoff_by_section", "linattn_handoff_path", "replicated_state"]


def replicated_state(config, states, source):
    """The replicated layer's state from the source ranks' (TP rank order)."""
    return states[0] if source.tp == 1 else unshard_layer_state(states, config)


def handoff_by_section(config, states, source, target, target_tp_rank):
    """Unshard the source ranks' states, then shard for the target rank: every conv section (q, k,
    v) and the recurrent state split by their own heads, as the weights are."""
    return shard_layer_state(replicated_state(config, states, source), config, target_tp_rank, target.tp)


def _shard(config, state, placement, tp_rank):
    return shard_layer_state(state, config, tp_rank, placement.tp)


def _unshard(config, states, placement):
    return unshard_layer_state(states, config)


def linattn_handoff_path(config, handoff=handoff_by_section) -> StateHandoffPath:
    """linattn's layer for `config`, its states handed between TP sizes by `handoff(config, states,
    source, target, target_tp_rank)`; the report locates by `config`'s state layout."""
    return StateHandoffPath(linattn_layer(config), functools.partial(handoff, config),
                            shard_state=functools.partial(_shard, config),
                            unshard_state=functools.partial(_unshard, config), config=config)
