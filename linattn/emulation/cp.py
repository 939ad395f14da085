"""fla's context-parallel context, with linattn's CP context inside it.

``build_cp_context`` returns a real ``fla.ops.cp.context.FLACPContext`` whose fields are exactly
what fla computes (fla's metadata code is pure torch and runs on a CPU), with the linattn
``CPContext`` of the same partition attached. The emulated ops take ``cp_context=`` and run
``linattn.parallel.cp``'s exchange through ``piece_context(cp_context)``.

Layouts: fla's ``"contiguous"`` is linattn's. fla's ``"zigzag"`` cuts the whole packed batch (not
each sequence) into ``2*cp`` intervals; rank r holds intervals r and ``2*cp-1-r`` (front, back).
For the delta rules the linattn context's relayout then moves those tokens into the contiguous
piece and back (one all-to-all each way), so the same exact contiguous machinery serves both;
the conv exchanges only its halos, interval by interval (``conv._cp_conv``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from linattn.emulation.patching import refuse
from linattn.parallel import cp as linattn_cp

_ATTR = "_linattn_cp_context"  # where the linattn context rides on an FLACPContext

__all__ = ["build_cp_context", "piece_context", "PATCHES"]


def _fla_zigzag_index(total: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global token indices rank cp_rank holds in fla's zigzag layout, local order."""
    part = total // (2 * cp_size)
    back = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * part, (cp_rank + 1) * part), torch.arange(back * part, (back + 1) * part)])


def _linattn_context(global_cu: torch.Tensor, group, layout: str) -> linattn_cp.CPContext:
    if layout != "zigzag":
        return linattn_cp.build_context(global_cu, group)
    total, size = int(global_cu[-1]), dist.get_world_size(group)
    return linattn_cp.build_context(global_cu, group, "fla-zigzag",
                                    tokens_of_rank=lambda rank: _fla_zigzag_index(total, rank, size))


def _intervals(cp_context, cp_rank: int, cp_size: int):
    """(interval index, local cu_seqlens within it, tokens of its first sequence before it)."""
    cu = (cp_context.cu_seqlens_cpu if cp_context.cu_seqlens_cpu is not None else cp_context.cu_seqlens).cpu().long()
    if cp_context.layout == "zigzag":
        n, part = cp_context.front_num_seqs, cp_context.part_len
        front, back = cu[: n + 1], cu[n:] - part
        pre = cp_context.pre_num_conv_tokens_by_part
        return [(cp_rank, front.tolist(), pre[0]), (2 * cp_size - 1 - cp_rank, back.tolist(), pre[1])]
    return [(cp_rank, cu.tolist(), cp_context.pre_num_conv_tokens)]


def _global_cu_from_fields(cp_context, group) -> torch.Tensor:
    """The global cu_seqlens, reassembled from every rank's fla fields (one all-gather of objects).

    An interval's start is a sequence boundary unless its first sequence began earlier."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = [None] * cp_size
    dist.all_gather_object(gathered, _intervals(cp_context, cp_rank, cp_size), group=group)
    intervals = sorted(iv for rank_intervals in gathered for iv in rank_intervals)
    boundaries, offset = [], 0
    for _, local_cu, pre in intervals:
        if pre == 0:
            boundaries.append(offset)
        boundaries += [offset + b for b in local_cu[1:-1]]
        offset += local_cu[-1]
    boundaries.append(offset)
    return torch.tensor(boundaries, dtype=torch.int64)


def piece_context(cp_context) -> linattn_cp.CPContext:
    """The linattn CP context (contiguous piece, same group) of an fla CP context.

    Built by the emulated ``build_cp_context``: attached. Built otherwise (fla's own
    ``get_cp_cu_seqlens``, ``copy_for_backward``): reassembled from fla's fields over the group
    (a collective: every rank calls it at the same point, as every CP op), then attached.
    """
    ctx = getattr(cp_context, _ATTR, None)
    if ctx is not None:
        return ctx
    group = getattr(cp_context, "group", None)
    if group is None:
        # fla runs such a context without CP; the emulated ops take a cp_context only to run CP
        refuse("cp_context", "group", None, "is not emulated: CP needs the process group")
    layout = getattr(cp_context, "layout", "contiguous")
    if layout not in ("contiguous", "zigzag"):
        refuse("cp_context", "layout", layout)
    ctx = _linattn_context(_global_cu_from_fields(cp_context, group), group, layout)
    setattr(cp_context, _ATTR, ctx)
    return ctx


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_tf32x3_affine_chain: bool = True,
    layout: str = "contiguous",
    **kwargs,
):
    """fla's ``build_cp_context``: fla's FLACPContext (its own metadata code), linattn's context attached."""
    from fla.ops.cp import context as fla_context

    if group is None:
        refuse("build_cp_context", "group", None, "is not emulated: CP needs the process group")
    # the undecorated function: a fresh context per call (fla's identity cache would share the
    # object, and with it the attached context, between calls)
    meta_fn = getattr(fla_context.get_cp_cu_seqlens, "__wrapped__", fla_context.get_cp_cu_seqlens)
    fla_ctx = meta_fn(
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, group=group, conv1d_kernel_size=conv1d_kernel_size,
        use_tf32x3_affine_chain=use_tf32x3_affine_chain, layout=layout, **kwargs,
    )
    global_cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).detach().cpu().long()
    setattr(fla_ctx, _ATTR, _linattn_context(global_cu, group, layout))
    return fla_ctx


PATCHES = {
    "fla.ops.cp.context:build_cp_context": build_cp_context,
}
