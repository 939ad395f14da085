"""The continuation check's comparisons for one placement and the words of its report: the
forward's first wrong token, the call whose backward goes wrong first, and the CP gradient rule
when only the gradients fail under CP. This module imports no pytest."""

from __future__ import annotations

import math

import torch

from ..parity import assert_parity
from .continuation_plans import describe_token, token_calls

__all__ = ["CP_GRADIENT_RULE", "check_placement", "cp_view", "field_names"]

CP_GRADIENT_RULE = (
    "the CP gradient rule: a prefill call's final states take a gradient that is whole on every CP rank (each "
    "rank is handed the same one), and its initial-state gradients are each CP rank's share (the check sums them "
    "over the CP ranks). A client that computes the final states redundantly on every CP rank (from all-gathered "
    "inputs, or a state broadcast to every rank) counts their gradient cp times: return each final state through "
    "an op whose backward keeps its gradient on the one rank that computed it (linattn.parallel.cp.conv."
    "sequences_ending_here), or scale it by 1/cp")


def field_names(state) -> list[str]:
    return list(state._fields) if hasattr(state, "_fields") else [f"state[{i}]" for i in range(len(state))]


def cp_view(results, what, p, tp_rank, cp_rank) -> torch.Tensor:
    """A per-token result `what` (`[1, T, ...]` on every rank) as TP rank `tp_rank` on CP rank
    `cp_rank` sees it, in float64: a prefill call's tokens from the CP rank that held them, a decoded
    token (every CP rank runs the whole decode step) from CP rank `cp_rank`; NaN where no rank ran
    the token. results: per global rank a dict with `what`, 'held' and 'decoded' (`[T]` bool)."""
    tp, cp = p.tp, p.cp
    full = torch.full(tuple(results[tp_rank][what].shape), math.nan, dtype=torch.float64)
    for c in range(cp):
        r = results[tp_rank + tp * c]
        mine = r["held"] & ~r["decoded"] if c != cp_rank else r["held"]
        full[:, mine] = r[what][:, mine].double()
    return full


def _per_token_error(actual, expected):
    """Each token's error relative to the tokens' RMS norm (NaN stays NaN: never <= rtol)."""
    scale = float(torch.linalg.vector_norm(expected)) / math.sqrt(max(expected.shape[1], 1)) or 1.0
    return torch.linalg.vector_norm((actual - expected)[0].flatten(1), dim=1) / scale


def _wrong_tokens(per_token, bounds, rtol):
    """(sequence, position, global token) of every token off by more than rtol."""
    bad = ~(per_token <= rtol)
    hits = []
    for n in range(len(bounds) - 1):
        for position in torch.nonzero(bad[bounds[n]:bounds[n + 1]]).flatten().tolist():
            hits.append((n, position, bounds[n] + position))
    return hits


def first_wrong_token(actual, expected, bounds, plans, calls, rtol) -> str:
    """The forward's: the first token in sequence order (earliest position; the lowest sequence on
    a tie) that is off, and the call that ran it: where the carried state went wrong. When only
    decode steps hold wrong tokens, it says every prefill chunk is right."""
    per_token = _per_token_error(actual, expected)
    hits = _wrong_tokens(per_token, bounds, rtol)
    if not hits:
        return ""
    n, position, t = min(hits, key=lambda h: (h[1], h[0]))
    where = token_calls(calls, expected.shape[1])
    decode_only = all(calls[where[h[2]]].kind == "decode" for h in hits)
    return (f"first wrong token: sequence {n} ({plans[n]}), {describe_token(calls[where[t]], position, plans[n])}, "
            f"error {float(per_token[t]):.1e} of the tokens' RMS norm; sequences with a wrong token: "
            f"{sorted({h[0] for h in hits})}"
            + ("; only decode steps hold a wrong token: every prefill chunk is right" if decode_only else ""))


def first_wrong_backward(actual, expected, bounds, plans, calls, rtol) -> str:
    """The gradients': the backward runs the calls last first, and a wrong gradient flows on to
    every earlier token of its sequence, so the call whose backward goes wrong first is the latest
    call holding a wrong token (the lowest sequence there, its latest token)."""
    per_token = _per_token_error(actual, expected)
    hits = _wrong_tokens(per_token, bounds, rtol)
    if not hits:
        return ""
    where = token_calls(calls, expected.shape[1])
    n, position, t = max(hits, key=lambda h: (where[h[2]], -h[0], h[1]))
    return (f"first call whose backward is wrong (the backward runs the last call first; every earlier token "
            f"inherits its error): sequence {n} ({plans[n]}), {describe_token(calls[where[t]], position, plans[n])}, "
            f"error {float(per_token[t]):.1e} of the tokens' RMS norm; sequences with a wrong gradient: "
            f"{sorted({h[0] for h in hits})}")


def _multiple(actual, expected) -> str:
    """' (it is 2.00 x the reference's)' when `actual` is a multiple of `expected`, else ''."""
    a, e = actual.flatten(), expected.flatten()
    denom = float(e @ e)
    if not denom or not bool(torch.isfinite(a).all()):
        return ""
    c = float(a @ e) / denom
    residual = float(torch.linalg.vector_norm(a - c * e)) / (float(torch.linalg.vector_norm(a)) or 1.0)
    return f" (it is {c:.3g} x the reference's)" if residual < 1e-6 and abs(c - 1) > 1e-6 else ""


def check_placement(label, p, plans, bounds, calls, results, expected, path, rtol, unshard) -> str:
    """Every comparison of one placement: '' when all pass, else its report (every failing check)."""
    __tracebackhide__ = True
    tp, cp = p.tp, p.cp
    cu = torch.tensor(bounds, dtype=torch.int32)
    failures, failed = [], set()

    def collect(kind, check, *args, **kwargs):
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            failures.append(str(exc))
            failed.add(kind)

    def check_tokens(what, ref, t, c):
        full = cp_view(results, what, p, t, c)
        where = "".join([f" tp_rank{t}" if tp > 1 else "", f" (decoded on cp_rank{c})" if cp > 1 else ""])
        try:
            assert_parity(full, ref, rtol=rtol, name=f"{label} {'output' if what == 'y' else what}{where}",
                          cu_seqlens=cu)
        except AssertionError as exc:
            locate = first_wrong_token if what == "y" else first_wrong_backward
            raise AssertionError(f"{exc}\n{locate(full, ref, bounds, plans, calls, rtol)}"
                                 + (_multiple(full, ref) if what == "dx" else "")) from None

    def describe(tensor_name, index):
        n = index[0]
        return f"sequence {n} ({plans[n]}), element {tuple(index[1:])}"

    names = field_names(results[0]["ht"])
    for c in range(cp):
        for t in range(tp):
            collect("y", check_tokens, "y", expected["y"], t, c)
            if path.differentiable:
                collect("dx", check_tokens, "dx", expected["dx"], t, c)
        states = unshard(path, p, [results[t + tp * c]["ht"] for t in range(tp)])
        where = f" on cp_rank{c}" if cp > 1 else ""
        collect("ht", assert_parity, dict(zip(names, states)), dict(zip(names, expected["ht"])), rtol=rtol,
                name=f"{label} final state{where}", describe=describe, activations=False)
    if path.differentiable:
        dh0 = unshard(path, p, [results[t]["dh0"] for t in range(tp)])  # whole on every CP rank: CP rank 0's
        try:
            assert_parity(dict(zip(names, dh0)), dict(zip(names, expected["dh0"])), rtol=rtol,
                          name=f"{label} dh0 (gradient of the initial state)", describe=describe, activations=False)
        except AssertionError as exc:
            multiples = "".join(f"\n  {name}{m}" for name, a, e in zip(names, dh0, expected["dh0"])
                                if (m := _multiple(a, e)))
            failures.append(f"{exc}{multiples}")
            failed.add("dh0")
    if not failures:
        return ""
    report = (f"continuation parity failed for {label}: {len(failures)} failing check(s)\n"
              + "".join(f"  sequence {n}: {pl}\n" for n, pl in enumerate(plans)) + "\n" + "\n\n".join(failures))
    if cp > 1 and failed <= {"dx", "dh0"}:
        report += (f"\n\nunder CP the outputs and final states match and only the gradients ({', '.join(sorted(failed))}) "
                   f"are off: check {CP_GRADIENT_RULE}.")
    return report
