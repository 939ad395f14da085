"""Training-step parity: a sharded layer inside what a trainer runs, against its replicated layer.

One forward and backward cannot see the bugs that sit around a layer: a gradient all-reduced
after every micro-batch instead of once, a replicated weight counted tp times in the gradient
norm, a loss averaged per CP rank. `assert_training_parity` runs, on every rank of a `spawn`
world and for the replicated reference alike, S steps of:

    zero the gradients (TrainingStep.zero_grads; default: the optimizer's zero_grad)
    for each micro-batch (its own packed batch): forward, loss part, backward, after_backward
    the trainer's reduction (TrainingStep.finalize_grads; default: sum over the CP and DP ranks)
    the global gradient norm (TrainingStep.grad_norm; default: each parameter counted once)
    clipping to max_norm, the optimizer step (AdamW by default)

and after every step compares the loss (the ranks' parts added up) and each micro-batch's loss,
every rank's gradient norm, every gradient after the reduction and every parameter after the
step: TP-sharded ones through the client's `unshard` on every CP rank, TP-replicated ones equal on
every TP rank. A failure names the case, the step, the micro-batch count, the tensor and the TP /
CP (/ DP) rank; a wrong loss, the first micro-batch whose loss is off ("loss by micro-batch:
micro-batch 2 of 2 is the first off (cu_seqlens [...]) ...; right: [1]").

With data_parallel = D > 1 the world is D copies of the placement (Megatron order: DP outermost)
and DP rank d takes micro-batches d, d + D, ... of every step: the reference still runs them all,
so the reduction over DP (the default: summed with CP) and the loss's normalisation must agree.

The client's layer is a `ShardedLayer` (see `pytest_linattn.harness.cases`; `unshard` is given
parameters as well as gradients: they share a layout). What the ranks run: `training_step_rank`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import assert_parity, check_rtol
from .cases import ShardedLayer, TrainingStep
from .placement import Placement, as_cu_seqlens, check_fits, check_one_stage, check_seed
from .recompute import check_recompute, training_recompute_failures
from .sharded_parity import check_replicated
from .training_step_rank import RankTraining, default_loss, run_training_on_rank

__all__ = ["assert_training_parity"]


def assert_training_parity(spawn, layer: ShardedLayer, reference: torch.nn.Module, placements: Sequence[Placement],
                           micro_batches, *, hidden_size: int, seed: int, rtol: float,
                           step: TrainingStep = TrainingStep(), output_size: int | None = None,
                           dtype: torch.dtype = torch.float64, bitwise_replicated: bool = True,
                           reference_forward: Callable | None = None, name: str = "",
                           data_parallel: int = 1, recompute: bool | str = False) -> list[dict]:
    """`layer` at every placement trained as `step` says, against `reference` trained alike.

    micro_batches: one packing (cu_seqlens) per micro-batch; every step runs them all.
    data_parallel: D data-parallel replicas of every placement (a world of D * tp * cp ranks); DP
    rank d runs micro-batches d, d + D, ...: their count must be a multiple of D. The loss's
    `micro_batches` argument is still the step's whole count, so the default loss and reduction
    (a sum over CP and DP) give the reference's gradients.
    x `[1, T, hidden_size]` and dy `[1, T, output_size or hidden_size]` are drawn from N(0, 1)
    per step and micro-batch, seeded by `seed`. `reference` is not changed (a copy trains).
    bitwise_replicated: TP-replicated gradients and parameters must be bit-identical across TP
    ranks; False compares them to rtol.
    recompute: False, "reentrant" or "non-reentrant" (True: "non-reentrant"): every forward of the
    layer on the ranks runs under torch.utils.checkpoint; every step must also equal the same steps
    without recompute bitwise, and every replay issue its forward's collectives
    (`pytest_linattn.harness.recompute`).
    Returns the reference's steps: [{"loss", "grad_norm", "clipped"}] (clipped: the norm was
    over max_norm), so a test can check that clipping bit. AssertionError with every failing
    check otherwise.
    """
    __tracebackhide__ = True
    rtol = check_rtol(rtol)
    recompute = check_recompute(recompute)
    if not isinstance(layer, ShardedLayer):
        raise ValueError(f"layer must be a ShardedLayer, got {type(layer).__name__}")
    layer.require_unshard("the training-step check (assert_training_parity)")
    if not isinstance(reference, torch.nn.Module):
        raise ValueError(f"reference must be a torch.nn.Module, got {type(reference).__name__}")
    if not isinstance(step, TrainingStep):
        raise ValueError(f"step must be a TrainingStep, got {type(step).__name__}")
    positive_int(hidden_size, "hidden_size")
    positive_int(data_parallel, "data_parallel")
    if output_size is not None:
        positive_int(output_size, "output_size")
    check_seed(seed)
    placements = list(placements)
    if not placements or not all(isinstance(p, Placement) for p in placements):
        raise ValueError("placements must hold at least one Placement, and only Placements")
    if isinstance(micro_batches, torch.Tensor) or not isinstance(micro_batches, Sequence) or not micro_batches:
        raise ValueError("micro_batches must be a non-empty list of cu_seqlens, one packed batch per micro-batch")
    packings = [as_cu_seqlens(cu) for cu in micro_batches]
    if len(packings) % data_parallel:
        raise ValueError(f"micro_batches: {len(packings)} micro-batches cannot be dealt evenly to data_parallel="
                         f"{data_parallel} ranks (DP rank d runs micro-batches d, d + {data_parallel}, ...): "
                         f"give a multiple of {data_parallel}")
    for p in placements:
        check_one_stage(p, "the training-step check")
        for m, cu in enumerate(packings):
            try:
                check_fits([int(b) for b in cu.tolist()], p)
            except ValueError as exc:
                raise ValueError(f"micro_batches[{m}] at placement {p.name}: {exc}") from None

    gen = torch.Generator().manual_seed(seed)
    out = output_size or hidden_size
    xs, dys = [], []
    for _ in range(step.steps):
        xs.append([torch.randn(1, int(cu[-1]), hidden_size, generator=gen, dtype=torch.float64) for cu in packings])
        dys.append([torch.randn(1, int(cu[-1]), out, generator=gen, dtype=torch.float64) for cu in packings])
    ref_steps = _reference_steps(reference, packings, xs, dys, step, reference_forward)
    weights = None if layer.shard is None else {n: q.detach() for n, q in reference.named_parameters()}
    prefix = f"{name}/" if name else ""
    worlds: dict[int, list[Placement]] = {}
    for p in placements:
        worlds.setdefault(p.size * data_parallel, []).append(p)
    dp_name = f"/dp{data_parallel}" if data_parallel > 1 else ""
    for world, group in worlds.items():
        cases = [RankTraining(layer, p, weights, packings, xs, dys, dtype, step, data_parallel, recompute)
                 for p in group]
        per_rank = spawn(run_training_on_rank, world, cases)
        for j, p in enumerate(group):
            results, label = [r[j] for r in per_rank], f"{prefix}{p.name}{dp_name}/seed{seed}"
            replay = []
            if recompute:  # each rank: (the steps under recompute, the steps without, the forwards' calls)
                label += f"/recompute-{recompute}"
                replay = training_recompute_failures(label, recompute, p, results)
                results = [r[0] for r in results]
            try:
                _check_steps(layer, p, results, ref_steps, rtol, bitwise_replicated, label, packings, data_parallel)
            except AssertionError as exc:
                raise AssertionError("\n\n".join([str(exc)] + replay)) from None
            if replay:
                raise AssertionError(f"recompute check failed for case {label}: {len(replay)} failing check(s)\n\n"
                                     + "\n\n".join(replay))
    return [{"loss": float(loss), "grad_norm": float(norm),
             "clipped": step.max_norm is not None and float(norm) > step.max_norm}
            for loss, norm, *_ in ref_steps]


def _reference_steps(reference, packings, xs, dys, step: TrainingStep, reference_forward):
    """The replicated layer's (loss, grad norm, gradients, parameters, [each micro-batch's loss])
    after every step."""
    ref = copy.deepcopy(reference)
    dtype = next(ref.parameters()).dtype
    params = list(ref.parameters())
    optimizer = step.optimizer(params)
    loss_fn = step.loss or default_loss
    M = len(packings)
    steps = []
    with torch.enable_grad():
        for s in range(step.steps):
            optimizer.zero_grad(set_to_none=True)
            loss, parts = torch.zeros((), dtype=torch.float64), []
            for m, cu in enumerate(packings):
                x, dy = xs[s][m].to(dtype), dys[s][m].to(dtype)
                y = reference_forward(ref, x, cu) if reference_forward else ref(x, cu)
                part = loss_fn(y, dy, int(cu[-1]), M)
                part.backward()
                parts.append(part.detach().double())
                loss += parts[-1]
            grads = {n: None if q.grad is None else q.grad.detach().clone() for n, q in ref.named_parameters()}
            norm = torch.stack([g.double().pow(2).sum() for g in grads.values() if g is not None]).sum().sqrt()
            if step.max_norm is not None:
                torch.nn.utils.clip_grads_with_norm_([q for q in params if q.grad is not None], step.max_norm, norm)
            optimizer.step()
            steps.append((loss, norm, grads, {n: q.detach().clone() for n, q in ref.named_parameters()}, parts))
    return steps


def _check_steps(layer, p: Placement, results, ref_steps, rtol, bitwise, case_name, packings, dp) -> None:
    """Every step's checks; one AssertionError with all that fail, naming step and ranks."""
    __tracebackhide__ = True
    tp, cp = p.tp, p.cp
    names = set(results[0][0][2])
    unknown = sorted(layer.replicated - names)
    if unknown:
        raise ValueError(f"ShardedLayer.replicated names {unknown}, not parameters of the built module "
                         f"(its parameters: {sorted(names)})")
    describe = None
    if layer.describe_grad_element is not None:
        def describe(tensor, index):
            return layer.describe_grad_element(tensor, index, p)
    failures = []

    def collect(check, *args, **kwargs):
        try:
            check(*args, **kwargs)
        except AssertionError as exc:  # keep going: which tensors break, and from which step, tells
            failures.append(str(exc))

    for s, (loss_ref, norm_ref, grads_ref, weights_ref, parts_ref) in enumerate(ref_steps):
        label = f"{case_name} step {s + 1}/{len(ref_steps)} ({len(packings)} micro-batches)"

        def at(t, c, d, s=s):
            return results[t + tp * (c + cp * d)][s]

        # the loss: parts of ranks holding different tokens add up (every TP rank holds its CP
        # rank's tokens unless SP splits them; DP ranks hold different micro-batches)
        tp_holders = range(tp) if p.sequence_parallel else (0,)
        holders = [(t, c, d) for d in range(dp) for c in range(cp) for t in tp_holders]
        before = len(failures)
        collect(assert_parity, sum(at(*h)[0] for h in holders), loss_ref, rtol=rtol, name=f"{label} loss")
        if len(failures) > before:
            # a wrong loss: each micro-batch's, from the ranks holding its tokens (DP rank m % dp), says
            # which one goes wrong. Only then: a micro-batch's loss is a sum of terms of both signs, so
            # a client's float32 rounding, within rtol on every tensor, can exceed rtol on it
            parts = [sum(at(t, c, m % dp)[4][m] for c in range(cp) for t in tp_holders) for m in range(len(packings))]
            collect(_check_micro_batch_losses, parts, parts_ref, packings, rtol, f"{label} loss by micro-batch")
        if not p.sequence_parallel:
            for t, c, d in ((t, c, d) for t in range(1, tp) for c in range(cp) for d in range(dp)):
                collect(assert_parity, at(t, c, d)[0], at(0, c, d)[0], rtol=rtol,
                        name=f"{label} loss part of TP rank {t} vs TP rank 0 ({_ranks(c, d, dp)}), the same tokens")
        collect(_check_norms, {(t, c, d): at(t, c, d)[1] for d in range(dp) for c in range(cp) for t in range(tp)},
                norm_ref, rtol, f"{label} grad norm", dp)
        for k, what, ref in ((2, "grad", grads_ref), (3, "weight", weights_ref)):
            for c, d in ((c, d) for d in range(dp) for c in range(cp)):
                where = f" ({_ranks(c, d, dp)})" if cp * dp > 1 else ""
                if tp > 1:
                    for n in sorted(layer.replicated):
                        collect(check_replicated, label, n, [at(t, c, d)[k][n] for t in range(tp)], where, rtol,
                                bitwise, what=what)
                whole = layer.unshard([at(t, c, d)[k] for t in range(tp)], p)
                collect(assert_parity, whole, ref, rtol=rtol, name=f"{label} {what}{where}", describe=describe,
                        activations=False)
    if failures:
        raise AssertionError(f"training-step parity failed for case {case_name}: {len(failures)} failing check(s)\n\n"
                             + "\n\n".join(failures))


def _check_micro_batch_losses(parts, parts_ref, packings, rtol: float, name: str) -> None:
    """Each micro-batch's loss (its parts added over the ranks holding its tokens) against the
    reference's, naming the first micro-batch that is off and every one that is off or right:
    a bug that carries something from one micro-batch to the next (a cache, metadata, a buffer)
    leaves the first right and the later ones wrong."""
    __tracebackhide__ = True
    errors = []
    for got, ref in zip(parts, parts_ref):
        got, ref = float(got), float(ref)
        errors.append(abs(got - ref) / abs(ref) if ref else abs(got))
    off = [m for m, e in enumerate(errors) if not (math.isfinite(float(parts[m])) and e <= rtol)]
    if not off:
        return
    m, total = off[0], len(parts)
    right = [n + 1 for n in range(total) if n not in off]
    cu = [int(b) for b in packings[m].tolist()]
    raise AssertionError(
        f"{name}: micro-batch {m + 1} of {total} is the first off (cu_seqlens {cu}): "
        f"{float(parts[m]):.6e}, the reference's {float(parts_ref[m]):.6e} (relative error {errors[m]:.2e}); "
        f"off: micro-batches {[n + 1 for n in off]}; right: {right if right else 'none'}")


def _ranks(c: int, d: int, dp: int) -> str:
    return f"CP rank {c}" + (f", DP rank {d}" if dp > 1 else "")


def _check_norms(norms: dict, ref: torch.Tensor, rtol: float, name: str, dp: int) -> None:
    """Every rank's gradient norm against the reference's, naming the ranks that are off."""
    __tracebackhide__ = True
    expected = float(ref)
    off = []
    for (t, c, d), norm in norms.items():
        got = float(norm)
        err = abs(got - expected) / abs(expected) if expected else abs(got)
        if not math.isfinite(got) or not err <= rtol:
            off.append(f"TP rank {t}, {_ranks(c, d, dp)}: {got:.6e} (relative error {err:.2e})")
    if off:
        raise AssertionError(f"{name}: the reference's is {expected:.6e} (rtol {rtol:.0e}); off on "
                             f"{len(off)} of {len(norms)} rank(s):\n  " + "\n  ".join(off))
    assert_parity(torch.stack([n.double() for n in norms.values()]), ref.double().expand(len(norms)), rtol=rtol,
                  name=name)
