"""Activation recompute: the layer's forward under `torch.utils.checkpoint`, for the parity and
training-step checks (`recompute=` of `assert_sharded_parity`, `ParityCase`,
`assert_training_parity`). This module imports no pytest.

Under recompute the backward runs the layer's forward a second time (the replay) to rebuild the
activations it did not keep. Two things must hold, and each is checked:

    the same numbers   every output, input gradient and parameter gradient (in the training
                       step: loss, grad norm, gradients and weights after every step) is bitwise
                       equal to the same run without recompute, on the same rank in the same
                       spawn call. A forward that changes module state (a buffer, a counter, a
                       cache) replays on the changed state and computes something else.
    the same talk      the replay issues the collectives the forward issued, in the same order
                       (op, call site, group size). A collective done once and cached on the
                       module (a warm-up) runs in the forward and not in the replay; on a real
                       cluster a rank that skips a collective its peers make hangs or mismatches.

The collectives are recorded by the collective mutants' recorder
(`pytest_linattn.mutation.rank.InterceptingMode`, recording only), entered inside the
checkpointed function, so each call of the function (the forward, then the replay) has its own
list and the layer's backward collectives are in neither. Non-reentrant checkpoint runs with
early stop off: the replay then runs the whole forward, and its collectives are compared whole.
"""

from __future__ import annotations

import torch

__all__ = ["RECOMPUTE", "bitwise_failures", "check_recompute", "recompute_failures", "recorded_forward",
           "replay_failures", "training_recompute_failures"]

# the values of `recompute=`, and what each runs
RECOMPUTE = {
    False: "no recompute: the layer's forward keeps its activations",
    "reentrant": "torch.utils.checkpoint(..., use_reentrant=True): the replay runs inside the backward's own "
                 "backward call",
    "non-reentrant": "torch.utils.checkpoint(..., use_reentrant=False), early stop off: the replay runs from "
                     "the saved-tensor hooks (True means this one)",
}


def check_recompute(value, where: str = "recompute"):
    """False, "reentrant" or "non-reentrant" (True: "non-reentrant"); ValueError otherwise."""
    __tracebackhide__ = True
    if value is True:
        return "non-reentrant"
    if value is False or (isinstance(value, str) and value in RECOMPUTE):
        return value
    raise ValueError(f"{where} must be one of False, 'reentrant', 'non-reentrant' (True means 'non-reentrant'): "
                     + "; ".join(f"{k!r}: {v}" for k, v in RECOMPUTE.items()) + f"; got {value!r}")


def recorded_forward(forward, x, recompute):
    """On a rank: `forward(x)`, under checkpoint when `recompute` says so. Returns (y, calls):
    under recompute, calls gets one list per call of `forward` (the forward, then each replay as
    the backward runs it), each collective as {"op", "site", "function", "group_size"}; without,
    it stays empty."""
    from torch.utils.checkpoint import checkpoint

    from ..mutation.rank import CollectiveInterceptor, InterceptingMode

    calls: list[list[dict]] = []

    def run(x_in):
        mode = InterceptingMode(CollectiveInterceptor())  # records only: no target
        try:
            with mode:
                return forward(x_in)
        finally:
            calls.append([{k: c[k] for k in ("op", "site", "function", "group_size")} for c in mode.interceptor.calls])

    if not recompute:  # nothing to compare: no dispatch mode over the layer
        return forward(x), calls
    if recompute == "reentrant":
        # reentrant checkpoint passes gradients only through inputs that require them
        x_in = x if x.requires_grad else x.detach().requires_grad_()
        return checkpoint(run, x_in, use_reentrant=True), calls
    return checkpoint(run, x, use_reentrant=False, early_stop=False), calls


def _describe(call: dict | None) -> str:
    if call is None:
        return "nothing (its sequence ended)"
    return f"{call['op']} at {call['site']} ({call['function']}), group of {call['group_size']}"


def replay_failures(label: str, recompute: str, calls_per_rank: dict) -> list[str]:
    """The replay's collectives against the forward's, on every rank: `calls_per_rank` maps a
    rank's words ("rank 1 (TP rank 1)") to its `recorded_forward` calls. One message per
    difference (ranks with the same difference together), naming the first collective that differs."""
    found: dict[str, list[str]] = {}
    for rank, calls in calls_per_rank.items():
        if len(calls) < 2:
            found.setdefault(f"{label} recompute={recompute!r}: the backward never replayed the checkpointed forward "
                             f"(it ran {len(calls)} time(s)): nothing to compare", []).append(rank)
            continue
        forward = calls[0]
        for n, replay in enumerate(calls[1:], start=1):
            def key(c):
                return None if c is None else (c["op"], c["site"], c["group_size"])

            for i in range(max(len(forward), len(replay))):
                f = forward[i] if i < len(forward) else None
                r = replay[i] if i < len(replay) else None
                if key(f) != key(r):
                    what = "replay" if n == 1 else f"replay {n}"
                    message = (f"{label} recompute={recompute!r}: the {what} issued other collectives than the "
                               f"checkpointed forward ({len(forward)} in the forward, {len(replay)} in the {what}); "
                               f"at collective {i + 1} the forward issued {_describe(f)}, the {what} issued "
                               f"{_describe(r)}. A collective the forward makes once (a warm-up cached on the "
                               f"module) or that depends on module state differs between the two")
                    found.setdefault(message, []).append(rank)
                    break
    return [f"{m} [on {', '.join(ranks)}]" for m, ranks in found.items()]


def bitwise_failures(label: str, recompute: str, plain: dict, recomputed: dict, rank: str) -> list[str]:
    """Each named tensor of the run under recompute against the same run without it, bitwise:
    one message for the rank, or none. Its first line names the tensors that differ and those
    that are equal (an output equal while the gradients differ: the forward computed the same, its
    replay did not); then one line per tensor that differs, with its error."""
    off, differ = [], []
    for name in plain:
        a, b = plain[name], recomputed.get(name)
        if a is None or b is None:
            if (a is None) != (b is None):
                differ.append(name)
                off.append(f"{name}: {'no tensor' if b is None else 'a tensor'} under recompute, "
                           f"{'none' if a is None else 'one'} without it")
        elif a.shape != b.shape:
            differ.append(name)
            off.append(f"{name}: shape {tuple(b.shape)} under recompute, {tuple(a.shape)} without it")
        elif not torch.equal(a, b):  # NaN is never equal: never passes
            diff = (b.double() - a.double()).abs().nan_to_num(nan=float("inf"))
            worst = int(diff.reshape(-1).argmax())
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
            scale = float(torch.linalg.vector_norm(a.double()))
            error = float(torch.linalg.vector_norm(diff)) / scale if scale else float("inf")
            differ.append(name)
            off.append(f"{name}: {int((diff > 0).sum())} of {a.numel()} elements differ, the worst at {index} by "
                       f"{float(diff.reshape(-1)[worst]):.2e} (relative error {error:.2e})")
    if not off:
        return []
    equal = [name for name in plain if name not in differ]
    return [f"{label} recompute={recompute!r}: on {rank}, {len(off)} of {len(plain)} tensors are not bitwise equal "
            f"to the same run without recompute: {_names(differ)}; bitwise equal: {_names(equal) or 'none'} (the "
            "replay computed something else than the forward: state the forward changed?):\n  " + "\n  ".join(off)]


def _names(names: list[str], most: int = 12) -> str:
    """The names, comma-separated; past `most`, the first ones and how many more."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def recompute_failures(case, results) -> list[str]:
    """The recompute checks of a parity case (`ParityCase`) from its ranks' results (under
    recompute: y, dx, grads, the forward's calls, and the run without recompute's y, dx, grads)."""
    if not case.recompute:
        return []
    p = case.placement
    failures, calls = [], {}
    for r, (y, dx, grads, rank_calls, plain) in enumerate(results):
        words = f"rank {r} (TP rank {r % p.tp}, CP rank {r // p.tp % p.cp})"

        def named(y, dx, grads):
            return {"output": y, "dx": dx, **{f"grad {n}": g for n, g in grads.items()}}

        failures += bitwise_failures(case.name, case.recompute, named(*plain), named(y, dx, grads), words)
        calls[words] = rank_calls
    return failures + replay_failures(case.name, case.recompute, calls)


def training_recompute_failures(label: str, recompute: str, placement, results) -> list[str]:
    """The recompute checks of a training-step case from its ranks' results (the steps under
    recompute, the same steps without, {(step, micro-batch): calls per call of the forward})."""
    p = placement
    failures, calls = [], {}
    for r, (steps, plain, rank_calls) in enumerate(results):
        words = f"rank {r} (TP rank {r % p.tp}, CP rank {r // p.tp % p.cp}" + (
            f", DP rank {r // p.size})" if len(results) > p.size else ")")

        def named(steps):
            out = {}
            for s, (loss, norm, grads, weights, parts) in enumerate(steps, start=1):
                out.update({f"step {s} loss part": loss, f"step {s} grad norm": norm})
                out.update({f"step {s} loss part of micro-batch {m + 1}": part for m, part in parts.items()})
                out.update({f"step {s} grad {n}": g for n, g in grads.items()})
                out.update({f"step {s} weight {n}": w for n, w in weights.items()})
            return out

        failures += bitwise_failures(label, recompute, named(plain), named(steps), words)
        for (s, m), per_call in rank_calls.items():
            calls.setdefault((s, m), {})[words] = per_call
    for (s, m), per_rank in sorted(calls.items()):
        failures += replay_failures(f"{label} step {s + 1} micro-batch {m + 1}", recompute, per_rank)
    return failures
