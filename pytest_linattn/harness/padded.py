"""The padded-batch mode of the continuation check: a batch `[B, T, hidden]` with an attention
mask, as transformers' models take it, one sequence per row, left or right padded, its prompt cut
into calls at columns shared by every row (a row's padding run may straddle a call boundary: a
call can hold only pads of a row), then decode steps of one token per row.

A row's prompt is `seqlens[b]` tokens in `width` columns: left padding puts `width - seqlens[b]`
pads before them, right padding after them. Pads carry random inputs, never zeros: a pad that
reaches a state shows. The client's forward gets each call's inputs, mask and the state its
previous call returned (None first: empty cache) and returns outputs and state, one row per batch
row. The reference is the float64 serial run of the replicated layer over each row's tokens
(pads removed), token by token from zero states. After every call, every real token's output
and every row's state must match it within rtol (pads' outputs are not compared): a row's state
after a call is the state after its real tokens so far. A failure names the call, the row and
the token. TP placements only; no gradients. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .cases import ShardedLayer
from .continuation_report import field_names
from .padded_rank import PaddedCall, RankPadded, run_padded_on_rank
from .placement import Placement
from .spec_decode import serial_run

__all__ = ["PADDING_SIDES", "PaddedStatePath", "assert_padded_continuation_parity", "padded_schedule"]

PADDING_SIDES = ("left", "right")
MAX_LISTED = 8


@dataclasses.dataclass(frozen=True)
class PaddedStatePath:
    """How a client's layer runs padded batches, for `assert_padded_continuation_parity`.
    Callables module-level (spawn pickles them by reference).

    forward(module, x, attention_mask, state, placement) -> (y, state)
        x `[B, T, hidden]`, attention_mask `[B, T]` bool (True: a token, False: a pad); state
        the one its previous call returned (None on the first call: an empty cache), one row
        per batch row. Returns y `[B, T, hidden]` (pads' outputs are not compared) and every
        row's state after its tokens, in the client's layout (TP: the rank's heads).
    unshard_state(states, placement): as StatePath's; needed for tp > 1.
    """

    layer: ShardedLayer
    forward: Callable
    unshard_state: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"PaddedStatePath.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        if not callable(self.forward):
            raise ValueError(f"PaddedStatePath.forward must be callable, got {self.forward!r}")
        if self.unshard_state is not None and not callable(self.unshard_state):
            raise ValueError(f"PaddedStatePath.unshard_state must be callable or None, got {self.unshard_state!r}")
        try:
            pickle.dumps(self)
        except Exception as exc:  # noqa: BLE001 - reported as bad input
            raise ValueError(f"PaddedStatePath's callables must be module-level (spawn pickles them by reference): "
                             f"{exc}") from None


def assert_padded_continuation_parity(spawn, path: PaddedStatePath, reference: torch.nn.Module,
                                      placements: Sequence[Placement], seqlens: Sequence[int], *, padding: str,
                                      cuts: Sequence[int], decode: int, hidden_size: int, seed: int, rtol: float,
                                      width: int | None = None, dtype: torch.dtype = torch.float64,
                                      reference_forward: Callable | None = None, name: str = "") -> None:
    """The client's padded path at every TP placement against the float64 serial run of
    `reference` over each row's tokens (the module docstring). seqlens: each row's prompt tokens;
    padding: "left" or "right"; width: the prompt's columns (default max(seqlens)); cuts: the
    columns where a prefill call ends and the next begins, increasing, inside (0, width); decode:
    one-token steps after the prompt. AssertionError naming the call, the row and the token."""
    __tracebackhide__ = True
    if not isinstance(path, PaddedStatePath):
        raise ValueError(f"path must be a PaddedStatePath, got {type(path).__name__}")
    if padding not in PADDING_SIDES:
        raise ValueError(f"padding must be one of {PADDING_SIDES}, got {padding!r}")
    seqlens = list(seqlens)
    if not seqlens:
        raise ValueError("seqlens must hold one prompt length per row, got none")
    for b, length in enumerate(seqlens):
        positive_int(length, f"seqlens[{b}]")
    width = max(seqlens) if width is None else width
    positive_int(width, "width")
    if width < max(seqlens):
        raise ValueError(f"width must hold the longest prompt ({max(seqlens)} tokens), got {width}")
    cuts = list(cuts)
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cuts) or cuts != sorted(set(cuts)) \
            or (cuts and not 0 < cuts[0] <= cuts[-1] < width):
        raise ValueError(f"cuts must be increasing ints inside (0, width={width}), got {cuts}")
    if isinstance(decode, bool) or not isinstance(decode, int) or decode < 0:
        raise ValueError(f"decode must be an int >= 0, got {decode!r}")
    positive_int(hidden_size, "hidden_size")
    rtol = check_rtol(rtol)
    placements = list(placements)
    if not placements:
        raise ValueError("placements must be a non-empty sequence of Placement")
    for p in placements:
        if not isinstance(p, Placement) or p.cp > 1 or p.sequence_parallel:
            raise ValueError(f"placements must be TP-only Placements (the padded mode runs no CP or SP), got {p!r}")
        if p.tp > 1 and path.unshard_state is None:
            raise ValueError(f"placement {p.name}: tp > 1 needs PaddedStatePath.unshard_state")

    gen = torch.Generator().manual_seed(seed)
    lengths = [length + decode for length in seqlens]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    tokens = torch.randn(1, bounds[-1], hidden_size, generator=gen, dtype=torch.float64)
    calls = padded_schedule(seqlens, bounds, tokens, padding, width, cuts, decode, gen)
    forward = reference_forward or (lambda ref, x_, cu_, s: ref(x_, cu_, s, output_final_state=True))
    serial_y, serial_states = serial_run(forward, reference, tokens, bounds)
    names = field_names(serial_states)
    label = f"{name}/" if name else ""
    reports = []
    for p in placements:
        case = RankPadded(path, p, {k: t.detach() for k, t in reference.named_parameters()}, calls, dtype)
        results = spawn(run_padded_on_rank, p.size, case)
        report = _check(f"{label}{p.name}/seed{seed}/{padding}-padded", p, path, seqlens, bounds, calls, results,
                        serial_y, serial_states, names, rtol)
        if report:
            reports.append(report)
    if reports:
        raise AssertionError("\n\n".join(reports))


def padded_schedule(seqlens, bounds, tokens, padding, width, cuts, decode, gen) -> list[PaddedCall]:
    """The calls: the prompt's columns cut at `cuts`, then `decode` one-column steps. Each row's
    tokens fill its prompt columns (after its pads when left padded), pads random."""
    B, hidden = len(seqlens), tokens.shape[2]
    columns = torch.randn(B, width + decode, hidden, generator=gen, dtype=torch.float64)  # pads stay random
    mask = torch.zeros(B, width + decode, dtype=torch.bool)
    position = torch.full((B, width + decode), -1, dtype=torch.int64)  # a column's token in its row, -1: a pad
    for b, length in enumerate(seqlens):
        first = width - length if padding == "left" else 0
        cols = list(range(first, first + length)) + list(range(width, width + decode))
        columns[b, cols] = tokens[0, bounds[b]:bounds[b + 1]]
        mask[b, cols] = True
        position[b, cols] = torch.arange(len(cols))
    edges = [0, *cuts, width] + [width + j + 1 for j in range(decode)]
    return [PaddedCall("prefill" if a < width else "decode", a, b, columns[:, a:b], mask[:, a:b], position[:, a:b])
            for a, b in zip(edges[:-1], edges[1:])]


def _describe_call(i, call) -> str:
    pads = [int((~call.mask[b]).sum()) for b in range(call.mask.shape[0])]
    what = "prefill" if call.kind == "prefill" else "decode"
    return f"call {i} ({what} of columns {call.start}..{call.stop - 1}, pads per row {pads})"


def _check(label, p, path, seqlens, bounds, calls, results, serial_y, serial_states, names, rtol) -> str:
    outputs, states = [], []
    consumed = [0] * len(seqlens)
    scale = float(torch.linalg.vector_norm(serial_y)) / math.sqrt(serial_y.shape[1]) or 1.0
    for i, call in enumerate(calls):
        for b in range(len(seqlens)):
            row = f"row {b} (a {seqlens[b]}-token prompt)"
            for t_rank in range(p.tp):
                y = results[t_rank][i]["y"][b].double()
                for col in torch.nonzero(call.mask[b]).flatten().tolist():
                    pos = int(call.position[b, col])
                    err = float(torch.linalg.vector_norm(y[col] - serial_y[0, bounds[b] + pos])) / scale
                    if not err <= rtol:
                        outputs.append(f"{_describe_call(i, call)}: {row}, token {pos} (column {call.start + col}): "
                                       f"output error {err:.1e} of the tokens' RMS norm"
                                       + (f" (tp_rank{t_rank})" if p.tp > 1 else ""))
                        break
            consumed[b] += int(call.mask[b].sum())
        per_rank = [results[t][i]["state"] for t in range(p.tp)]
        got = per_rank[0] if p.tp == 1 else path.unshard_state(per_rank, p)
        for b in range(len(seqlens)):
            after = f"after token {consumed[b] - 1}" if consumed[b] else "before its first token (zeros)"
            for field, a, e in zip(names, got, serial_states):
                expected = e[b, consumed[b]]
                err = float(torch.linalg.vector_norm(a[b].double() - expected)) / (
                    float(torch.linalg.vector_norm(expected)) or 1.0)
                if not err <= rtol:
                    states.append(f"{_describe_call(i, call)}: row {b} (a {seqlens[b]}-token prompt), state {after}: "
                                  f"field {field} error {err:.1e}")
    if not (outputs or states):
        return ""
    parts = [f"padded continuation parity failed for {label}: {len(outputs)} wrong output(s) (the first per "
             f"call, row and TP rank), {len(states)} wrong state(s)"]
    for title, found in (("first wrong outputs (by call)", outputs), ("first wrong states (by call)", states)):
        if found:
            parts.append(f"{title}:\n" + "\n".join(f"  {f}" for f in found[:MAX_LISTED])
                         + (f"\n  ... and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""))
    return "\n".join(parts)
