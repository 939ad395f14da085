"""Parity of a sharded layer with its replicated reference, over TP / SP / CP placements.

The pattern: the replicated layer (the reference, float64) runs once in the test process on a
packed batch; the sharded layer is built on every rank of a `spawn` world, loaded with its shard
of the same weights, and runs forward and backward on the tokens its placement gives the rank;
outputs, input gradients and parameter gradients are put back together and compared with
`assert_parity` (relative Frobenius error per tensor; failures located by sequence, token, head
and the CP / TP rank holding the token, parameter gradients by the client's
`describe_grad_element`). Every failing check of a case is reported, in one AssertionError.

A client describes its layer with a `ShardedLayer` (module-level callables: they cross to the
ranks by pickle-by-reference) and calls `assert_sharded_parity` (one layer, several placements)
or `assert_parity_cases` (any list of `ParityCase`s). Placements whose world sizes match share
one spawn call; a world larger than tp * cp holds data-parallel replicas, each checked.

Ranks (Megatron's order) and the tokens each one holds (contiguous, zigzag, fla-zigzag, SP
slices, padded THD): the docstring of `pytest_linattn.harness.placement`, which computes them itself
so that a layout bug shared by a layer and its helpers still shows. A padded placement's ranks get
the pads too (random inputs, zero output cotangent: the loss mask); the reference runs on the
unpadded batch and only the real tokens are compared. What the ranks run:
`pytest_linattn.harness.sharded_parity_rank`. A failing CP case whose ranks' outputs are the
replicated layer's on the batch read in another layout (the layer has its own layout) says so
first: "the layouts differ: ...", and one whose ranks' outputs are the replicated layer's on the
batch as one sequence says "the packing was lost: ...". A failing TP case whose `unshard` does not
put the ranks' shards of the weights back together as the weights (the shard function splits a
parameter otherwise) says that first too: "shard and unshard disagree: ...". Under each failing
output or input-gradient check, the first wrong token (of each CP rank, where CP splits the
tokens) says where a rank's state, halo or boundaries first went wrong; the worst element says
where the error is largest.

Gradient rule (the one place it is stated):
    TP-sharded parameters    each TP rank's gradient goes to the client's `unshard`, in TP rank
                             order, which puts the replicated layer's gradient back together.
    TP-replicated parameters (`ShardedLayer.replicated`) after backward and the client's own
                             reduction (`after_backward`) every TP rank must hold the same
                             gradient (bitwise, or to rtol), and the unsharded one must match the
                             reference: a replicated weight whose gradient is not reduced over TP
                             fails, naming the parameter and the TP ranks.
    over CP (and SP tokens)  each CP rank's gradient is a partial sum over its own tokens (the
                             training loop's all-reduce over data x context ranks completes it);
                             the harness sums them over the CP group before unsharding.

This module imports no pytest; the `spawn` argument is anything with spawn's call shape
(`spawn(fn, world_size, *args)` -> the ranks' return values in rank order, tensors on CPU).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import torch

from ..parity import assert_parity
from .cases import ParityCase, ShardedLayer
from .placement import LAYOUTS, Placement, as_cu_seqlens, check_seed, default_process_groups, positive_int, rank_token_index
from .recompute import check_recompute, recompute_failures
from .sharded_parity_report import (first_wrong_tokens, gather_tokens, layout_note, packing_note, reference_forward,
                                    shard_note, token_ranks)
from .reruns import digest, kept
from .sharded_parity_rank import RankCase, run_cases_on_rank

__all__ = [
    "LAYOUTS",
    "ParityCase",
    "Placement",
    "ShardedLayer",
    "assert_parity_cases",
    "assert_sharded_parity",
    "default_process_groups",
    "rank_token_index",
]


def assert_sharded_parity(spawn, layer: ShardedLayer, reference: torch.nn.Module, placements: Sequence[Placement],
                          cu_seqlens, *, hidden_size: int, seed: int, rtol: float, dtype: torch.dtype = torch.float64,
                          world_size: int | None = None, bitwise_replicated: bool = True,
                          reference_forward: Callable | None = None, name: str = "",
                          recompute: bool | str = False) -> None:
    """`layer` at every placement against `reference` on one packed batch: output, input gradient
    and every parameter gradient within `rtol` (the module's gradient rule), AssertionError naming
    the case, the tensor and where it is off otherwise.

    x and dy `[1, T, hidden_size]` are drawn from N(0, 1) seeded by `seed` (in the failure names).
    world_size: one spawn world for every placement (each tp * cp must divide it; the rest are
    data-parallel replicas); default one world per distinct tp * cp.
    bitwise_replicated: TP-replicated gradients must be bit-identical across TP ranks (an
    all-reduce gives that); False compares them to rtol.
    recompute: False, "reentrant" or "non-reentrant" (True: "non-reentrant"): the layer's forward
    runs under torch.utils.checkpoint; the run must also equal the same run without recompute
    bitwise, and the replay issue the forward's collectives (`pytest_linattn.harness.recompute`).
    """
    __tracebackhide__ = True
    recompute = check_recompute(recompute)
    cu = as_cu_seqlens(cu_seqlens)
    positive_int(hidden_size, "hidden_size")
    check_seed(seed)
    placements = list(placements)
    if not placements:
        raise ValueError("placements must hold at least one Placement")
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(1, int(cu[-1]), hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    prefix = f"{name}/" if name else ""
    suffix = f"/recompute-{recompute}" if recompute else ""
    cases = [ParityCase(layer, p, reference, cu, x, dy, rtol, dtype, name=f"{prefix}{p.name}/seed{seed}{suffix}",
                        reference_forward=reference_forward, recompute=recompute)
             for p in placements]
    assert_parity_cases(spawn, cases, world_size=world_size, bitwise_replicated=bitwise_replicated)


def assert_parity_cases(spawn, cases: Sequence[ParityCase], *, world_size: int | None = None,
                        bitwise_replicated: bool = True, recompute: bool | str | None = None) -> None:
    """Every case against its reference (as `assert_sharded_parity`), cases of the same world
    size in one spawn call (or all in one world of `world_size`). recompute: every case's
    (None: each case's own `ParityCase.recompute`)."""
    __tracebackhide__ = True
    cases = list(cases)
    if not cases or not all(isinstance(c, ParityCase) for c in cases):
        raise ValueError("cases must be a non-empty sequence of ParityCase")
    if recompute is not None:
        recompute = check_recompute(recompute)
        cases = [dataclasses.replace(c, recompute=recompute) for c in cases]
    if world_size is not None:
        positive_int(world_size, "world_size")
        for c in cases:
            if world_size % c.placement.size:
                raise ValueError(f"world_size {world_size} must be a multiple of tp * cp = {c.placement.size} "
                                 f"of placement {c.placement.name} (case {c.name})")
    batches: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        batches.setdefault(world_size or c.placement.size, []).append(i)
    runs: dict[tuple, tuple] = {}
    references = [_reference_run(c, runs) for c in cases]  # before spawn: a bad reference fails fast
    for world, indices in batches.items():
        per_rank = spawn(run_cases_on_rank, world, [RankCase.of(cases[i]) for i in indices])
        for j, i in enumerate(indices):
            results = [r[j] for r in per_rank]
            replay = recompute_failures(cases[i], results)  # [] without recompute
            try:
                _check_case(cases[i], results, references[i], bitwise_replicated)
            except AssertionError as exc:
                notes = [note for note in (layout_note(cases[i], results), packing_note(cases[i], results),
                                           shard_note(cases[i])) if note]
                raise AssertionError("\n\n".join(notes + [str(exc)] + replay)) from None
            if replay:
                raise AssertionError(f"recompute check failed for case {cases[i].name}: {len(replay)} failing "
                                     "check(s)\n\n" + "\n\n".join(replay))


# ----------------------------------------------------------------------------------------------
# the test process: the reference, and putting the ranks' results back together


def _reference_run(case: ParityCase, runs: dict):
    key = (id(case.reference), id(case.x), id(case.dy), tuple(case.cu_seqlens.tolist()), case.reference_forward)
    if key not in runs:
        ref = case.reference

        def rerun_key():  # across a test's reruns (collective mutants): the same module, weights and inputs
            state = [v for v in ref.state_dict().values() if isinstance(v, torch.Tensor)]
            return "sharded_parity", type(ref), digest(*state), digest(case.x, case.dy), key[3], case.reference_forward

        runs[key] = kept(rerun_key, lambda: _compute_reference(case))
    return runs[key]


def _compute_reference(case: ParityCase):
    ref = case.reference
    dtype = next(ref.parameters()).dtype
    for p in ref.parameters():
        p.grad = None
    x = case.x.detach().to(dtype).clone().requires_grad_()
    with torch.enable_grad():
        try:
            y = reference_forward(case, x)
        except RuntimeError as exc:  # a shape error on x: most likely the wrong input size
            if not re.search(r"shape|size|dimension", str(exc), re.IGNORECASE):
                raise
            raise ValueError(f"hidden_size (x's last dim, {x.shape[-1]}) must be the reference's input size: "
                             f"the reference raised on x of shape {tuple(x.shape)}: "
                             f"{type(exc).__name__}: {exc}") from exc
        (y * case.dy.to(dtype)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in ref.named_parameters()}


def _check_case(case: ParityCase, results, reference, bitwise_replicated: bool) -> None:
    """Every check of the case (outputs, input gradients, replicated and unsharded parameter
    gradients, per data-parallel replica); one AssertionError with all that fail."""
    __tracebackhide__ = True
    p, rtol = case.placement, case.rtol
    tp, cp = p.tp, p.cp
    y_ref, dx_ref, grads_ref = reference
    world = len(results)
    names = set(results[0][2])
    unknown = sorted(case.layer.replicated - names)
    if unknown:
        raise ValueError(f"ShardedLayer.replicated names {unknown}, not parameters of the built module "
                         f"(its parameters: {sorted(names)})")
    describe = None
    if case.layer.describe_grad_element is not None:
        def describe(name, index):
            return case.layer.describe_grad_element(name, index, p)
    failures = []

    def collect(check, *args, **kwargs):
        try:
            check(*args, **kwargs)
        except AssertionError as exc:  # keep going: one bug often breaks several tensors, and which ones tells
            failures.append(str(exc))

    for d in range(world // p.size):
        label = case.name + (f"/dp{d}" if world > p.size else "")

        def at(t, c, d=d):
            return results[t + tp * (c + cp * d)]

        for what, k, ref in (("output", 0, y_ref), ("dx", 1, dx_ref)):
            if p.sequence_parallel:  # every rank holds its own slice
                views = {"": {(t, c): at(t, c)[k] for t in range(tp) for c in range(cp)}}
            else:  # every TP rank holds its CP rank's tokens: each TP rank checked
                views = {(f" tp_rank{t}" if tp > 1 else ""): {(t, c): at(t, c)[k] for c in range(cp)}
                         for t in range(tp)}
            for suffix, holders in views.items():
                collect(check_tokens, holders, ref, case, f"{label} {what}{suffix}", what + suffix)
        if tp > 1:
            for name in sorted(case.layer.replicated):
                for c in range(cp):
                    where = f" (CP rank {c})" if cp > 1 else ""
                    collect(check_replicated, label, name, [at(t, c)[2][name] for t in range(tp)], where, rtol,
                            bitwise_replicated)
        per_tp = []
        for t in range(tp):
            grads = [at(t, c)[2] for c in range(cp)]
            per_tp.append({n: _sum_over_cp([g.get(n) for g in grads]) for n in grads[0]})
        collect(assert_parity, case.layer.unshard(per_tp, p), grads_ref, rtol=rtol, name=f"{label} grad",
                describe=describe, activations=False)
    if failures:
        raise AssertionError(f"parity failed for case {case.name}: {len(failures)} failing check(s)\n\n"
                             + "\n\n".join(failures))


def check_tokens(holders, ref, case, name, what) -> None:
    """The gathered `[1, T, ...]` tensor against `ref`, failures naming the ranks holding the worst
    token, then the first wrong token (of each rank, where the ranks split the tokens)."""
    __tracebackhide__ = True
    full = gather_tokens(holders, ref, case, what)
    ranks = token_ranks(holders, case)
    try:
        assert_parity(full, ref, rtol=case.rtol, name=name, cu_seqlens=case.cu_seqlens, token_ranks=ranks)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{first_wrong_tokens(full, ref, case.cu_seqlens, ranks, case.rtol)}") from None


def check_replicated(label, name, grads, where, rtol, bitwise, what="grad"):
    """A TP-replicated parameter's gradient (or, what="weight", its value) the same on every TP rank."""
    __tracebackhide__ = True
    first = grads[0]
    held = "gradient" if what == "grad" else "value"
    if all(g is None for g in grads):  # a frozen parameter: no rank holds a gradient
        return
    for t, g in enumerate(grads[1:], start=1):
        if first is None or g is None:
            raise AssertionError(f"{label} {what} {name}: no {held} on TP rank {0 if first is None else t}{where}")
        if bitwise:
            if not torch.equal(g, first):
                diff = float((g.double() - first.double()).abs().max())
                raise AssertionError(
                    f"{label} {what} {name}: TP-replicated parameter, but TP ranks 0 and {t}{where} hold different "
                    f"{held}s (max |diff| {diff:.2e}): its gradient must be reduced over the TP group")
        else:
            assert_parity(g, first, rtol=rtol, activations=False,
                          name=f"{label} {what} {name}: TP-replicated, TP rank {t} vs TP rank 0{where}")


def _sum_over_cp(grads):
    present = [g.double() for g in grads if g is not None]
    return torch.stack(present).sum(0) if present else None
