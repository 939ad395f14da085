"""The checkpoint round trip's comparisons and words: a parameter against the replicated layer's,
section by section, its wrong rows named by section and head (`pytest_linattn.harness.checkpoint`).

Where a row lies comes from `linattn.layers.parameter_layouts` of the layer's config: the dim TP
splits (dim 1 of a row-parallel output projection, dim 0 otherwise) is a concatenation of blocks,
each a named section (`[q | k | v]` of GDN's in_proj_qkv and conv, `[q | k | v | z]` per key
head of Qwen3-Next's in_proj_qkvz), each section by its key or value heads; a per-head vector
(A_log, dt_bias) is one row per head. Without a config, a row is a row. A section is wrong when
its relative Frobenius error is over rtol (NaN always); its wrong rows are those whose error is
over rtol of the section's RMS row norm. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["Rows", "describe_rows", "row_table", "runs", "shape_line", "value_lines"]


def runs(indices) -> str:
    """Sorted indices as runs: [0, 1, 2, 5] -> "0..2, 5"."""
    out, start, prev = [], None, None
    for i in sorted(set(int(i) for i in indices)):
        if start is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(f"{start}..{prev}" if prev > start else f"{start}")
        start = prev = i
    if start is not None:
        out.append(f"{start}..{prev}" if prev > start else f"{start}")
    return ", ".join(out)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where each index of a parameter's head dim (`dim`) lies: its section, head kind, head."""

    dim: int
    section: tuple
    kind: tuple
    head: tuple

    @property
    def axis(self) -> str:
        return "cols" if self.dim == 1 else "rows"

    @classmethod
    def plain(cls, shape) -> Rows:
        n = shape[0] if len(shape) else 1
        return cls(0, (None,) * n, (None,) * n, (None,) * n)


def row_table(config, name: str, shape) -> Rows:
    """The rows of the replicated layer's parameter `name` of `shape`, by `config`'s layouts
    (plain rows when config is None, the name unknown or the shape another)."""
    if config is None:
        return Rows.plain(shape)
    from linattn.layers import parameter_layouts

    layout = parameter_layouts(config).get(name)
    if layout is None or tuple(shape) != tuple(layout.shape):
        return Rows.plain(shape)
    dim = 1 if layout.split == "cols" else 0
    n = layout.shape[dim]
    if layout.split == "replicated":
        return dataclasses.replace(Rows.plain(layout.shape), dim=dim)
    blocks = layout.blocks or (n // layout.groups,)
    keys = layout.key_blocks or (False,) * len(blocks)
    names = layout.names or (None,) * len(blocks)
    section, kind, head = [], [], []
    for g in range(layout.groups):
        for size, key, part in zip(blocks, keys, names):
            heads = (config.num_k_heads if key else config.num_v_heads) // layout.groups
            per_head = size // heads
            for o in range(size):
                section.append(part)
                kind.append("key" if key else "value")
                head.append(g * heads + o // per_head)
    return Rows(dim, tuple(section), tuple(kind), tuple(head))


def describe_rows(rows: Rows, indices, *, sections: bool = True) -> str:
    """The indices' sections and heads: "section k key heads 2..3 (rows 48..63), section v ..."."""
    groups: dict = {}
    for i in sorted(set(indices)):
        groups.setdefault(rows.section[i] if sections else None, []).append(i)
    words = []
    for part, idx in groups.items():
        axis = rows.axis if len(idx) > 1 else rows.axis[:-1]
        kinds = {rows.kind[i] for i in idx}
        heads = sorted({rows.head[i] for i in idx if rows.head[i] is not None})
        text = f"section {part} " if part else ""
        if heads and len(kinds) == 1:
            text += f"{kinds.pop()} head{'s' * (len(heads) > 1)} {runs(heads)} ({axis} {runs(idx)})"
        else:
            text += f"{axis} {runs(idx)}"
        words.append(text)
    return ", ".join(words)


def _rows_of(t: torch.Tensor, dim: int) -> torch.Tensor:
    t = t.reshape(1) if t.dim() == 0 else t
    return t.movedim(dim, 0).reshape(t.shape[dim], -1)


def value_lines(name: str, diff: torch.Tensor, ref: torch.Tensor, rtol: float, rows: Rows,
                held: torch.Tensor | None = None) -> list[str]:
    """One line per section of parameter `name` whose error (`diff` = actual - `ref`, over the
    `held` elements: all by default) is over rtol: the section, its error, its wrong heads and rows."""
    d = _rows_of(diff.double(), rows.dim)
    r = _rows_of(ref.double(), rows.dim)
    h = torch.ones_like(d, dtype=torch.bool) if held is None else _rows_of(held, rows.dim)
    lines = []
    for part in dict.fromkeys(rows.section):
        idx = [i for i, s in enumerate(rows.section) if s == part and bool(h[i].any())]
        if not idx:
            continue
        mask = h[idx]
        dd = torch.where(mask, d[idx], torch.zeros((), dtype=torch.float64))
        rr = torch.where(mask, r[idx], torch.zeros((), dtype=torch.float64))
        ref_norm = float(torch.linalg.vector_norm(rr))
        err = float(torch.linalg.vector_norm(dd)) / (ref_norm or 1.0)
        if err <= rtol:  # NaN never passes
            continue
        scale = ref_norm / math.sqrt(len(idx)) or 1.0
        per_row = (torch.linalg.vector_norm(dd, dim=1) / scale).tolist()
        bad = [i for i, e in zip(idx, per_row) if not e <= rtol]
        where = (describe_rows(rows, bad, sections=False) if bad
                 else f"no single {rows.axis[:-1]} (the error is spread over the section)")
        lines.append(f"{name}{f' section {part}' if part else ''}: error {err:.1e}; wrong in {where}")
    return lines


def shape_line(name: str, actual: torch.Tensor, ref: torch.Tensor, rtol: float, rows: Rows, owner=None) -> str:
    """A parameter of another shape than the reference's: which of the reference's rows (heads,
    sections) it holds, found by matching its rows to the reference's, and which are missing.
    owner(actual) -> words or "": whose shard it is ("TP rank 0's shard at tp2")."""
    line = f"{name}: shape {tuple(actual.shape)}, the reference's {tuple(ref.shape)}"
    same_rest = (actual.dim() == ref.dim() and ref.dim() > 0
                 and all(a == b for k, (a, b) in enumerate(zip(actual.shape, ref.shape)) if k != rows.dim))
    if not same_rest:
        return line
    a, r = _rows_of(actual.double(), rows.dim), _rows_of(ref.double(), rows.dim)
    norms = torch.linalg.vector_norm(r, dim=1)
    matched, strangers = [], 0
    for row in a:
        close = torch.linalg.vector_norm(r - row, dim=1) <= rtol * norms
        free = [int(j) for j in torch.nonzero(close).flatten() if int(j) not in matched]
        if free:
            matched.append(free[0])
        else:
            strangers += 1
    if not matched:
        return f"{line}: none of its {rows.axis} is one of the reference's"
    line += f": it holds {describe_rows(rows, matched)}"
    whose = owner(actual) if owner else ""
    if whose:
        line += f" only, {whose} (a sharded parameter saved as the whole)"
    if strangers:
        line += f", and {strangers} {rows.axis} that are none of the reference's"
    missing = [j for j in range(r.shape[0]) if j not in matched]
    if missing:
        line += f"; missing {describe_rows(rows, missing)}"
    return line
