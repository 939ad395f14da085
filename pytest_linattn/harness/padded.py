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
the token. No gradients.

Under CP (contiguous layout, no sequence parallel) a prefill call's tokens are split over the CP
ranks as the continuation check splits a packed call: the call's tokens in row order (as an
unpad orders them) cut in cp contiguous pieces of equal size (`continuation_rank.cp_share`).
A filler row after the batch's rows pads every prefill call's tokens to a multiple of cp
(`continuation_plans.cp_filler`: random tokens in the row's first columns; its outputs and state
unchecked), so the ranks' batch has B + 1 rows. Every CP rank gets the call's whole mask (the
batch's boundaries) and the keyword `held` `[B + 1, T]` bool, the tokens it holds; x holds the
inputs of those tokens and of the pads, and random values at the tokens other CP ranks hold (a
rank that reads a token it does not hold shows). A decode step (one column) runs whole on every
CP rank, without `held`. Every CP rank's states are checked, a prefill token's output on the CP
rank that held it and a decoded one on every CP rank. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .cases import ShardedLayer, require_module_level
from .continuation_plans import cp_filler
from .continuation_rank import cp_share
from .continuation_report import cp_view, field_names
from .padded_rank import PaddedCall, RankPadded, run_padded_on_rank
from .placement import Placement
from .spec_decode import serial_run
from .serving_plans import check_pool_placements, rank_note

__all__ = ["PADDING_SIDES", "PaddedStatePath", "assert_padded_continuation_parity", "cp_padded_calls",
           "padded_schedule"]

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
        Under CP a prefill call also gets `held=` `[B, T]` bool: the tokens this CP rank holds (the
        call's tokens in row order cut in cp contiguous pieces; x is random at the others, the
        mask the whole call's), its y compared there; B counts the filler row (module docstring).
        A decode step comes whole to every CP rank, without `held`.
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
        require_module_level(self)


def assert_padded_continuation_parity(spawn, path: PaddedStatePath, reference: torch.nn.Module,
                                      placements: Sequence[Placement], seqlens: Sequence[int], *, padding: str,
                                      cuts: Sequence[int], decode: int, hidden_size: int, seed: int, rtol: float,
                                      width: int | None = None, dtype: torch.dtype = torch.float64,
                                      reference_forward: Callable | None = None, name: str = "") -> None:
    """The client's padded path at every placement (TP, CP, TP x CP) against the float64 serial run of
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
    placements = check_pool_placements(placements, path, "the padded mode", state_fields=("unshard_state",))
    if any(p.cp > 1 for p in placements) and not _takes_held(path.forward):
        name = getattr(path.forward, "__name__", path.forward)
        raise ValueError(f"placements: under CP the padded mode passes PaddedStatePath.forward the keyword held= (the "
                         f"tokens the CP rank holds, module docstring); {name!r} takes no held")

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
        placed = cp_padded_calls(calls, p.cp, gen) if p.cp > 1 else calls
        case = RankPadded(path, p, {k: t.detach() for k, t in reference.named_parameters()}, placed, dtype)
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


def cp_padded_calls(calls, cp: int, gen) -> list[PaddedCall]:
    """`calls` for a CP placement (module docstring): a filler row after the batch's rows (random,
    its tokens where a prefill call's do not divide by cp), and per prefill call each CP rank's
    share (x with random values at the tokens other ranks hold, its `held` mask)."""
    placed = []
    for i, call in enumerate(calls):
        _, T, hidden = call.x.shape
        row = torch.randn(1, T, hidden, generator=gen, dtype=torch.float64)
        row_mask = torch.zeros(1, T, dtype=torch.bool)
        if call.kind == "prefill":
            filler = cp_filler(int(call.mask.sum()), cp, hidden, gen)
            if filler is not None:
                pad = filler[0].shape[1]
                if pad > T:
                    raise ValueError(f"cuts: under CP a prefill call's tokens are padded to a multiple of cp={cp} by "
                                     f"a filler row's tokens in the call's columns; call {i} (columns {call.start}.."
                                     f"{call.stop - 1}) has {T} column(s) for the {pad} it needs: widen the call")
                row[0, :pad], row_mask[0, :pad] = filler[0][0], True
        x, mask = torch.cat([call.x, row]), torch.cat([call.mask, row_mask])
        shares = None
        if call.kind == "prefill":
            tokens = torch.nonzero(mask.flatten()).flatten()  # row order: as an unpad packs them
            shares = []
            for c in range(cp):
                piece, _ = cp_share(tokens.numel(), tokens.numel(), cp, c)
                held = torch.zeros(mask.numel(), dtype=torch.bool)
                held[tokens[piece]] = True
                held = held.view(mask.shape)
                others = torch.randn(tuple(x.shape), generator=gen, dtype=torch.float64)
                shares.append((torch.where((held | ~mask).unsqueeze(-1), x, others), held))
            shares = tuple(shares)
        placed.append(dataclasses.replace(call, x=x, mask=mask, shares=shares))
    return placed


def _describe_call(i, call) -> str:
    pads = [int((~call.mask[b]).sum()) for b in range(call.mask.shape[0])]
    what = "prefill" if call.kind == "prefill" else "decode"
    return f"call {i} ({what} of columns {call.start}..{call.stop - 1}, pads per row {pads})"


def _check(label, p, path, seqlens, bounds, calls, results, serial_y, serial_states, names, rtol) -> str:
    outputs, states = [], []
    consumed = [0] * len(seqlens)
    scale = float(torch.linalg.vector_norm(serial_y)) / math.sqrt(serial_y.shape[1]) or 1.0
    for i, call in enumerate(calls):
        # a prefill token's output comes from the CP rank that held it (judged once, on CP rank 0's
        # view); a decode step runs whole on every CP rank (judged on each)
        views = [(t_rank, c, _view(results, i, p, t_rank, c))
                 for c in range(p.cp if call.kind == "decode" else 1) for t_rank in range(p.tp)]
        for b in range(len(seqlens)):
            row = f"row {b} (a {seqlens[b]}-token prompt)"
            for t_rank, c, view in views:
                y = view[b]
                for col in torch.nonzero(call.mask[b]).flatten().tolist():
                    pos = int(call.position[b, col])
                    err = float(torch.linalg.vector_norm(y[col] - serial_y[0, bounds[b] + pos])) / scale
                    if not err <= rtol:
                        outputs.append(f"{_describe_call(i, call)}: {row}, token {pos} (column {call.start + col}): "
                                       f"output error {err:.1e} of the tokens' RMS norm"
                                       + rank_note(p, t_rank, c, call.kind == "decode"))
                        break
            consumed[b] += int(call.mask[b].sum())
        for c in range(p.cp):  # every CP rank's states (the filler row's, under CP, unchecked)
            per_rank = [results[t + p.tp * c][i]["state"] for t in range(p.tp)]
            got = per_rank[0] if p.tp == 1 else path.unshard_state(per_rank, p)
            for b in range(len(seqlens)):
                after = f"after token {consumed[b] - 1}" if consumed[b] else "before its first token (zeros)"
                for field, a, e in zip(names, got, serial_states):
                    expected = e[b, consumed[b]]
                    err = float(torch.linalg.vector_norm(a[b].double() - expected)) / (
                        float(torch.linalg.vector_norm(expected)) or 1.0)
                    if not err <= rtol:
                        states.append(f"{_describe_call(i, call)}: row {b} (a {seqlens[b]}-token prompt), state "
                                      f"{after}: field {field} error {err:.1e}"
                                      + (f" (cp_rank{c})" if p.cp > 1 else ""))
    if not (outputs or states):
        return ""
    parts = [f"padded continuation parity failed for {label}: {len(outputs)} wrong output(s) (the first per "
             f"call, row and rank), {len(states)} wrong state(s)"]
    for title, found in (("first wrong outputs (by call)", outputs), ("first wrong states (by call)", states)):
        if found:
            parts.append(f"{title}:\n" + "\n".join(f"  {f}" for f in found[:MAX_LISTED])
                         + (f"\n  ... and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""))
    return "\n".join(parts)


def _takes_held(forward) -> bool:
    """Whether `forward` takes the keyword `held` (or **kwargs); True where its signature is unknown."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(q.name == "held" or q.kind == q.VAR_KEYWORD for q in params)


def _view(results, i, p, t_rank, c) -> torch.Tensor:
    """Call i's outputs `[B, T, hidden]` as TP rank t_rank on CP rank c sees them (`cp_view`: a
    prefill call's tokens from the CP rank that held them, a whole call's from rank (t_rank, c))."""
    flat = []
    for r in results:
        y, held = r[i]["y"], r[i]["held"]
        whole = torch.ones(y.shape[0] * y.shape[1], dtype=torch.bool)
        flat.append(dict(y=y.reshape(1, -1, y.shape[-1]), held=whole if held is None else held.flatten(),
                         decoded=whole if held is None else torch.zeros_like(whole)))
    shape = results[0][i]["y"].shape
    return cp_view(flat, "y", p, t_rank, c).view(shape[0], shape[1], -1)
