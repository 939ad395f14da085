"""The CP context: the contiguous piece of one packed batch this rank works on, and the relayout
that brings a layout's tokens there and back."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from linattn.checks import require

from ..groups import group_rank, group_size
from .comm import relayout_tokens
from .layout import (LAYOUTS, RelayoutPlan, check_partition, global_cu_seqlens, padded_runs,
                     relayout_plan_to_contiguous, zigzag_index)

__all__ = ["BACKENDS", "CPContext", "Relayout", "build_context"]

# the CP ops' variants: rank-to-rank exchange around the single-process op, or fla's CP kernels
BACKENDS = ("exchange", "fla")


@dataclass(frozen=True, eq=False)
class Relayout:
    """Moves packed tensors ``[1, T_local, ...]`` from ``layout`` into the contiguous piece and back:
    one all-to-all over ``group`` per dtype; the identity when ``plan`` is None (contiguous)."""

    layout: str
    group: object
    local_tokens: int
    plan: RelayoutPlan | None = None

    def to_contiguous(self, *tensors: torch.Tensor):
        """Tensors in ``layout`` -> the contiguous piece (one tensor, or a tuple for several)."""
        return self._move(tensors, self.plan)

    def from_contiguous(self, *tensors: torch.Tensor):
        """Inverse of ``to_contiguous``."""
        return self._move(tensors, None if self.plan is None else self.plan.inverse())

    def _move(self, tensors, plan):
        for t in tensors:
            if t.dim() < 2 or t.shape[0] != 1 or t.shape[1] != self.local_tokens:
                raise ValueError(
                    f"CP tensors must be packed [1, T_local={self.local_tokens}, ...], got shape {tuple(t.shape)}"
                )
        if plan is None:
            return tensors[0] if len(tensors) == 1 else tensors
        require(self.group is not None, "cp_group",
                f"is None (no CP): a {self.layout!r} relayout needs the process group")
        # one all-to-all per dtype: concatenate the features of same-dtype tensors
        out = [None] * len(tensors)
        by_dtype: dict = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = [tensors[i].reshape(1, self.local_tokens, -1) for i in idx]
            moved = relayout_tokens(torch.cat(flat, dim=2) if len(flat) > 1 else flat[0], plan, self.group)
            for i, piece in zip(idx, moved.split([f.shape[2] for f in flat], dim=2)):
                out[i] = piece.reshape(tensors[i].shape)
        return out[0] if len(out) == 1 else tuple(out)


@dataclass(frozen=True, eq=False)
class CPContext:
    """This rank's contiguous piece of one packed batch, built once per forward by ``build_context``.

    The piece is global tokens ``[start, end)``. ``first_seq_offset[r]`` is how many tokens of rank
    r's first sequence lie before rank r's piece (0: the sequence starts at the piece), known for
    every rank so all ranks agree on who exchanges what. ``relayout`` moves tensors between the
    batch's layout and the piece.
    """

    group: object
    cp_rank: int
    cp_size: int
    cu_seqlens: torch.Tensor  # global, CPU int64; padded: the runs (layout.padded_runs)
    local_cu_seqlens: torch.Tensor  # of the contiguous piece, CPU int64
    first_seq_offset: tuple
    relayout: Relayout
    cu_seqlens_padded: torch.Tensor | None = None  # global, CPU int64; None: no pads
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def layout(self) -> str:
        return self.relayout.layout

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def local_tokens(self) -> int:
        return self.total_tokens // self.cp_size

    @property
    def start(self) -> int:
        return self.cp_rank * self.local_tokens

    @property
    def end(self) -> int:
        return self.start + self.local_tokens

    @property
    def first_seq_continues(self) -> bool:
        """The piece's first sequence started on an earlier rank (state/halo come in)."""
        return self.first_seq_offset[self.cp_rank] > 0

    @property
    def last_seq_continues(self) -> bool:
        """The piece's last sequence goes on on the next rank (state goes out)."""
        nxt = self.cp_rank + 1
        return nxt < self.cp_size and self.first_seq_offset[nxt] > 0

    @property
    def first_sequence(self) -> int:
        """Global index of the piece's first sequence (packings without empty sequences: see
        ``check_state_packing``); the piece holds sequences ``first_sequence`` on, one per entry
        of ``local_cu_seqlens`` but the last."""
        return int(torch.searchsorted(self.cu_seqlens[1:], torch.tensor(self.start), right=True))

    @property
    def ending_sequences(self) -> int:
        """How many of the piece's sequences end in it (all but a last one that goes on)."""
        return self.local_cu_seqlens.numel() - 1 - int(self.last_seq_continues)

    def check_state_packing(self) -> None:
        """ValueError unless every sequence holds a token: per-sequence states are matched to the
        piece's sequences by index, which an empty sequence (dropped from the piece) would shift,
        and the batch is not padded (the ops' runs are not its sequences)."""
        require(self.cu_seqlens_padded is None, "cu_seqlens_padded",
                "is not taken with states in or out under CP: give the unpadded batch")
        require(bool((self.cu_seqlens.diff() > 0).all()), "cu_seqlens",
                f"must hold no empty sequence when states are passed under CP, got {self.cu_seqlens.tolist()}")

    def local_cu_seqlens_on(self, device, dtype=torch.int32) -> torch.Tensor:
        key = (str(device), dtype)
        if key not in self._on_device:
            self._on_device[key] = self.local_cu_seqlens.to(device=device, dtype=dtype)
        return self._on_device[key]


def build_context(
    cu_seqlens,
    cp_group,
    layout: str = "contiguous",
    *,
    total_tokens: int | None = None,
    cp_rank: int | None = None,
    cp_size: int | None = None,
    tokens_of_rank: Callable[[int], torch.Tensor] | None = None,
    cu_seqlens_padded=None,
) -> CPContext:
    """The CP context of this rank for one packed batch.

    cu_seqlens: GLOBAL boundaries of the packed batch (any integer dtype/device).
    cp_group: the CP process group; None means no CP (one rank). ``cp_rank``/``cp_size``
    override the group's, for metadata-only use (the ops then refuse to run without a group).
    layout: one of LAYOUTS, the layout the batch's tokens arrive in.
    total_tokens: global token count, checked against ``cu_seqlens[-1]`` when given.
    tokens_of_rank: for a layout outside LAYOUTS (``layout`` then only names it): the global
    token indices rank r holds in it, in its local order.
    cu_seqlens_padded: padded THD (see ``layout``): GLOBAL boundaries of the padded sequences,
    each padded length a multiple of 2*cp_size; the batch's tokens (and ``total_tokens``) are
    the padded ones, laid out over the padded sequences, and the ops run on ``padded_runs``.
    """
    cp_size = group_size(cp_group) if cp_size is None else cp_size
    cp_rank = group_rank(cp_group) if cp_rank is None else cp_rank
    if cu_seqlens_padded is None:
        cu = layout_cu = global_cu_seqlens(cu_seqlens, total_tokens)
    else:
        layout_cu, cu = padded_runs(cu_seqlens, cu_seqlens_padded, cp_size, total_tokens)
    if tokens_of_rank is None:
        check_partition(layout_cu, cp_size, layout)
    else:
        require(layout not in LAYOUTS, "tokens_of_rank", f"is for layouts outside {LAYOUTS}, got layout={layout!r}")
        check_partition(cu, cp_size, "contiguous")
    local = int(cu[-1]) // cp_size

    starts = torch.arange(cp_size, dtype=torch.int64) * local
    seq_of_start = torch.searchsorted(cu[1:], starts, right=True)  # sequence holding each start
    first_seq_offset = tuple(int(v) for v in (starts - cu[seq_of_start.clamp(max=cu.numel() - 1)]).tolist())
    if local == 0:
        first_seq_offset = (0,) * cp_size

    start, end = cp_rank * local, (cp_rank + 1) * local
    local_cu = torch.unique_consecutive(cu.clamp(min=start, max=end) - start)

    if layout == "zigzag":
        tokens_of_rank = functools.partial(zigzag_index, layout_cu, cp_size=cp_size)
    plan = None
    if tokens_of_rank is not None and cp_size > 1:
        plan = relayout_plan_to_contiguous(tokens_of_rank, cp_rank, cp_size, local)
    return CPContext(
        group=cp_group, cp_rank=cp_rank, cp_size=cp_size, cu_seqlens=cu, local_cu_seqlens=local_cu,
        first_seq_offset=first_seq_offset, relayout=Relayout(layout, cp_group, local, plan),
        cu_seqlens_padded=None if cu_seqlens_padded is None else layout_cu,
    )


def check_call(cp_context, backend, piece_op) -> None:
    """ValueError naming the argument of a CP op call that cannot run."""
    require(isinstance(cp_context, CPContext), "cp_context",
            f"must be a CPContext (linattn.parallel.cp.build_context), got {type(cp_context).__name__}")
    require(backend is None or backend in BACKENDS, "backend", f"must be None or one of {BACKENDS}, got {backend!r}")
    require(piece_op is None or backend == "exchange", "piece_op",
            f"is the single-process op of backend='exchange'; got backend={backend!r}")
    require(cp_context.group is not None or cp_context.cp_size == 1, "cp_context",
            f"has no process group (None: no CP) but cp_size={cp_context.cp_size}: it is metadata only")
