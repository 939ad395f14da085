"""A checkpoint client of linattn's layer for `pytest_linattn.harness.assert_checkpoint_round_trip`,
in full precision: every rank saves its shard (its parameters, HF names), the exporter merges the
shards with `unshard_state_dict` (each section of a fused weight by its own heads), the loader
takes a rank's shard with `shard_state_dict`. The quantized client beside it:
`clients.quantized_checkpoint`.

`linattn_checkpoint_io(config, merge=..., load=...)`: the harness's CheckpointIO for a config; a
planted bug replaces the merge or the load (a module-level function taking the config first:
spawn pickles it by reference, through functools.partial).
"""

from __future__ import annotations

import functools

from linattn.layers import shard_state_dict, unshard_state_dict
from pytest_linattn.harness import CheckpointIO

__all__ = ["linattn_checkpoint_io", "load_by_section", "merge_by_section", "save_rank_shard"]


def save_rank_shard(module, placement, tp_rank):
    """What a rank writes: its parameters (a Megatron-style per-rank shard)."""
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def merge_by_section(config, saved, placement):
    """The exporter: the replicated layer's state dict from the ranks' shards (TP rank order)."""
    return unshard_state_dict(saved, config)


def load_by_section(config, checkpoint, placement, tp_rank):
    """The loader: TP rank `tp_rank`'s shard of the full checkpoint at `placement`."""
    return shard_state_dict(checkpoint, config, tp_rank, placement.tp)


def linattn_checkpoint_io(config, *, merge=merge_by_section, load=load_by_section) -> CheckpointIO:
    """linattn's layer for `config`, saved per rank, merged and loaded by section; the report
    locates by `config`'s parameter layouts."""
    return CheckpointIO(save=save_rank_shard, merge=functools.partial(merge, config),
                        load=functools.partial(load, config), config=config)
