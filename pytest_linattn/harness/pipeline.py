"""Pipeline parallel: a client's stack of layers split into pp stages by contiguous layer ranges
(`stage_layers`), TP and CP inside each stage (`Placement(tp, cp, pp)`), against the replicated
stack in float64.

    assert_pipeline_parity         one forward and backward: stage s receives stage s-1's output
                                   over a point-to-point hand-off (`linattn.parallel.pipeline`),
                                   the last stage's loss is sum(y * dy), each stage sends its input
                                   gradient back. Compared: every stage's output (the hidden state
                                   after its last layer), every stage's input gradient (stage 0's
                                   is dx), every layer's parameter gradients (put back together by
                                   the client's `unshard`, summed over CP; TP-replicated ones equal
                                   on every TP rank), each named by stage and layer.
    assert_pipeline_decode_parity  the decode path: every sequence's prompt prefilled in one packed
                                   call through the stages, then its last tokens decoded one at a
                                   time, each stage keeping its own layers' caches (keyed by global
                                   layer index); the decode batch changes as sequences finish (by
                                   default every odd sequence decodes one token, the others two, so
                                   the rows after a finished one move up). Compared with one full
                                   forward of the replicated stack: every call's output on every
                                   stage, and every layer's cache after the last call, per sequence.

A failure names the case, the stage and its layers, the tensor, and where it first went wrong:
the first stage whose output is off in the forward (the ones before it right), or the first
(call, stage) of the decode path, with its row and sequence. Where a stage's TP shards of the
weights, put back together by `unshard`, are not the reference's weights of its layers, it says
so first, naming the layer whose weights a stage holds instead.

The reference is the replicated stack: an nn.Module whose `layers` holds the stack's layers in
order, layer i's parameters named `layers.{i}.<name>`; layer i runs as `reference.layers[i](x,
cu_seqlens)` (decode check: `reference.layers[i](x, cu_seqlens, None, output_final_state=True)`
-> (y, state)). The harness composes them itself. The world is tp * cp * pp ranks (the stage
outermost: `placement`'s docstring); placements of one world size share a spawn call.
This module imports no pytest:

    pipeline         the entries, the references
    pipeline_report  the comparisons of one placement and their words
    pipeline_rank    what each rank runs
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .cases import PipelineStack
from .pipeline_rank import RankPipeline, run_pipeline_on_rank, stage_layers
from .pipeline_report import check_decode, check_train
from .placement import Placement, as_cu_seqlens, check_fits, check_placements, check_seed

__all__ = ["assert_pipeline_decode_parity", "assert_pipeline_parity", "decode_counts", "stage_layers"]

LAYER_NAME = re.compile(r"layers\.(\d+)\.")


def assert_pipeline_parity(spawn, stack: PipelineStack, reference: torch.nn.Module, placements: Sequence[Placement],
                           cu_seqlens, *, hidden_size: int, seed: int, rtol: float, dtype: torch.dtype = torch.float64,
                           bitwise_replicated: bool = True, name: str = "") -> None:
    """`stack` at every placement against the replicated `reference`: one forward and backward
    through the stages (module docstring); AssertionError naming every failing placement, the
    stage, the layer and the tensor. x and dy `[1, T, hidden_size]` ~ N(0, 1) seeded by `seed`.
    bitwise_replicated: TP-replicated gradients bit-identical across TP ranks (False: to rtol)."""
    __tracebackhide__ = True
    cu, placements, rtol = _check_arguments(stack, reference, placements, cu_seqlens, hidden_size, seed, rtol)
    for p in placements:
        check_fits([int(b) for b in cu.tolist()], p)
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(1, int(cu[-1]), hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    expected = _reference_train(reference, stack.num_layers, x, dy, cu)
    weights = {n: q.detach() for n, q in reference.named_parameters()}
    cases = [RankPipeline("train", stack, p, weights, cu, x, dtype, dy=dy) for p in placements]
    _run(spawn, cases, name, seed, lambda label, case, results: check_train(
        label, case, results, expected, rtol, bitwise_replicated, weights))


def assert_pipeline_decode_parity(spawn, stack: PipelineStack, reference: torch.nn.Module,
                                  placements: Sequence[Placement], cu_seqlens, *, hidden_size: int, seed: int,
                                  rtol: float, decode: Sequence[int] | None = None, dtype: torch.dtype = torch.float64,
                                  name: str = "") -> None:
    """`stack`'s decode path at every placement against one full forward of the replicated
    `reference` (module docstring). cu_seqlens: the whole sequences; sequence n's last decode[n]
    tokens are decoded one at a time after its prompt (the rest) is prefilled (default
    `decode_counts`). Placements: TP, contiguous CP (the prefill split over the CP ranks, the decode
    steps whole on every rank), no sequence parallel; tp > 1 needs `PipelineStack.unshard_state`.
    x `[1, T, hidden_size]` ~ N(0, 1) seeded by `seed`."""
    __tracebackhide__ = True
    cu, placements, rtol = _check_arguments(stack, reference, placements, cu_seqlens, hidden_size, seed, rtol)
    bounds = [int(b) for b in cu.tolist()]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    counts = decode_counts(len(lengths)) if decode is None else decode
    if (isinstance(counts, (str, torch.Tensor)) or not isinstance(counts, Sequence) or len(counts) != len(lengths)
            or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < n for d, n in zip(counts, lengths))
            or not any(counts)):
        raise ValueError(f"decode must give each of the {len(lengths)} sequences an int number of decoded tokens, "
                         f">= 0 and below its length {lengths} (a prompt of one token at least), one > 0 at least; "
                         f"got {decode!r}" + (f" (the default, decode_counts: {counts})" if decode is None else ""))
    prompt_cu = torch.tensor([0] + [n - d for n, d in zip(lengths, counts)]).cumsum(0).to(torch.int32)
    for p in placements:
        if p.sequence_parallel or (p.cp > 1 and p.cp_layout != "contiguous"):
            raise ValueError(f"placements: the decode check runs TP and contiguous CP without sequence parallel, got "
                             f"{p.name} (cp_layout {p.cp_layout!r}, sequence_parallel {p.sequence_parallel})")
        if p.tp > 1 and stack.unshard_state is None:
            raise ValueError(f"placement {p.name}: tp > 1 needs PipelineStack.unshard_state (the caches are "
                             "compared as the replicated layer's)")
        try:
            check_fits([int(b) for b in prompt_cu.tolist()], p)
        except ValueError as exc:
            raise ValueError(f"the prompts (cu_seqlens {prompt_cu.tolist()}, decode {list(counts)}) at placement "
                             f"{p.name}: {exc}") from None
    prompt_tokens = torch.cat([torch.arange(a, b - d) for a, b, d in zip(bounds, bounds[1:], counts)])
    steps = tuple((tuple(n for n, d in enumerate(counts) if j < d),
                   torch.tensor([bounds[n + 1] - d + j for n, d in enumerate(counts) if j < d]))
                  for j in range(max(counts)))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, bounds[-1], hidden_size, generator=gen, dtype=torch.float64)
    expected = _reference_decode(reference, stack.num_layers, x, cu)
    weights = {n: q.detach() for n, q in reference.named_parameters()}
    cases = [RankPipeline("decode", stack, p, weights, prompt_cu, x, dtype, prompt_tokens=prompt_tokens, steps=steps)
             for p in placements]
    _run(spawn, cases, name, seed, lambda label, case, results: check_decode(
        label, case, results, expected, rtol, bounds, list(counts)), what="decode parity")


def decode_counts(num_sequences: int) -> list[int]:
    """The default decoded tokens per sequence: 2 for an even sequence, 1 for an odd one, so the
    second decode step runs without the odd ones and the rows after each move up."""
    return [1 if n % 2 else 2 for n in range(num_sequences)]


def _check_arguments(stack, reference, placements, cu_seqlens, hidden_size, seed, rtol):
    __tracebackhide__ = True
    if not isinstance(stack, PipelineStack):
        raise ValueError(f"stack must be a PipelineStack, got {type(stack).__name__}")
    if not isinstance(reference, torch.nn.Module):
        raise ValueError(f"reference must be a torch.nn.Module (the replicated stack), got {type(reference).__name__}")
    layers = getattr(reference, "layers", None)
    if not isinstance(layers, (torch.nn.ModuleList, Sequence)) or len(layers) != stack.num_layers:
        raise ValueError(f"reference.layers must hold the stack's num_layers={stack.num_layers} layers in order, got "
                         f"{type(layers).__name__ if layers is None else len(layers)}")
    outside = [n for n, _ in reference.named_parameters()
               if not (LAYER_NAME.match(n) and int(LAYER_NAME.match(n).group(1)) < stack.num_layers)]
    if outside:
        raise ValueError(f"reference: every parameter must be a layer's, named layers.<i>.<name> with i < "
                         f"{stack.num_layers}; not so: {outside}")
    cu = as_cu_seqlens(cu_seqlens)
    positive_int(hidden_size, "hidden_size")
    check_seed(seed)
    placements = check_placements(placements)
    for p in placements:
        if p.pp > stack.num_layers:
            raise ValueError(f"Placement.pp must be at most the stack's num_layers={stack.num_layers} (a stage holds "
                             f"one layer at least), got {p.name}")
    return cu, placements, check_rtol(rtol)


def _run(spawn, cases, name, seed, check, what="parity"):
    """Each world's cases in one spawn call; every failing placement reported."""
    __tracebackhide__ = True
    worlds: dict[int, list[int]] = {}
    for i, case in enumerate(cases):
        worlds.setdefault(case.placement.size, []).append(i)
    reports, passed = [], []
    prefix = f"{name}/" if name else ""
    for world, indices in worlds.items():
        per_rank = spawn(run_pipeline_on_rank, world, [cases[i] for i in indices])
        for j, i in enumerate(indices):
            p = cases[i].placement
            report = check(f"{prefix}{p.name}/seed{seed}", cases[i], [r[j] for r in per_rank])
            (reports if report else passed).append((p.name, report))
    if reports:
        raise AssertionError(
            f"pipeline {what} failed at {len(reports)} of {len(cases)} placement(s): "
            f"{', '.join(n for n, _ in reports)}" + (f" (passed: {', '.join(n for n, _ in passed)})" if passed else "")
            + "\n\n" + "\n\n".join(r for _, r in reports))


def _reference_train(reference, num_layers, x, dy, cu):
    """The replicated stack, layer by layer: the hidden state after each layer, the gradient of
    each layer's input (the loss sum(y * dy) on the last layer's output), parameter gradients."""
    dtype = next(reference.parameters()).dtype
    for q in reference.parameters():
        q.grad = None
    x = x.detach().to(dtype).requires_grad_()
    hidden, h = [], x
    with torch.enable_grad():
        for i in range(num_layers):
            h = reference.layers[i](h, cu)
            h.retain_grad()
            hidden.append(h)
        (h * dy.to(dtype)).sum().backward()
    inputs = [x] + hidden[:-1]
    return dict(hidden=[h.detach().double() for h in hidden], input_grads=[t.grad.double() for t in inputs],
                grads={n: None if q.grad is None else q.grad.double() for n, q in reference.named_parameters()})


def _reference_decode(reference, num_layers, x, cu):
    """One full forward of the replicated stack from empty states: the hidden state after each
    layer at every token, and each layer's final state."""
    dtype = next(reference.parameters()).dtype
    hidden, states, h = [], [], x.to(dtype)
    with torch.no_grad():
        for i in range(num_layers):
            h, state = reference.layers[i](h, cu, None, output_final_state=True)
            hidden.append(h.double())
            states.append(type(state)(*(t.double() for t in state)) if hasattr(state, "_fields")
                          else tuple(t.double() for t in state))
    return dict(hidden=hidden, states=states)
