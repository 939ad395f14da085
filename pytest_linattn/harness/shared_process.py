"""Layers sharing the rank processes: state one layer leaves process-wide (a module or class
attribute, a cache keyed by nothing, a global another component overwrites) must not reach
another layer.

A model builds many layers in one process, and a process runs more than one component: a head
count one of them writes to a global and another reads gives the other layer the wrong heads (a
12-head model split over 4 ranks as [4, 4, 4, 0], not [3, 3, 3, 3]). A parity test of one layer at
a time never sees it. `assert_layers_share_a_process` builds every case's sharded layer in the same
rank processes first (in the cases' order, as a model constructs its layers), then runs each one's
forward and backward (in the same order) and compares each with its replicated reference, as
`assert_parity_cases` does. A case that fails there is run again alone (built and run by itself
in the same processes): one that passes alone is reported as process-wide state, naming the
cases built beside it. This module imports no pytest.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cases import ParityCase
from .placement import rank_token_index
from .sharded_parity import _check_case, _reference_run, assert_parity_cases
from .sharded_parity_rank import RankCase, load_shard, run_device, whole

__all__ = ["assert_layers_share_a_process", "run_cases_sharing_processes"]


def assert_layers_share_a_process(spawn, cases: Sequence[ParityCase], *, bitwise_replicated: bool = True) -> None:
    """Every case's layer built in the same rank processes before any of them runs, then each run
    and compared with its reference (output, input gradient, every parameter gradient within the
    case's rtol). AssertionError naming each failing case; for one that passes when built and run
    alone, first a line saying the layers share process-wide state. The cases (at least two, their
    layers configured differently: other sizes, other families) must span one world size."""
    __tracebackhide__ = True
    cases = list(cases)
    if len(cases) < 2 or not all(isinstance(c, ParityCase) for c in cases):
        raise ValueError("cases must be a sequence of at least two ParityCase (the layers that share the processes)")
    sizes = {c.placement.size for c in cases}
    if len(sizes) != 1:
        raise ValueError(f"cases must span one world size (tp * cp), got {sorted(sizes)}")
    if any(c.recompute or c.placement.padded for c in cases):
        raise ValueError("cases sharing a process run without recompute and padded layouts (check those alone)")
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"cases must have distinct names (the report tells them apart by name), got {names}")
    runs: dict = {}
    references = [_reference_run(c, runs) for c in cases]
    per_rank = spawn(run_cases_sharing_processes, sizes.pop(), [RankCase.of(c) for c in cases])
    reports = []
    for i, case in enumerate(cases):
        try:
            _check_case(case, [r[i] for r in per_rank], references[i], bitwise_replicated)
        except AssertionError as exc:
            reports.append(_diagnose(spawn, cases, i, str(exc), bitwise_replicated))
    if reports:
        raise AssertionError(f"layers sharing a process: {len(reports)} of {len(cases)} case(s) failed\n\n"
                             + "\n\n".join(reports))


def _diagnose(spawn, cases, i, report, bitwise_replicated) -> str:
    """The failing case's report, after a line saying it is process-wide state when the case passes
    built and run alone."""
    case = cases[i]
    try:
        assert_parity_cases(spawn, [case], bitwise_replicated=bitwise_replicated)
    except AssertionError:
        return report  # off alone too: a bug of its own
    others = [c.name for j, c in enumerate(cases) if j != i]
    order = ", ".join(c.name for c in cases)
    return (f"process-wide state: case {case.name} is off when the layers of {', '.join(others)} are built in the same "
            f"rank processes (built, then run, in the order {order}), and right when built and run alone: a value "
            f"one layer leaves process-wide (a module or class attribute, a cache keyed by nothing, a global "
            f"another component overwrites) reaches another\n{report}")


def run_cases_sharing_processes(cases: Sequence[RankCase]):
    """Rank function (for spawn): every case's module built and loaded first, in order (each
    placement's process groups made once, before its first case's build), then each case's forward
    and backward in order; this rank's (y, dx, parameter grads) per case."""
    import torch.distributed as dist

    rank, device = dist.get_rank(), run_device()
    groups: dict = {}
    modules = []
    for c in cases:
        key = (c.layer.process_groups, c.placement.tp, c.placement.cp)
        if key not in groups:
            groups[key] = c.layer.process_groups(c.placement)
        p = c.placement
        module = c.layer.build(p, groups[key], c.dtype, device)
        if c.layer.shard is not None:
            load_shard(module, c.layer.shard(c.weights, p, rank % p.tp))
        modules.append(module)
    results = []
    for c, module in zip(cases, modules):
        p = c.placement
        tp_rank, cp_rank = rank % p.tp, rank // p.tp % p.cp
        index = rank_token_index(c.cu_seqlens, p, tp_rank, cp_rank)
        x = c.x[:, index].to(device, c.dtype).requires_grad_()
        dy = c.dy[:, index].to(device, c.dtype)
        cu = c.cu_seqlens.to(device)
        y = c.layer.forward(module, x, cu, p) if c.layer.forward else module(x, cu)
        (y * dy).sum().backward()
        if c.layer.after_backward is not None:
            c.layer.after_backward(module, p)
        results.append((y.detach(), x.grad, {n: whole(q.grad) for n, q in module.named_parameters()}))
    return results
