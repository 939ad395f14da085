"""The parity records as people read them: the summary table and the report files.

`format_summary(records)` is the table the plugin prints at the end of a run; `write_report`
writes every record as JSON plus one error heatmap (token × head or feature) per failure. The
records are `pytest_linattn.parity.check`'s. This module imports no pytest and no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["format_number", "format_summary", "format_table", "write_report"]


# --------------------------------------------------------------------------------------------
# Tables


def format_number(x, fmt="{:.2e}") -> str:
    """`fmt` of x; '-' for None, nan and inf as words."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return fmt.format(x)


def format_table(header, rows, indent="  ") -> list[str]:
    """Lines of left-aligned columns, as wide as their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(header)] + [fmt(r) for r in rows]


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _label(rec) -> str:
    # A dict's rows are named by key; the comparison's name tells apart, say, rank 0 from rank 1.
    group = rec.get("group")
    return rec["tensor"] if not group or group in ("output", rec["tensor"]) else f"{group}: {rec['tensor']}"


def format_summary(records, max_rows: int = 12) -> str:
    """A plain table of the checks, worst margin (rtol / error) first; failures always listed
    first (then those of tests that were expected to fail: a record with `"xfail": True`, row
    `xfail`), passing checks cut to `max_rows` rows in all. Empty string when there are none."""
    records = list(records)
    if not records:
        return ""

    def kind(r):  # 0 failed, 1 failed as the test expected (xfail), 2 passed
        return 2 if r["passed"] else 1 if r.get("xfail") else 0

    order = sorted(records, key=lambda r: (kind(r), r["margin"] if not math.isnan(r["margin"]) else 0.0))
    n_fail = sum(kind(r) == 0 for r in records)
    n_xfail = sum(kind(r) == 1 for r in records)
    shown = order[:max(max_rows, n_fail + n_xfail)]
    rows = [[_shorten(str(r["test"]), 60), _label(r), format_number(r["error"]), format_number(r["rtol"]),
             format_number(r["margin"], "{:.3g}"), ("FAIL", "xfail", "ok")[kind(r)]] for r in shown]
    expected = f", {n_xfail} failed in tests marked xfail (expected)" if n_xfail else ""
    lines = [f"linattn parity: {len(records)} check(s), {n_fail} failed{expected}; worst margin (rtol/error) first"]
    lines += format_table(["test", "tensor", "error", "rtol", "margin", ""], rows)
    if len(order) > len(shown):
        rest = order[len(shown):]
        lines.append(f"  ... {len(rest)} more passing check(s), margin >= {format_number(rest[0]['margin'], '{:.3g}')}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Report files


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # strict JSON has no NaN/Infinity
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_.")[:120] or "unnamed"


def write_report(records, directory, notes: list | None = None) -> list[Path]:
    """Write `parity.json` (every record) and one PNG error heatmap per failure that has an
    error map, named `<test>__<comparison: tensor>.png` (sanitised). Returns the paths written.

    matplotlib is optional (the plugin runs in other projects' test runs, the JSON holds the
    same maps): without it no PNG is drawn, and one line saying so is appended to `notes`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    records = list(records)
    json_path = directory / "parity.json"
    json_path.write_text(json.dumps(_jsonable(records), indent=1))
    written, used = [json_path], set()
    failures = [rec for rec in records if not rec["passed"] and "map" in rec]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if failures and notes is not None:
            notes.append(f"no PNG: matplotlib is not installed ({len(failures)} error map(s) are in {json_path})")
        return written
    for rec in failures:
        stem = f"{_safe_name(str(rec['test']))}__{_safe_name(_label(rec))}"
        name, n = stem, 1
        while name in used:
            n += 1
            name = f"{stem}-{n}"
        used.add(name)
        written.append(_heatmap(rec, directory / f"{name}.png"))
    return written


def _heatmap(rec: dict, path: Path) -> Path:
    # Figure without pyplot: no global backend switch, renders with Agg.
    import matplotlib
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    grid = np.array(rec["map"], dtype=float)
    xb, yb = rec["map_x_bin"], rec["map_y_bin"]
    fig = Figure(figsize=(10, 3 + min(grid.shape[0], 32) * 0.12))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    extent = (0, grid.shape[1] * xb, 0, grid.shape[0] * yb)
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", origin="lower", interpolation="nearest",
                   extent=extent, cmap=matplotlib.colormaps["magma"].with_extremes(bad="cyan"))  # cyan: NaN/Inf
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for b in rec.get("cu_seqlens", [])[1:-1]:
        ax.axvline(b, color="white", lw=0.6, ls="--")
    for b in rec.get("shard_edges", []):
        ax.axvline(b, color="lime", lw=0.8)
    marks = (["dashed: sequence starts"] if len(rec.get("cu_seqlens", [])) > 2 else []) + (
        [f"green: shard edges ({', '.join(rec['shard_ranks'])})"] if rec.get("shard_edges") else [])
    ax.set_xlabel(rec["map_x"] + (f" (bins of {xb})" if xb > 1 else "") + (f"; {'; '.join(marks)}" if marks else ""))
    ax.set_ylabel(rec["map_y"] + (f" (bins of {yb})" if yb > 1 else ""))
    ax.set_title(f"{rec['test']} :: {_label(rec)}  error {format_number(rec['error'])}  rtol {format_number(rec['rtol'])}"
                 + (f"  worst: {rec['worst_text']}" if rec.get("worst_text") else ""), fontsize=8)
    fig.colorbar(im, ax=ax, label="error contribution")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
