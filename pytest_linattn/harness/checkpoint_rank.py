"""What a rank of the checkpoint round trip's save runs: build the sharded layer at the saving TP
size, load its shard of the reference's weights (the layer's own `shard`), and return what the
client's `save` makes of it; the test process (`pytest_linattn.harness.checkpoint`) merges the
ranks' pieces. The load at the other TP size runs through the parity harness's ranks
(`sharded_parity_rank`). This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .cases import ShardedLayer
from .placement import Placement
from .sharded_parity_rank import load_shard, run_device

__all__ = ["RankSave", "save_on_rank"]


@dataclasses.dataclass(frozen=True)
class RankSave:
    layer: ShardedLayer
    save: Callable
    placement: Placement
    weights: dict
    dtype: torch.dtype


def save_on_rank(task: RankSave):
    """Rank function (for spawn): this rank's contribution to the checkpoint, `save(module,
    placement, tp_rank)` on the layer built at `task.placement` and loaded with its shard."""
    import torch.distributed as dist

    p = task.placement
    tp_rank = dist.get_rank() % p.tp
    groups = task.layer.process_groups(p)
    module = task.layer.build(p, groups, task.dtype, run_device())
    load_shard(module, task.layer.shard(task.weights, p, tp_rank))
    with torch.no_grad():
        return task.save(module, p, tp_rank)
