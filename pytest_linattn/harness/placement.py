"""Where a sharded layer runs (`Placement`) and which tokens of a packed batch each rank holds.

Ranks: global rank = tp_rank + tp * (cp_rank + cp * dp_rank) (Megatron's order, as
`linattn.parallel.new_groups`); a client that makes its own groups must lay them out the same way.
A pipeline of pp stages (the pipeline checks, `harness.pipeline`) puts the stage outermost:
global rank = tp_rank + tp * (cp_rank + cp * stage), every stage holding the same tokens on its
(tp_rank, cp_rank) as every other stage (`linattn.parallel.new_pipeline_group`); the checks of
one layer take pp = 1 only (`check_one_stage`).

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
    zigzag-padded
                padded THD (Megatron's / Transformer Engine's cu_seqlens_padded): every sequence
                is followed by pads up to the next multiple of 2*cp (2*cp*tp with SP) tokens, and
                the padded sequences are laid out as zigzag; indices are into the padded batch
                (`padded_cu_seqlens`, `real_positions`). linattn: cp_layout="zigzag" with
                forward(..., cu_seqlens_padded=).
    SP          the CP rank's tokens are cut again into tp contiguous slices; TP rank t holds
                slice t. Without SP every TP rank holds its CP rank's tokens (each is checked).

On one sequence zigzag and fla-zigzag coincide; with several they differ, and a layer fed the
other one fails with O(1) errors everywhere (the harness then says the layouts differ).

This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from linattn.checks import positive_int

from ..seqlens import LAYOUTS as UNPADDED_LAYOUTS
from ..seqlens import cu_seqlens_bounds

PADDED_LAYOUTS = ("zigzag-padded",)
LAYOUTS = UNPADDED_LAYOUTS + PADDED_LAYOUTS

# what each layout is, in the words of the messages that name one
LAYOUT_WORDS = {
    "contiguous": "each CP rank one contiguous piece of the packed batch; fla's build_cp_context(layout='contiguous')",
    "zigzag": "each sequence cut in 2*cp chunks, rank r holding chunks r and 2*cp-1-r; linattn's and Megatron's zigzag",
    "fla-zigzag": "the whole packed batch cut in 2*cp intervals, rank r holding intervals r and 2*cp-1-r; "
                  "fla's build_cp_context(layout='zigzag')",
    "zigzag-padded": "each sequence padded to a multiple of 2*cp, then zigzag over the padded sequences; Megatron's "
                     "cu_seqlens_padded",
}

__all__ = ["LAYOUTS", "LAYOUT_WORDS", "PADDED_LAYOUTS", "Placement", "as_cu_seqlens", "check_fits", "check_one_stage",
           "default_process_groups", "padded_batch", "padded_cu_seqlens", "rank_token_index", "real_positions"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a sharded layer runs: TP size, CP size and layout, sequence parallel on/off, and the
    pipeline stages a stack of layers is split into (pp; 1 for one layer)."""

    tp: int = 1
    cp: int = 1
    cp_layout: str = "contiguous"
    sequence_parallel: bool = False
    pp: int = 1

    def __post_init__(self):
        positive_int(self.tp, "Placement.tp")
        positive_int(self.cp, "Placement.cp")
        positive_int(self.pp, "Placement.pp")
        if self.cp_layout not in LAYOUTS:
            raise ValueError(f"Placement.cp_layout must be one of {LAYOUTS}, got {self.cp_layout!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"Placement.sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Placement.sequence_parallel needs tp > 1 (SP splits tokens over the TP group)")

    @property
    def size(self) -> int:
        """Ranks one copy of the layer (of the stack, with pp > 1) spans: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def name(self) -> str:
        """`tp2-sp/cp2-zigzag`, `tp4`, `cp2-contiguous`, `tp2/pp2`; `replicated` for one rank."""
        parts = []
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("-sp" if self.sequence_parallel else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_layout}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        return "/".join(parts) or "replicated"

    def __str__(self) -> str:
        return self.name

    @property
    def padded(self) -> bool:
        """The ranks hold a padded batch (`padded_cu_seqlens`)."""
        return self.cp_layout in PADDED_LAYOUTS

    @property
    def fla_layout(self) -> str:
        """The `layout=` of fla's `build_cp_context` that puts tokens where this placement does:
        "contiguous" or "zigzag" (for cp_layout "fla-zigzag"). ValueError for "zigzag" (per
        sequence), which fla has no layout for."""
        if self.cp_layout in ("zigzag", *PADDED_LAYOUTS):
            raise ValueError(f"Placement.cp_layout {self.cp_layout!r} cuts each sequence; fla's build_cp_context has "
                             "no such layout (its layout='zigzag' cuts the whole batch: "
                             "Placement(cp_layout='fla-zigzag'))")
        return {"contiguous": "contiguous", "fla-zigzag": "zigzag"}[self.cp_layout]


def check_seed(seed) -> int:
    """ValueError unless seed is an int (a bool is not)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return int(seed)


def check_placements(placements) -> list:
    """The placements as a list; ValueError unless a non-empty sequence of Placement."""
    placements = list(placements)
    if not placements or not all(isinstance(p, Placement) for p in placements):
        raise ValueError("placements must be a non-empty sequence of Placement")
    return placements


def check_one_stage(placement: Placement, check: str) -> None:
    """ValueError unless `placement` is one pipeline stage (pp = 1): `check` runs one layer on
    every rank; a stack split into stages has checks of its own."""
    __tracebackhide__ = True
    if placement.pp != 1:
        raise ValueError(f"Placement.pp must be 1 for {check}, which runs one layer on every rank; got "
                         f"{placement.name}: a stack split into pipeline stages is checked by assert_pipeline_parity "
                         "and assert_pipeline_decode_parity")


def default_process_groups(placement: Placement):
    """(tp_group, cp_group) of this rank from `linattn.parallel.new_groups` (None for a size of 1);
    with pp > 1 the groups inside this rank's stage (the stages are outermost)."""
    from linattn.parallel import new_groups

    return new_groups(placement.tp, placement.cp)


def as_cu_seqlens(cu_seqlens) -> torch.Tensor:
    """cu_seqlens (a tensor or a list) as an int32 tensor; ValueError unless it is a packing."""
    __tracebackhide__ = True
    cu = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.as_tensor(cu_seqlens)
    cu_seqlens_bounds(cu)
    return cu.to(torch.int32)


def padded_cu_seqlens(cu_seqlens, placement: Placement) -> torch.Tensor:
    """int32 boundaries of the padded sequences the ranks hold: every length rounded up to a
    multiple of 2*cp (2*cp*tp with SP); cu_seqlens itself for an unpadded layout."""
    cu = as_cu_seqlens(cu_seqlens)
    if not placement.padded:
        return cu
    unit = 2 * placement.cp * (placement.tp if placement.sequence_parallel else 1)
    lengths = cu.diff().long()
    return torch.cat([cu.new_zeros(1), ((lengths + unit - 1) // unit * unit).cumsum(0).to(torch.int32)])


def real_positions(cu_seqlens, placement: Placement) -> torch.Tensor:
    """Where the real tokens lie in the batch the ranks hold (int64, in token order): position
    `padded_cu_seqlens[i] + j` for token j of sequence i; `arange(T)` for an unpadded layout."""
    cu = as_cu_seqlens(cu_seqlens).long()
    if not placement.padded:
        return torch.arange(int(cu[-1]))
    padded = padded_cu_seqlens(cu, placement).long()
    sequence = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())
    return torch.arange(int(cu[-1])) + (padded[:-1] - cu[:-1])[sequence]


def padded_batch(x: torch.Tensor, dy: torch.Tensor, cu_seqlens, placement: Placement):
    """(x, dy) of the batch the ranks hold: for a padded layout the real tokens at
    `real_positions`, pads between them; x, dy themselves otherwise. A pad's input is random
    (seeded; a pad that reaches a real token shows), its output cotangent zero: the loss mask,
    as a trainer's, so a pad's output enters no gradient."""
    if not placement.padded:
        return x, dy
    padded = padded_cu_seqlens(cu_seqlens, placement)
    gen = torch.Generator().manual_seed(int(padded[-1]) + 7919 * padded.numel())
    shape = (x.shape[0], int(padded[-1]), *x.shape[2:])
    x_padded = torch.randn(shape, generator=gen, dtype=x.dtype)
    dy_padded = torch.zeros(shape, dtype=dy.dtype)
    where = real_positions(cu_seqlens, placement)
    x_padded[:, where], dy_padded[:, where] = x, dy
    return x_padded, dy_padded


def check_fits(bounds: list[int], placement: Placement, *, padded_ok: bool = False) -> None:
    """ValueError unless the packing `bounds` can be laid out for `placement`. padded_ok: the
    caller handles padded layouts (sharded parity does; the other checks do not)."""
    __tracebackhide__ = True
    if placement.padded:
        if not padded_ok:
            raise ValueError(f"Placement.cp_layout {placement.cp_layout!r}: padded layouts are checked by "
                             "assert_sharded_parity / assert_parity_cases only")
        return  # the pads make any packing fit
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
    module docstring's layout; padded layouts: into the padded batch). ValueError when the
    packing does not fit the placement."""
    cu = as_cu_seqlens(cu_seqlens)
    check_fits([int(b) for b in cu.tolist()], placement, padded_ok=True)
    cu = padded_cu_seqlens(cu, placement)  # the padded layouts are zigzag over the padded sequences
    bounds = [int(b) for b in cu.tolist()]
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
