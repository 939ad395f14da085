"""Process groups for tensor and context parallelism, laid out in Megatron order.

A world of W ranks is viewed as a grid [DP, CP, TP] with TP varying fastest: global rank
r = tp_rank + tp_size * (cp_rank + cp_size * dp_rank). TP ranks are thus neighbours (one node,
fastest links), CP ranks are TP-strided, and whatever is left over is data parallel.

Pipeline stages (PP) are outermost, as in Megatron: r = tp_rank + tp_size * (cp_rank + cp_size *
(dp_rank + dp_size * stage)), so a stage is a contiguous block of W / pp ranks, and the TP and CP
groups `new_groups` makes on that world lie inside one stage each (the leftover axis it calls DP
holds DP x PP). `new_pipeline_group` makes the groups an activation passes along: one rank per
stage, at the same (TP, CP, DP) position of each.

Convention used throughout linattn: a group argument of None means "no parallelism along this
axis" (a group of one rank), never torch's default WORLD group.
"""

from __future__ import annotations

import torch.distributed as dist

from linattn.checks import positive_int

__all__ = [
    "group_rank",
    "group_size",
    "new_groups",
    "new_pipeline_group",
    "parallel_rank_lists",
    "pipeline_rank_lists",
]


def parallel_rank_lists(world_size: int, tp_size: int, cp_size: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """Every TP group and every CP group of a world, as lists of global ranks (Megatron order).

    Pure function: no process group is touched, so the layout can be checked anywhere.
    """
    for name, size in (("world_size", world_size), ("tp_size", tp_size), ("cp_size", cp_size)):
        positive_int(size, name)
    if world_size % (tp_size * cp_size) != 0:
        raise ValueError(
            f"tp_size * cp_size must tile the world: {tp_size} * {cp_size} = {tp_size * cp_size} "
            f"does not divide world_size {world_size}"
        )
    dp_size = world_size // (tp_size * cp_size)
    tp_groups = [
        [tp + tp_size * (cp + cp_size * dp) for tp in range(tp_size)]
        for dp in range(dp_size)
        for cp in range(cp_size)
    ]
    cp_groups = [
        [tp + tp_size * (cp + cp_size * dp) for cp in range(cp_size)]
        for dp in range(dp_size)
        for tp in range(tp_size)
    ]
    return tp_groups, cp_groups


def new_groups(tp_size: int, cp_size: int = 1):
    """Create the TP and CP groups of the initialised world; return (tp_group, cp_group) holding this rank.

    Collective: every rank must call it with the same sizes (torch requires every rank to take
    part in every new_group call). A size of 1 gives None for that axis.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("new_groups needs torch.distributed to be initialised first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp_lists, cp_lists = parallel_rank_lists(world_size, tp_size, cp_size)
    tp_group = cp_group = None
    for ranks in tp_lists:
        group = dist.new_group(ranks) if tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    for ranks in cp_lists:
        group = dist.new_group(ranks) if cp_size > 1 else None
        if rank in ranks:
            cp_group = group
    return tp_group, cp_group


def pipeline_rank_lists(world_size: int, tp_size: int, cp_size: int = 1, pp_size: int = 1) -> list[list[int]]:
    """Every pipeline group of a world, as lists of global ranks in stage order: the ranks at one
    (TP, CP, DP) position of every stage (stages outermost, Megatron order). Pure function."""
    for name, size in (("world_size", world_size), ("tp_size", tp_size), ("cp_size", cp_size), ("pp_size", pp_size)):
        positive_int(size, name)
    if world_size % (tp_size * cp_size * pp_size) != 0:
        raise ValueError(
            f"tp_size * cp_size * pp_size must tile the world: {tp_size} * {cp_size} * {pp_size} = "
            f"{tp_size * cp_size * pp_size} does not divide world_size {world_size}"
        )
    stage = world_size // pp_size  # ranks per stage
    return [[position + stage * s for s in range(pp_size)] for position in range(stage)]


def new_pipeline_group(tp_size: int, cp_size: int = 1, pp_size: int = 1):
    """Create the pipeline groups of the initialised world; return the one holding this rank (its
    rank in it is this rank's stage), None for pp_size 1. Collective, like `new_groups`."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("new_pipeline_group needs torch.distributed to be initialised first")
    rank, mine = dist.get_rank(), None
    for ranks in pipeline_rank_lists(dist.get_world_size(), tp_size, cp_size, pp_size):
        group = dist.new_group(ranks) if pp_size > 1 else None
        if rank in ranks:
            mine = group
    return mine


def group_size(group) -> int:
    """Ranks in `group`; None (no parallelism) counts as one."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index inside `group`; None (no parallelism) gives 0."""
    return 0 if group is None else dist.get_rank(group)
