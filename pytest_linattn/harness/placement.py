"""Where a sharded layer runs (`Placement`) and which tokens of a packed batch each rank holds.

Ranks: global rank = tp_rank + tp * (cp_rank + cp * dp_rank) (Megatron's order, as
`linattn.parallel.new_groups`); a client that makes its own groups must lay them out the same way.

Token layout (computed here from this definition, not by the library under test, so a layout
bug shared by a layer and its helpers still shows). T = cu_seqlens[-1]:
    contiguous  CP rank r holds tokens [r*T/cp, (r+1)*T/cp). fla: build_cp_context(layout=
                "contiguous"); linattn: cp_layout="contiguous"; Megatron without load balancing.
    zigzag      every sequence is cut into 2*cp equal chunks; CP rank r holds chunks r and
                2*cp-1-r of each sequence, sequences in order. linattn: cp_layout="zigzag";
                Megatron's / Transformer Engine's THD load balancing. Not fla's "zigzag".
    fla-zigzag  the whole packed batch is cut into 2*cp equal intervals of T/(2*cp) tokens
                (sequences cross them freely); CP rank r holds intervals r and 2*cp-1-r, in that
                order. fla: build_cp_context(layout="zigzag") (its documented rule).
    SP          the CP rank's tokens are cut again into tp contiguous slices; TP rank t holds
                slice t. Without SP every TP rank holds its CP rank's tokens (each is checked).

On one sequence zigzag and fla-zigzag coincide; with several they differ, and a layer fed the
other one fails with O(1) errors everywhere (the harness then says the layouts differ).

This module imports no pytest.
"""

from __future__ import annotations

import dataclasses

import torch

from linattn.checks import positive_int

from ..seqlens import LAYOUTS, cu_seqlens_bounds

# what each layout is, in the words of the messages that name one
LAYOUT_WORDS = {
    "contiguous": "each CP rank one contiguous piece of the packed batch; fla's build_cp_context(layout='contiguous')",
    "zigzag": "each sequence cut in 2*cp chunks, rank r holding chunks r and 2*cp-1-r; linattn's and Megatron's zigzag",
    "fla-zigzag": "the whole packed batch cut in 2*cp intervals, rank r holding intervals r and 2*cp-1-r; "
                  "fla's build_cp_context(layout='zigzag')",
}

__all__ = ["LAYOUTS", "LAYOUT_WORDS", "Placement", "as_cu_seqlens", "check_fits", "default_process_groups",
           "rank_token_index"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a sharded layer runs: TP size, CP size and layout, sequence parallel on/off."""

    tp: int = 1
    cp: int = 1
    cp_layout: str = "contiguous"
    sequence_parallel: bool = False

    def __post_init__(self):
        positive_int(self.tp, "Placement.tp")
        positive_int(self.cp, "Placement.cp")
        if self.cp_layout not in LAYOUTS:
            raise ValueError(f"Placement.cp_layout must be one of {LAYOUTS}, got {self.cp_layout!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"Placement.sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Placement.sequence_parallel needs tp > 1 (SP splits tokens over the TP group)")

    @property
    def size(self) -> int:
        """Ranks one copy of the layer spans: tp * cp."""
        return self.tp * self.cp

    @property
    def name(self) -> str:
        """`tp2-sp/cp2-zigzag`, `tp4`, `cp2-contiguous`; `replicated` for one rank."""
        parts = []
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("-sp" if self.sequence_parallel else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_layout}")
        return "/".join(parts) or "replicated"

    def __str__(self) -> str:
        return self.name

    @property
    def fla_layout(self) -> str:
        """The `layout=` of fla's `build_cp_context` that puts tokens where this placement does:
        "contiguous" or "zigzag" (for cp_layout "fla-zigzag"). ValueError for "zigzag" (per
        sequence), which fla has no layout for."""
        if self.cp_layout == "zigzag":
            raise ValueError("Placement.cp_layout 'zigzag' cuts each sequence; fla's build_cp_context has no such "
                             "layout (its layout='zigzag' cuts the whole batch: Placement(cp_layout='fla-zigzag'))")
        return {"contiguous": "contiguous", "fla-zigzag": "zigzag"}[self.cp_layout]


def default_process_groups(placement: Placement):
    """(tp_group, cp_group) of this rank from `linattn.parallel.new_groups` (None for a size of 1)."""
    from linattn.parallel import new_groups

    return new_groups(placement.tp, placement.cp)


def as_cu_seqlens(cu_seqlens) -> torch.Tensor:
    """cu_seqlens (a tensor or a list) as an int32 tensor; ValueError unless it is a packing."""
    __tracebackhide__ = True
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.as_tensor(cu_seqlens)
    cu_seqlens_bounds(cu)
    return cu.to(torch.int32)


def check_fits(bounds: list[int], placement: Placement) -> None:
    """ValueError unless the packing `bounds` can be laid out for `placement`."""
    __tracebackhide__ = True
    T, cp, tp = bounds[-1], placement.cp, placement.tp
    if placement.cp_layout == "contiguous" and T % cp:
        raise ValueError(f"cu_seqlens: contiguous CP needs the total token count divisible by cp: {T} % {cp} != 0")
    if placement.cp_layout == "fla-zigzag" and T % (2 * cp):
        raise ValueError(f"cu_seqlens: fla-zigzag CP needs the total token count divisible by 2*cp: "
                         f"{T} % {2 * cp} != 0")
    if placement.cp_layout == "zigzag":
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            if (end - start) % (2 * cp):
                raise ValueError(f"cu_seqlens: zigzag CP needs every sequence length divisible by 2*cp={2 * cp}; "
                                 f"sequence {i} has {end - start} tokens")
    if placement.sequence_parallel and (T // cp) % tp:
        raise ValueError(f"cu_seqlens: sequence parallel needs each CP rank's token count divisible by tp: "
                         f"{T // cp} % {tp} != 0")


def rank_token_index(cu_seqlens, placement: Placement, tp_rank: int = 0, cp_rank: int = 0) -> torch.Tensor:
    """Global token indices (int64) that rank (tp_rank, cp_rank) holds, in its local order (the
    module docstring's layout). ValueError when the packing does not fit the placement."""
    cu = as_cu_seqlens(cu_seqlens)
    bounds = [int(b) for b in cu.tolist()]
    check_fits(bounds, placement)
    tp, cp = placement.tp, placement.cp
    if not (isinstance(tp_rank, int) and 0 <= tp_rank < tp and isinstance(cp_rank, int) and 0 <= cp_rank < cp):
        raise ValueError(f"rank_token_index: tp_rank must be in [0, {tp}) and cp_rank in [0, {cp}), got {tp_rank!r}, {cp_rank!r}")
    if placement.cp_layout == "contiguous":
        n = bounds[-1] // cp
        index = torch.arange(cp_rank * n, (cp_rank + 1) * n)
    elif placement.cp_layout == "fla-zigzag":
        n = bounds[-1] // (2 * cp)
        index = torch.cat([torch.arange(c * n, (c + 1) * n) for c in (cp_rank, 2 * cp - 1 - cp_rank)])
    else:
        pieces = [torch.zeros(0, dtype=torch.int64)]
        for start, end in zip(bounds, bounds[1:]):
            chunk = (end - start) // (2 * cp)
            for c in (cp_rank, 2 * cp - 1 - cp_rank):
                pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        index = torch.cat(pieces)
    if placement.sequence_parallel:
        n = index.numel() // tp
        index = index[tp_rank * n:(tp_rank + 1) * n]
    return index
