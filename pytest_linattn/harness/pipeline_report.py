"""The pipeline checks' comparisons of one placement and their words (`pipeline`): each stage's
outputs, input gradients, layers' gradients and caches, named by stage and layer; where the
forward (or the decode path) first goes wrong; the stages' weights. Each check returns its report,
or "" when the placement passes. This module imports no pytest."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..parity import assert_parity
from .continuation_report import field_names
from .pipeline_rank import RankPipeline, stage_layers
from .placement import Placement
from .sharded_parity import check_replicated, check_tokens

__all__ = ["check_decode", "check_train", "stage_words"]


def stage_words(stage: int, layers: range) -> str:
    """`stage 1 (layers 2..3)`, `stage 0 (layer 0)`."""
    span = f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}..{layers.stop - 1}"
    return f"stage {stage} ({span})"


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """What `sharded_parity.check_tokens` reads of a case: a packing, its placement, rtol, name."""

    cu_seqlens: torch.Tensor
    placement: Placement
    rtol: float
    name: str


class _Failures:
    """Failing checks, each with the (stage, kind) it belongs to."""

    def __init__(self):
        self.reports, self.off = [], set()

    def collect(self, where, check, *args, **kwargs) -> bool:
        try:
            check(*args, **kwargs)
            return True
        except AssertionError as exc:
            self.reports.append(str(exc))
            self.off.add(where)
            return False


def _at(results, p: Placement, t: int, c: int, s: int):
    return results[t + p.tp * (c + p.cp * s)]


def _token_views(results, p, s, key):
    """{name suffix: {(tp_rank, cp_rank): a rank's per-token tensor}}: with SP one view of every
    rank's slice; otherwise one per TP rank (each holds its CP rank's tokens)."""
    if p.sequence_parallel:
        return {"": {(t, c): _at(results, p, t, c, s)[key] for t in range(p.tp) for c in range(p.cp)}}
    return {(f" tp_rank{t}" if p.tp > 1 else ""): {(t, c): _at(results, p, t, c, s)[key] for c in range(p.cp)}
            for t in range(p.tp)}


# ---- one forward and backward ------------------------------------------------------------------


def check_train(label, case: RankPipeline, results, expected, rtol, bitwise, weights) -> str:
    p, stack = case.placement, case.stack
    failures = _Failures()
    tokens = _Tokens(case.cu_seqlens, p, rtol, label)
    covered = {}
    for s in range(p.pp):
        layers = stage_layers(stack.num_layers, p.pp, s)
        words = stage_words(s, layers)
        for what, key, ref in (("output", "y", expected["hidden"][layers.stop - 1]),
                               ("input gradient" + (" (dx)" if s == 0 else ""), "dx",
                                expected["input_grads"][layers.start])):
            for suffix, holders in _token_views(results, p, s, key).items():
                failures.collect((s, key), check_tokens, holders, ref, tokens, f"{label} {words} {what}{suffix}",
                                 what + suffix)
        stage_names = set(_at(results, p, 0, 0, s)["grads"])
        if p.tp > 1:
            for n in sorted(stack.replicated & stage_names):
                for c in range(p.cp):
                    where = f" (CP rank {c})" if p.cp > 1 else ""
                    failures.collect((s, "grad"), check_replicated, f"{label} {words}", n,
                                     [_at(results, p, t, c, s)["grads"][n] for t in range(p.tp)], where, rtol, bitwise)
        per_tp = []
        for t in range(p.tp):
            grads = [_at(results, p, t, c, s)["grads"] for c in range(p.cp)]
            per_tp.append({n: _sum([g.get(n) for g in grads]) for n in grads[0]})
        whole = stack.unshard(per_tp, p, layers)
        for i in layers:
            mine = {n: g for n, g in whole.items() if n.startswith(f"layers.{i}.")}
            covered.update({n: s for n in mine})
            ref = {n: g for n, g in expected["grads"].items() if n.startswith(f"layers.{i}.")}
            failures.collect((s, "grad"), _check_layer_grads, mine, ref, rtol, f"{label} {words} layer {i} grad",
                             stack, p)
    missing = sorted(set(expected["grads"]) - set(covered))
    if missing:
        failures.reports.append(f"{label}: no stage returned a gradient of {missing} (each reference parameter is "
                                "one stage's layer's: PipelineStack.unshard gives the stage's layers' gradients)")
    if not failures.reports:
        return ""
    notes = [n for n in (_weights_note(case, weights), _train_summary(p, stack, failures.off)) if n]
    return "\n".join([f"pipeline parity failed for case {label}: {len(failures.reports)} failing check(s)"] + notes) \
        + "\n\n" + "\n\n".join(failures.reports)


def _check_layer_grads(actual, expected, rtol, name, stack, p):
    __tracebackhide__ = True
    unknown = sorted(set(actual) - set(expected))
    if unknown or set(expected) - set(actual):
        raise AssertionError(f"{name}: the stage's unshard gives {sorted(actual)}, the reference's layer holds "
                             f"{sorted(expected)}")
    describe = None
    if stack.describe_grad_element is not None:
        def describe(tensor, index):
            return stack.describe_grad_element(tensor, index, p)
    assert_parity(actual, expected, rtol=rtol, name=name, activations=False, describe=describe)


def _sum(grads):
    present = [g.double() for g in grads if g is not None]
    return torch.stack(present).sum(0) if present else None


def _train_summary(p, stack, off) -> str:
    """Where the forward goes wrong first (the first stage whose output is off), else where the
    backward does (the last stage whose input gradient or layers' gradients are off)."""
    words = [stage_words(s, stage_layers(stack.num_layers, p.pp, s)) for s in range(p.pp)]
    forward = [s for s in range(p.pp) if (s, "y") in off]
    if forward:
        s = forward[0]
        before = f"; before it right: {', '.join(words[:s])}" if s else ""
        return f"the forward goes wrong at {words[s]}: its output is off{before}"
    backward = [s for s in reversed(range(p.pp)) if (s, "dx") in off or (s, "grad") in off]
    if not backward:
        return ""
    s = backward[0]
    parts = [w for w, k in (("its layers' gradients", "grad"), ("its input gradient", "dx")) if (s, k) in off]
    after = f"; after it right: {', '.join(words[s + 1:])}" if s < p.pp - 1 else ""
    return (f"the forward is right (every stage's output); the backward goes wrong at {words[s]}: "
            f"{' and '.join(parts)} off{after}")


def _weights_note(case: RankPipeline, weights) -> str:
    """A line naming each stage whose TP ranks' shards, put back together by `unshard`, are not the
    reference's weights of its layers, and whose layer's weights it holds instead; else ""."""
    p, stack = case.placement, case.stack
    wrong = []
    for s in range(p.pp):
        layers = stage_layers(stack.num_layers, p.pp, s)
        try:
            back = stack.unshard([stack.shard(weights, p, t, layers) for t in range(p.tp)], p, layers)
        except Exception:  # noqa: BLE001 - a client whose unshard takes gradients only: no note
            return ""
        for i in layers:
            mine = {n: t for n, t in back.items() if n.startswith(f"layers.{i}.")}
            if all(n in weights and _equal(t, weights[n]) for n, t in mine.items()):
                continue
            words = f"{stage_words(s, layers)} holds other weights than the reference's for layer {i}"
            for j in range(stack.num_layers):
                if j != i and mine and all(_equal(t, weights.get(f"layers.{j}." + n[len(f'layers.{i}.'):]))
                                           for n, t in mine.items()):
                    words += f": the reference's layer {j}'s"
                    break
            wrong.append(words)
    return "the stages' weights: " + "; ".join(wrong) if wrong else ""


def _equal(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.detach().double().cpu(), b.detach().double().cpu()))


# ---- the decode path ---------------------------------------------------------------------------


def check_decode(label, case: RankPipeline, results, expected, rtol, bounds, counts) -> str:
    p, stack = case.placement, case.stack
    failures = _Failures()
    prompts = _Tokens(case.cu_seqlens, p, rtol, label)
    steps = case.steps
    calls = ["the prefill"] + [f"decode step {j + 1} of {len(steps)} (sequences {list(seqs)})"
                               for j, (seqs, _) in enumerate(steps)]
    order = []  # (call, stage) in the order they ran
    for k, call in enumerate(calls):
        for s in range(p.pp):
            layers = stage_layers(stack.num_layers, p.pp, s)
            ref = expected["hidden"][layers.stop - 1]
            name = f"{label} {stage_words(s, layers)} output, {call}"
            order.append((k, s))
            if k == 0:
                for suffix, holders in _token_views(results, p, s, "outputs").items():
                    holders = {at: outs[0] for at, outs in holders.items()}
                    failures.collect((k, s), check_tokens, holders, ref[:, case.prompt_tokens], prompts,
                                     name + suffix, "output" + suffix)
                continue
            seqs, tokens = steps[k - 1]
            failures.collect((k, s), _check_rows, results, p, s, k, ref[:, tokens], seqs, tokens, bounds, rtol, name)
    for s in range(p.pp):
        layers = stage_layers(stack.num_layers, p.pp, s)
        for c in range(p.cp):
            held = [_at(results, p, t, c, s)["caches"] for t in range(p.tp)]
            where = f" (CP rank {c})" if p.cp > 1 else ""
            failures.collect(("cache", s), _check_caches, stack, p, held, layers, expected["states"], bounds, rtol,
                             f"{label} {stage_words(s, layers)}", where)
    if not failures.reports:
        return ""
    first = next(((k, s) for k, s in order if (k, s) in failures.off), None)
    if first is None:
        summary = "every call's output is right on every stage; the caches are not"
    else:
        k, s = first
        before = ("the calls before it right on every stage" if k else "no call before it") + (
            f", this one right on {'stage 0' if s == 1 else f'stages 0..{s - 1}'}" if s else "")
        where = stage_words(s, stage_layers(stack.num_layers, p.pp, s))
        summary = f"first wrong output: {calls[k]} on {where}; {before}"
    return (f"pipeline decode parity failed for case {label}: {len(failures.reports)} failing check(s)\n{summary}\n\n"
            + "\n\n".join(failures.reports))


def _row_words(seqs, tokens, bounds):
    return [f"row {r} (sequence {n}, token {int(t) - bounds[n]})" for r, (n, t) in enumerate(zip(seqs, tokens))]


def _check_rows(results, p, s, k, expected, seqs, tokens, bounds, rtol, name):
    """A decode step's output on stage s: TP rank 0 / CP rank 0's against the reference, naming the
    rows off and right; every other rank of the stage the same as it."""
    __tracebackhide__ = True
    words = _row_words(seqs, tokens, bounds)
    first = _at(results, p, 0, 0, s)["outputs"][k]
    try:
        assert_parity(first, expected, rtol=rtol, name=name,
                      describe=lambda _, index: f"{words[index[1]]}, feature {index[2]}" if len(index) == 3 else None)
    except AssertionError as exc:
        scale = float(torch.linalg.vector_norm(expected)) / math.sqrt(max(expected.shape[1], 1)) or 1.0
        error = torch.linalg.vector_norm((first.double() - expected)[0], dim=-1) / scale
        off = [w for w, e in zip(words, error.tolist()) if not e <= rtol]
        right = [w for w, e in zip(words, error.tolist()) if e <= rtol]
        raise AssertionError(f"{exc}\nrows off: {'; '.join(off)}; right: {'; '.join(right) or 'none'}") from None
    for t in range(p.tp):
        for c in range(p.cp):
            if (t, c) != (0, 0):
                assert_parity(_at(results, p, t, c, s)["outputs"][k], first, rtol=rtol,
                              name=f"{name}: TP rank {t}, CP rank {c} vs TP rank 0, CP rank 0")


def _check_caches(stack, p, held, layers, states, bounds, rtol, label, where):
    """The stage's caches (its TP ranks', on one CP rank): one per layer of the stage, keyed by its
    global index, each the replicated layer's final state per sequence."""
    __tracebackhide__ = True
    keys = set(held[0])
    if keys != set(layers):
        raise AssertionError(f"{label}{where} holds caches of layers {sorted(keys)}; its layers are {list(layers)} "
                             "(keyed by global layer index)")
    problems = []
    for i in layers:
        parts = [h[i] for h in held]
        state = parts[0] if p.tp == 1 else stack.unshard_state(parts, p)
        ref = states[i]
        fields = field_names(ref)
        actual = {f: t.double() for f, t in zip(fields, state)}
        wanted = dict(zip(fields, ref))
        name = f"{label} layer {i} cache{where}"
        try:
            assert_parity(actual, wanted, rtol=rtol, name=name, describe=lambda _, index: f"sequence {index[0]}")
        except AssertionError as exc:
            off = [n for n in range(len(bounds) - 1) if not all(_row_close(actual[f][n], wanted[f][n], rtol)
                                                                  for f in fields if f in actual)]
            right = [n for n in range(len(bounds) - 1) if n not in off]
            problems.append(f"{exc}\nsequences off: {off}; right: {right or 'none'}")
    if problems:
        raise AssertionError("\n\n".join(problems))


def _row_close(a, b, rtol) -> bool:
    if tuple(a.shape) != tuple(b.shape):
        return False
    norm = float(torch.linalg.vector_norm(b))
    error = float(torch.linalg.vector_norm(a.double() - b))
    return error <= rtol * norm if norm else error <= rtol
