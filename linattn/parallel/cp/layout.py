"""Token layouts of a packed batch over the CP ranks, and the all-to-all plan between two of them.

A packed batch of ``T`` tokens (global ``cu_seqlens``, tokens on dim 1) over ``cp`` ranks:

- ``"contiguous"``: rank r holds tokens ``[r*T/cp, (r+1)*T/cp)`` of the packed batch;
  ``T % cp == 0``.
- ``"zigzag"``: per sequence (Megatron's THD / Transformer Engine packed layout). Every sequence
  is cut into ``2*cp`` equal chunks; rank r holds chunks ``r`` and ``2*cp-1-r`` of every
  sequence, concatenated in sequence order; every sequence length ``% (2*cp) == 0``.

Hybrid models share one token layout between their softmax-attention layers, which need zigzag
for causal load balance, and their linear-attention layers. Linear attention's cost is linear in
tokens, so the contiguous layout is already balanced for it: zigzag is there for compatibility.
fla's own ``layout="zigzag"`` cuts the whole packed batch, not each sequence, so it is not this
layout.

The CP ops work on the contiguous piece; another layout reaches it by one all-to-all
(``relayout_plan_to_contiguous``, run by ``CPContext.relayout``) and goes back by the inverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from linattn.checks import positive_int, require, validate_cu_seqlens

LAYOUTS = ("contiguous", "zigzag")

__all__ = ["LAYOUTS", "RelayoutPlan", "cp_shard", "cp_token_index", "cp_unshard", "padded_runs",
           "relayout_plan_to_contiguous"]


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"CP layout must be one of {LAYOUTS}, got {layout!r}")


def global_cu_seqlens(cu_seqlens, total_tokens: int | None = None, name: str = "cu_seqlens") -> torch.Tensor:
    """Global cu_seqlens as a CPU int64 tensor; ValueError if it is not a valid packing."""
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() == 1 and cu.numel() >= 1 and total_tokens is None:
        total_tokens = int(cu[-1])
    validate_cu_seqlens(cu, total_tokens, name)
    return cu.detach().to("cpu", torch.int64)


def padded_runs(cu_seqlens, cu_seqlens_padded, cp_size: int, total_tokens: int | None = None):
    """(cu_seqlens_padded as CPU int64, the runs' boundaries) of a padded packed batch.

    Sequence i holds its ``cu_seqlens[i+1] - cu_seqlens[i]`` real tokens first, from
    ``cu_seqlens_padded[i]``, then pads up to ``cu_seqlens_padded[i+1]``. The runs split every
    padded sequence into its real tokens and its pads (empty runs dropped): boundaries for the
    ops, so that no pad precedes a real token in its run. total_tokens: the padded batch's token
    count, checked against ``cu_seqlens_padded[-1]`` when given. ValueError naming the parameter
    unless both are packings of the same sequences, every padded length at least the sequence's
    and a multiple of ``2*cp_size``."""
    positive_int(cp_size, "cp_size")
    cu = global_cu_seqlens(cu_seqlens)
    padded = global_cu_seqlens(cu_seqlens_padded, total_tokens, "cu_seqlens_padded")
    require(padded.numel() == cu.numel(), "cu_seqlens_padded",
            f"must hold one boundary per boundary of cu_seqlens ({cu.numel()}), got {padded.numel()}")
    lengths, padded_lengths = cu.diff(), padded.diff()
    short = torch.nonzero(padded_lengths < lengths).flatten().tolist()
    require(not short, "cu_seqlens_padded",
            f"must give every sequence a padded length >= its length in cu_seqlens; (sequence, length, padded "
            f"length) violating it: {[(i, int(lengths[i]), int(padded_lengths[i])) for i in short[:4]]}")
    parts = 2 * cp_size
    odd = torch.nonzero(padded_lengths % parts).flatten().tolist()
    require(not odd, "cu_seqlens_padded",
            f"must give every sequence a padded length divisible by 2*cp_size={parts}; (sequence, padded length) "
            f"violating it: {[(i, int(padded_lengths[i])) for i in odd[:4]]}")
    real_ends = padded[:-1] + lengths
    runs = torch.stack([padded[:-1], real_ends], dim=1).flatten()
    return padded, torch.unique_consecutive(torch.cat([runs, padded[-1:]]))


def check_partition(cu: torch.Tensor, cp_size: int, layout: str) -> None:
    """ValueError unless the packing ``cu`` splits over ``cp_size`` ranks in ``layout``."""
    check_layout(layout)
    positive_int(cp_size, "cp_size")
    total = int(cu[-1])
    if layout == "contiguous":
        if total % cp_size:
            raise ValueError(f"contiguous CP needs total tokens divisible by cp_size: {total} % {cp_size} != 0")
        return
    parts = 2 * cp_size
    if total % parts:
        raise ValueError(f"zigzag CP needs total tokens divisible by 2*cp_size: {total} % {parts} != 0")
    lengths = (cu[1:] - cu[:-1]).tolist()
    bad = [(i, n) for i, n in enumerate(lengths) if n % parts]
    if bad:
        raise ValueError(
            f"zigzag CP needs every sequence length divisible by 2*cp_size={parts}; "
            f"(sequence, length) violating it: {bad[:4]}"
        )


def zigzag_index(cu: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global token indices held by ``cp_rank`` in the zigzag layout, local order (no checks)."""
    parts = 2 * cp_size
    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        chunk = (end - start) // parts
        for c in (cp_rank, parts - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def cp_token_index(cu_seqlens, cp_rank: int, cp_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Global token indices (int64, CPU) that ``cp_rank`` holds, in its local order."""
    cu = global_cu_seqlens(cu_seqlens)
    check_partition(cu, cp_size, layout)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if layout == "zigzag":
        return zigzag_index(cu, cp_rank, cp_size)
    local = int(cu[-1]) // cp_size
    return torch.arange(cp_rank * local, (cp_rank + 1) * local)


def cp_shard(tensor: torch.Tensor, cu_seqlens, cp_rank: int, cp_size: int, layout: str = "contiguous") -> torch.Tensor:
    """The tokens (dim 1) of a full packed tensor that ``cp_rank`` holds in ``layout``.

    Differentiable (an index_select), so a test can shard a leaf and compare gradients.
    """
    cu = global_cu_seqlens(cu_seqlens)
    if tensor.dim() < 2 or tensor.shape[1] != int(cu[-1]):
        raise ValueError(
            f"cp_shard needs token dim 1 of size cu_seqlens[-1]={int(cu[-1])}, got shape {tuple(tensor.shape)}"
        )
    index = cp_token_index(cu, cp_rank, cp_size, layout)
    return tensor.index_select(1, index.to(tensor.device))


def cp_unshard(shards: Sequence[torch.Tensor], cu_seqlens, cp_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Inverse of ``cp_shard``: the full packed tensor from the ranks' shards in rank order."""
    cu = global_cu_seqlens(cu_seqlens)
    if len(shards) != cp_size:
        raise ValueError(f"cp_unshard needs one shard per rank: got {len(shards)} for cp_size={cp_size}")
    index = torch.cat([cp_token_index(cu, r, cp_size, layout) for r in range(cp_size)])
    stacked = torch.cat(list(shards), dim=1)
    if stacked.shape[1] != int(cu[-1]):
        raise ValueError(f"cp_unshard: shards hold {stacked.shape[1]} tokens, cu_seqlens says {int(cu[-1])}")
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel())
    return stacked.index_select(1, inverse.to(stacked.device))


@dataclass(frozen=True)
class RelayoutPlan:
    """One rank's side of an all-to-all of tokens between two layouts."""

    send_index: list  # per destination rank: local rows to send
    recv_index: list  # per source rank: local rows the received tokens go to

    def inverse(self) -> "RelayoutPlan":
        return RelayoutPlan(self.recv_index, self.send_index)


def relayout_plan_to_contiguous(tokens_of_rank: Callable[[int], torch.Tensor], cp_rank: int, cp_size: int,
                                local: int) -> RelayoutPlan:
    """The all-to-all plan that moves this rank's tokens from a layout into the contiguous one.

    tokens_of_rank(r): the global token indices rank r holds in that layout, in its local order;
    local: tokens per rank."""
    mine = tokens_of_rank(cp_rank)
    dest = mine // local
    send_index = [torch.nonzero(dest == d).flatten() for d in range(cp_size)]
    recv_index = []
    for src in range(cp_size):
        theirs = tokens_of_rank(src)
        # the source sends its rows for us in its local order; they land at global - start
        recv_index.append(theirs[theirs // local == cp_rank] - cp_rank * local)
    return RelayoutPlan(send_index, recv_index)
