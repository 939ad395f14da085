"""Parity assertions with failure reports that say where a sharded computation broke.

`assert_parity(actual, expected, rtol=...)` compares one tensor, or a dict of tensors, by
relative Frobenius error ‖actual − expected‖ / ‖expected‖ computed in float64 on the CPU (so
`actual` may be a bf16 CUDA tensor). NaN or Inf never passes. A failure raises AssertionError
with one table row per failing tensor: its error, the tolerance, the max abs difference and the
worst element, located as (sequence, token in sequence, head and channel of `[1, T, H, D]`, or
feature of `[1, T, hidden]`) when `cu_seqlens` is given, with the ranks holding that token when
`token_ranks` is; `describe` lets the caller name other tensors' elements (a weight's head).

Every compared tensor also appends a record to the module-level `RECORDS` list; the pytest
plugin prints `format_summary(RECORDS)` at the end of the run and can `write_report` them as
JSON plus one error heatmap (token × head or feature) per failure (both in
`pytest_linattn.parity.report`, importable from here). This module imports no pytest.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Mapping
from contextlib import contextmanager

import torch

from ..seqlens import cu_seqlens_bounds
from .report import format_number, format_summary, format_table, write_report

__all__ = ["RECORDS", "assert_parity", "capture_records", "current_test", "format_summary", "set_current_test",
           "write_report"]

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


def assert_parity(actual, expected, *, rtol: float, name: str = "output", cu_seqlens=None,
                  token_ranks=None, describe=None, activations: bool = True) -> list[dict]:
    """Assert that `actual` matches `expected` within relative Frobenius error `rtol`.

    actual, expected: tensors, or dicts of tensors with the same keys (rows named by key).
        Shapes must match; dtypes and devices may differ (both go to float64 CPU).
    rtol: the tolerance on ‖actual − expected‖ / ‖expected‖ per tensor. Where expected is all
        zeros the absolute error ‖actual − expected‖ is used instead, and the report says so.
    name: label of the comparison in the failure message (a single tensor's row name).
    cu_seqlens: packed-sequence boundaries over dim 1 of `[1, T, ...]` tensors; used only to
        locate the worst element as (sequence, token within it). Its last entry must be the T
        of the `[1, T, ...]` tensors (of one of them, in a dict that also holds others: final
        states, weight gradients, located by multi-index).
    token_ranks: {rank kind: the rank holding each token} over dim 1 of `[1, T, ...]` tensors,
        e.g. {"CP rank": [0, 0, 1, 1, ...]} (length T each): a failure names the ranks holding
        the worst token, and the heatmap marks the shard edges (where a holder changes).
    describe(tensor_name, index) -> str | None: where the worst element `index` (a tuple) lies,
        in the caller's words ("value head 5, channel 2"); None keeps the default description.
    activations: False when the tensors are parameters or their gradients: the worst element is
        then given by index (row and col of a matrix), never in batch / token / feature words
        (which a conv weight `[D, 1, W]` would otherwise get as a `[B, T, hidden]` tensor).

    Returns the records appended to RECORDS (one per tensor) when everything passes.
    Raises ValueError for bad arguments (rtol, cu_seqlens, token_ranks, describe, mixed
    tensor/dict, non-tensors).
    """
    __tracebackhide__ = True
    rtol = check_rtol(rtol)
    bounds = None if cu_seqlens is None else cu_seqlens_bounds(cu_seqlens)
    ranks = _check_token_ranks(token_ranks, bounds)
    if describe is not None and not callable(describe):
        raise ValueError(f"describe must be callable or None, got {describe!r}")
    if not isinstance(activations, bool):
        raise ValueError(f"activations must be a bool, got {activations!r}")
    if not activations and (bounds is not None or ranks is not None):
        raise ValueError("activations=False (parameters) takes no cu_seqlens or token_ranks: they locate tokens")
    pairs = _pairs(actual, expected, name)
    _check_token_count(pairs, bounds)
    results = []
    for label, a, e, problem in pairs:
        results.append(_compare(label, a, e, rtol, bounds, group=name, problem=problem, ranks=ranks,
                                describe=describe, activations=activations))
    _sink.extend(results)
    failed = [r for r in results if not r["passed"]]
    if failed:
        raise AssertionError(_failure_message(name, results, failed))
    return results


def check_rtol(rtol) -> float:
    __tracebackhide__ = True
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)):
        raise ValueError(f"rtol must be a number, got {type(rtol).__name__}")
    rtol = float(rtol)
    if not (rtol > 0 and math.isfinite(rtol)):
        raise ValueError(f"rtol must be positive and finite, got {rtol}")
    return rtol


def _is_token_tensor(shape) -> bool:
    return len(shape) >= 2 and shape[0] == 1


def _check_token_count(pairs, bounds) -> None:
    """cu_seqlens must end at the T of the `[1, T, ...]` tensors it locates: a mismatch would
    locate the worst element by a packing that is not the tensor's."""
    __tracebackhide__ = True
    if bounds is None:
        return
    counts = sorted({int(t.shape[1]) for _, a, e, _ in pairs for t in (a, e)
                     if t is not None and _is_token_tensor(t.shape)})
    if counts and bounds[-1] not in counts:
        raise ValueError(f"cu_seqlens must end at the token count T of the [1, T, ...] tensors it locates: "
                         f"cu_seqlens[-1] = {bounds[-1]}, tensors have T = {', '.join(map(str, counts))}")


def _check_token_ranks(token_ranks, bounds) -> dict[str, list[int]] | None:
    __tracebackhide__ = True
    if token_ranks is None:
        return None
    if not isinstance(token_ranks, Mapping) or not token_ranks:
        raise ValueError(f"token_ranks must be a non-empty dict {{rank kind: rank of each token}}, got {token_ranks!r}")
    ranks = {}
    for kind, per_token in token_ranks.items():
        values = per_token.tolist() if isinstance(per_token, torch.Tensor) else list(per_token)
        if not isinstance(kind, str) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"token_ranks must map a rank kind (str) to one int rank per token, got {kind!r}")
        ranks[kind] = values
    lengths = {len(v) for v in ranks.values()}
    if len(lengths) != 1 or (bounds is not None and lengths != {bounds[-1]}):
        raise ValueError(f"token_ranks must give one rank per token: lengths {sorted(lengths)}"
                         + (f", cu_seqlens[-1] = {bounds[-1]}" if bounds is not None else ""))
    return ranks


def _as_tensor(x, what: str):
    __tracebackhide__ = True
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:  # numpy arrays and nested lists are fine too
        return torch.as_tensor(x)
    except Exception as exc:  # noqa: BLE001 - reported as bad input
        raise ValueError(f"{what} must hold tensors, got {type(x).__name__}") from exc


def _pairs(actual, expected, name):
    """(label, actual, expected, problem) per tensor; a key on one side only pairs with None."""
    __tracebackhide__ = True
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


def _compare(label, a, e, rtol, bounds, group, problem=None, ranks=None, describe=None, activations=True) -> dict:
    __tracebackhide__ = True
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
    if ranks is not None and not (_is_token_tensor(shape) and shape[1] == len(next(iter(ranks.values())))):
        ranks = None  # the token map is over dim 1 of [1, T, ...] tensors of its length only
    info["worst"] = _locate(flat, shape, bounds, ranks, activations)
    described = describe(label, tuple(info["worst"]["index"])) if describe is not None else None
    if described is not None:
        info["worst"]["described"] = str(described)
    info["worst_text"] = _location_text(info["worst"])
    if not passed:
        info.update(_error_map(diff, norm_e if relative else 1.0, shape, bounds, ranks, activations))
    return _record(test, group, label, rtol, error=error, passed=passed, shape=shape, problem=problem, **info)


def _fits_packed(shape, bounds) -> bool:
    return bounds is not None and len(shape) >= 2 and shape[0] == 1 and shape[1] == bounds[-1]


def _locate(flat: int, shape, bounds, ranks=None, activations=True) -> dict:
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
    elif len(shape) >= 3 and bounds is None and activations:  # fla's [B, T, ...]; beside cu_seqlens, a misfit has no tokens
        loc.update(batch=index[0], token=index[1])
    if "token" in loc:
        if ranks is not None:
            loc["ranks"] = {kind: per_token[loc["token"]] for kind, per_token in ranks.items()}
        # [B, T, H, D] has heads and their channels; the last dim of [B, T, hidden] is a feature
        if len(shape) == 3:
            loc["feature"] = index[2]
        elif len(shape) >= 4:
            loc["head"] = index[2]
            if len(shape) == 4:
                loc["channel"] = index[3]
    return loc


def _location_text(loc: dict | None) -> str:
    if not loc:
        return ""
    idx = "(" + ", ".join(str(i) for i in loc["index"]) + ")"
    if "described" in loc:
        return f"{loc['described']} at index {idx}"
    if "sequence" in loc:
        text = f"seq {loc['sequence']} token {loc['token_in_sequence']} (global {loc['token']})"
    elif "batch" in loc:
        text = f"batch {loc['batch']} token {loc['token']}"
    elif len(loc["index"]) == 2:
        return f"row {loc['index'][0]}, col {loc['index'][1]} at index {idx}"
    else:
        return f"index {idx}"
    if loc.get("ranks"):
        text += " on " + ", ".join(f"{kind} {rank}" for kind, rank in loc["ranks"].items())
    for dim in ("feature", "head", "channel"):
        if dim in loc:
            text += f", {dim} {loc[dim]}"
    return f"{text} at index {idx}"


def _error_map(diff: torch.Tensor, norm: float, shape, bounds, ranks=None, activations=True) -> dict:
    """Error by (head, token): sqrt of the summed squared difference over the other dims, over
    ‖expected‖, so the cells add up in quadrature to the tensor's error. Binned if large.
    A parameter (not activations) of 3+ dims: by dim 0 and the rest flattened."""
    sq = diff.nan_to_num(nan=math.inf).square()  # a NaN cell still shows as "off the scale"
    if sq.dim() >= 3 and not activations:
        grid, x_label, y_label = sq.reshape(sq.shape[0], -1), "dims 1.. flattened", "dim 0"
    elif sq.dim() >= 3:
        other = [d for d in range(sq.dim()) if d not in (1, 2)]
        grid = sq.sum(dim=other).T if other else sq.T  # [H, T]
        x_label, y_label = "token", "head" if sq.dim() >= 4 else "feature"
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
    if ranks is not None:
        # the first token of every rank's piece: where any holder differs from the previous token's
        holders = list(zip(*ranks.values()))
        out["shard_edges"] = [t for t in range(1, len(holders)) if holders[t] != holders[t - 1]]
        out["shard_ranks"] = list(ranks)
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
# The failure message


def _failure_message(name, results, failed) -> str:
    rows = []
    for r in failed:
        err = format_number(r["error"])
        where = r.get("worst_text") or ""
        if r["problem"]:
            where = f"{r['problem']}" + (f"; {where}" if where else "")
        rows.append([r["tensor"], err, format_number(r["rtol"]), format_number(r.get("max_abs_diff")), where])
    head = f"parity failed for {name}: {len(failed)} of {len(results)} tensor(s) off (relative Frobenius error)"
    lines = [head] + format_table(["tensor", "error", "rtol", "max|diff|", "worst element"], rows)
    return "\n".join(lines)
