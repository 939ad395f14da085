"""Parity assertions with failure reports that say where a sharded computation broke.

`assert_parity(actual, expected, rtol=...)` compares one tensor, or a dict of tensors, by
relative Frobenius error ‖actual − expected‖ / ‖expected‖ computed in float64 on the CPU (so
`actual` may be a bf16 CUDA tensor). NaN or Inf never passes. A failure raises AssertionError
with one table row per failing tensor: its error, the tolerance, the max abs difference and the
worst element, located as (sequence, token in sequence, head) when `cu_seqlens` is given.

Every compared tensor also appends a record to the module-level `RECORDS` list; the pytest
plugin prints `format_summary(RECORDS)` at the end of the run and can `write_report` them as
JSON plus one error heatmap (token × head) per failure. This module imports no pytest.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

RECORDS: list[dict] = []
_sink: list[dict] = RECORDS  # where new records go; capture_records() swaps it

# The heatmap data kept for a failure is binned down to at most this many cells per axis, so
# a record stays small whatever the tensor size.
MAP_MAX_TOKENS = 512
MAP_MAX_HEADS = 64

_current_test: str | None = None


def set_current_test(nodeid: str | None) -> None:
    """Name the test that subsequent records belong to (the plugin calls this per test)."""
    global _current_test
    _current_test = nodeid


def current_test() -> str:
    """The test name for a new record: the one set, else pytest's PYTEST_CURRENT_TEST."""
    if _current_test is not None:
        return _current_test
    # pytest sets "path::test (call)" while a test runs; works without the plugin too.
    env = os.environ.get("PYTEST_CURRENT_TEST", "")
    return env.rsplit(" (", 1)[0] if env else "<no test>"


def clear_records() -> None:
    RECORDS.clear()


@contextmanager
def capture_records():
    """Send records made inside the block to a fresh list (yielded) instead of RECORDS, so
    checks that are meant to fail (the plugin's own tests) stay out of the run's summary."""
    global _sink
    saved, _sink = _sink, []
    try:
        yield _sink
    finally:
        _sink = saved


# --------------------------------------------------------------------------------------------
# The assertion


def assert_parity(actual, expected, *, rtol: float, name: str = "output", cu_seqlens=None) -> list[dict]:
    """Assert that `actual` matches `expected` within relative Frobenius error `rtol`.

    actual, expected: tensors, or dicts of tensors with the same keys (rows named by key).
        Shapes must match; dtypes and devices may differ (both go to float64 CPU).
    rtol: the tolerance on ‖actual − expected‖ / ‖expected‖ per tensor. Where expected is all
        zeros the absolute error ‖actual − expected‖ is used instead, and the report says so.
    name: label of the comparison in the failure message (a single tensor's row name).
    cu_seqlens: packed-sequence boundaries over dim 1 of `[1, T, ...]` tensors; used only to
        locate the worst element as (sequence, token within it). Tensors of other shapes in a
        dict (weight gradients, say) are located by multi-index.

    Returns the records appended to RECORDS (one per tensor) when everything passes.
    Raises ValueError for bad arguments (rtol, cu_seqlens, mixed tensor/dict, non-tensors).
    """
    rtol = _check_rtol(rtol)
    bounds = _check_cu_seqlens(cu_seqlens)
    results = []
    for label, a, e, problem in _pairs(actual, expected, name):
        results.append(_compare(label, a, e, rtol, bounds, group=name, problem=problem))
    _sink.extend(results)
    failed = [r for r in results if not r["passed"]]
    if failed:
        raise AssertionError(_failure_message(name, results, failed))
    return results


def _check_rtol(rtol) -> float:
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)):
        raise ValueError(f"rtol must be a number, got {type(rtol).__name__}")
    rtol = float(rtol)
    if not (rtol > 0 and math.isfinite(rtol)):
        raise ValueError(f"rtol must be positive and finite, got {rtol}")
    return rtol


def _check_cu_seqlens(cu_seqlens) -> list[int] | None:
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"cu_seqlens must be an integer torch.Tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    return bounds


def _as_tensor(x, what: str):
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:  # numpy arrays and nested lists are fine too
        return torch.as_tensor(x)
    except Exception as exc:  # noqa: BLE001 - reported as bad input
        raise ValueError(f"{what} must hold tensors, got {type(x).__name__}") from exc


def _pairs(actual, expected, name):
    """(label, actual, expected, problem) per tensor; a key on one side only pairs with None."""
    if isinstance(actual, Mapping) != isinstance(expected, Mapping):
        raise ValueError(
            f"actual and expected must both be tensors or both be dicts, got "
            f"{type(actual).__name__} and {type(expected).__name__}")
    if not isinstance(actual, Mapping):
        return [(name, _as_tensor(actual, "actual"), _as_tensor(expected, "expected"), None)]
    out = []
    for k in list(expected) + [k for k in actual if k not in expected]:
        a, e = actual.get(k), expected.get(k)
        if a is None and e is None and k in actual and k in expected:
            continue  # both sides agree there is nothing (an unused input's grad, say)
        problem = ("missing from actual" if k not in actual else "not in expected" if k not in expected
                   else "None in actual" if a is None else "None in expected" if e is None else None)
        out.append((str(k), _as_tensor(a, "actual"), _as_tensor(e, "expected"), problem))
    return out


def _record(test, group, label, rtol, *, error, passed, shape, problem=None, **extra) -> dict:
    margin = (math.inf if error == 0 else rtol / error) if math.isfinite(error) else 0.0
    rec = {"test": test, "group": group, "tensor": label, "error": error, "rtol": rtol,
           "margin": margin, "passed": passed, "shape": shape, "problem": problem}
    rec.update(extra)
    return rec


def _compare(label, a, e, rtol, bounds, group, problem=None) -> dict:
    test = current_test()
    if a is None or e is None:
        other = e if a is None else a
        return _record(test, group, label, rtol, error=math.inf, passed=False,
                       problem=problem or ("None in actual" if a is None else "None in expected"),
                       shape=list(other.shape) if other is not None else None)
    if a.is_complex() or e.is_complex():
        raise ValueError(f"actual/expected {label} must be real tensors, got {a.dtype} and {e.dtype}")
    if tuple(a.shape) != tuple(e.shape):
        return _record(test, group, label, rtol, error=math.inf, passed=False, shape=list(e.shape),
                       problem=f"shape mismatch: actual {tuple(a.shape)} vs expected {tuple(e.shape)}")
    shape = list(a.shape)
    a64 = a.detach().to(device="cpu", dtype=torch.float64)
    e64 = e.detach().to(device="cpu", dtype=torch.float64)
    info = {"dtype": str(a.dtype).replace("torch.", ""), "relative": True, "max_abs_diff": 0.0,
            "nonfinite": 0, "worst": None, "worst_text": ""}
    if a64.numel() == 0:
        return _record(test, group, label, rtol, error=0.0, passed=True, shape=shape, **info)
    diff = a64 - e64
    bad_a, bad_e = ~torch.isfinite(a64), ~torch.isfinite(e64)
    n_bad = int(bad_a.sum()) + int(bad_e.sum())
    norm_e = float(torch.linalg.vector_norm(e64))
    norm_d = float(torch.linalg.vector_norm(diff))
    relative = norm_e != 0.0 and math.isfinite(norm_e)
    error = norm_d / norm_e if relative else norm_d
    if n_bad:
        # NaN/Inf fail whatever the tolerance; point at the first one, in actual if it has any.
        flat = int(torch.nonzero((bad_a if bad_a.any() else bad_e).reshape(-1))[0])
        side = "actual" if bad_a.any() else "expected"
        error = math.nan if not math.isfinite(error) else error
        problem = f"{n_bad} non-finite value(s), first in {side}"
        passed = False
    else:
        flat = int(torch.argmax(diff.abs().reshape(-1)))
        problem = None if relative else "expected is all zeros: absolute error"
        passed = error <= rtol
    absdiff = diff.abs()
    info.update(relative=relative, nonfinite=n_bad,
                max_abs_diff=float(absdiff.nan_to_num(nan=math.inf).max()) if n_bad else float(absdiff.max()))
    info["worst"] = _locate(flat, shape, bounds)
    info["worst_text"] = _location_text(info["worst"])
    if not passed:
        info.update(_error_map(diff, norm_e if relative else 1.0, shape, bounds))
    return _record(test, group, label, rtol, error=error, passed=passed, shape=shape, problem=problem, **info)


def _fits_packed(shape, bounds) -> bool:
    return bounds is not None and len(shape) >= 2 and shape[0] == 1 and shape[1] == bounds[-1]


def _locate(flat: int, shape, bounds) -> dict:
    index, rest = [], flat
    for size in reversed(shape):
        index.append(rest % size)
        rest //= size
    index = index[::-1]
    loc = {"index": index}
    if _fits_packed(shape, bounds):
        tok = index[1]
        seq = bisect.bisect_right(bounds, tok) - 1  # skips empty sequences
        loc.update(sequence=seq, token_in_sequence=tok - bounds[seq], token=tok)
        if len(shape) >= 3:
            loc["head"] = index[2]
    elif len(shape) >= 3:
        loc.update(batch=index[0], token=index[1], head=index[2])
    return loc


def _location_text(loc: dict | None) -> str:
    if not loc:
        return ""
    idx = "(" + ", ".join(str(i) for i in loc["index"]) + ")"
    if "sequence" in loc:
        text = f"seq {loc['sequence']} token {loc['token_in_sequence']} (global {loc['token']})"
    elif "batch" in loc:
        text = f"batch {loc['batch']} token {loc['token']}"
    else:
        return f"index {idx}"
    if "head" in loc:
        text += f", head {loc['head']}"
    return f"{text} at {idx}"


def _error_map(diff: torch.Tensor, norm: float, shape, bounds) -> dict:
    """Error by (head, token): sqrt of the summed squared difference over the other dims, over
    ‖expected‖, so the cells add up in quadrature to the tensor's error. Binned if large."""
    sq = diff.nan_to_num(nan=math.inf).square()  # a NaN cell still shows as "off the scale"
    if sq.dim() >= 3:
        other = [d for d in range(sq.dim()) if d not in (1, 2)]
        grid = sq.sum(dim=other).T if other else sq.T  # [H, T]
        x_label, y_label = "token", "head"
    elif sq.dim() == 2:
        grid, x_label, y_label = sq, "dim 1", "dim 0"
    else:
        grid, x_label, y_label = sq.reshape(1, -1), "dim 0", ""
    grid, x_bin = _bin(grid, 1, MAP_MAX_TOKENS)
    grid, y_bin = _bin(grid, 0, MAP_MAX_HEADS)
    out = {"map": (grid.sqrt() / norm).tolist(), "map_x": x_label, "map_y": y_label,
           "map_x_bin": x_bin, "map_y_bin": y_bin}
    if _fits_packed(shape, bounds):
        out["map_x"] = "token"
        out["cu_seqlens"] = list(bounds)
    return out


def _bin(grid: torch.Tensor, dim: int, most: int):
    size = grid.shape[dim]
    step = -(-size // most)
    if step <= 1:
        return grid, 1
    pad = step * -(-size // step) - size
    if pad:
        pad_shape = list(grid.shape)
        pad_shape[dim] = pad
        grid = torch.cat([grid, grid.new_zeros(pad_shape)], dim=dim)
    new = list(grid.shape)
    new[dim:dim + 1] = [new[dim] // step, step]
    return grid.reshape(new).sum(dim=dim + 1), step


# --------------------------------------------------------------------------------------------
# Formatting


def _num(x, fmt="{:.2e}") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return fmt.format(x)


def _table(header, rows, indent="  ") -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(header)] + [fmt(r) for r in rows]


def _failure_message(name, results, failed) -> str:
    rows = []
    for r in failed:
        err = _num(r["error"])
        where = r.get("worst_text") or ""
        if r["problem"]:
            where = f"{r['problem']}" + (f"; {where}" if where else "")
        rows.append([r["tensor"], err, _num(r["rtol"]), _num(r.get("max_abs_diff")), where])
    head = f"parity failed for {name}: {len(failed)} of {len(results)} tensor(s) off (relative Frobenius error)"
    lines = [head] + _table(["tensor", "error", "rtol", "max|diff|", "worst element"], rows)
    return "\n".join(lines)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _label(rec) -> str:
    # A dict's rows are named by key; the comparison's name tells apart, say, rank 0 from rank 1.
    group = rec.get("group")
    return rec["tensor"] if not group or group in ("output", rec["tensor"]) else f"{group}: {rec['tensor']}"


def format_summary(records, max_rows: int = 12) -> str:
    """A plain table of the checks, worst margin (rtol / error) first; failures always listed
    first, passing checks cut to `max_rows` rows in all. Empty string when there are none."""
    records = list(records)
    if not records:
        return ""
    order = sorted(records, key=lambda r: (r["passed"], r["margin"] if not math.isnan(r["margin"]) else 0.0))
    n_fail = sum(not r["passed"] for r in records)
    shown = order[:max(max_rows, n_fail)]
    rows = [[_shorten(str(r["test"]), 60), _label(r), _num(r["error"]), _num(r["rtol"]),
             _num(r["margin"], "{:.3g}"), "ok" if r["passed"] else "FAIL"] for r in shown]
    lines = [f"linattn parity: {len(records)} check(s), {n_fail} failed; worst margin (rtol/error) first"]
    lines += _table(["test", "tensor", "error", "rtol", "margin", ""], rows)
    if len(order) > len(shown):
        rest = order[len(shown):]
        lines.append(f"  ... {len(rest)} more passing check(s), margin >= {_num(rest[0]['margin'], '{:.3g}')}")
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


def write_report(records, directory) -> list[Path]:
    """Write `parity.json` (every record) and one PNG error heatmap per failure that has an
    error map, named `<test>__<tensor>.png` (sanitised). Returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    records = list(records)
    json_path = directory / "parity.json"
    json_path.write_text(json.dumps(_jsonable(records), indent=1))
    written, used = [json_path], set()
    for rec in records:
        if rec["passed"] or "map" not in rec:
            continue
        stem = f"{_safe_name(str(rec['test']))}__{_safe_name(rec['tensor'])}"
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
    ax.set_xlabel(rec["map_x"] + (f" (bins of {xb})" if xb > 1 else ""))
    ax.set_ylabel(rec["map_y"] + (f" (bins of {yb})" if yb > 1 else ""))
    ax.set_title(f"{rec['test']} :: {rec['tensor']}  error {_num(rec['error'])}  rtol {_num(rec['rtol'])}"
                 + (f"  worst: {rec['worst_text']}" if rec.get("worst_text") else ""), fontsize=8)
    fig.colorbar(im, ax=ax, label="error contribution")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
