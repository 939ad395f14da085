"""What a rank of a sharded-parity spawn runs: build the sharded layer, load its shard of the
weights, run forward and backward on the rank's tokens; the test process
(`pytest_linattn.harness.sharded_parity`) puts the results back together. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..mutation.sites import hands_over
from .cases import ParityCase, ShardedLayer
from .placement import Placement, padded_batch, padded_cu_seqlens, rank_token_index
from .recompute import recorded_forward

__all__ = ["RankCase", "load_shard", "run_cases_on_rank", "run_device", "whole"]


@dataclasses.dataclass(frozen=True)
class RankCase:
    """What a rank needs of a ParityCase (the reference stays in the test process)."""

    layer: ShardedLayer
    placement: Placement
    weights: dict
    cu_seqlens: torch.Tensor
    x: torch.Tensor
    dy: torch.Tensor
    dtype: torch.dtype
    recompute: bool | str = False
    cu_seqlens_padded: torch.Tensor | None = None  # a padded placement's (x and dy then hold the pads)

    @classmethod
    def of(cls, case: ParityCase) -> RankCase:
        weights = {n: p.detach() for n, p in case.reference.named_parameters()}
        x, dy = padded_batch(case.x, case.dy, case.cu_seqlens, case.placement)
        padded = padded_cu_seqlens(case.cu_seqlens, case.placement) if case.placement.padded else None
        return cls(case.layer, case.placement, weights, case.cu_seqlens, x, dy, case.dtype, case.recompute, padded)


def run_cases_on_rank(cases: Sequence[RankCase]):
    """Rank function (for spawn): this rank's (y, dx, parameter grads) of every case; under
    recompute (y, dx, grads) of the checkpointed run, then the same run's without recompute, and
    the checkpointed forward's collectives per call (`recompute.recorded_forward`).

    Cases run grouped by (process_groups, tp, cp), in first-appearance order, so a client with
    global parallel state initialises it once per group of cases."""
    import torch.distributed as dist

    rank, device = dist.get_rank(), run_device()
    order: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        order.setdefault((c.layer.process_groups, c.placement.tp, c.placement.cp), []).append(i)
    results = [None] * len(cases)
    for (make_groups, _, _), indices in order.items():
        groups = make_groups(cases[indices[0]].placement)
        for i in indices:
            results[i] = _run_case(cases[i], groups, rank, device)
    return results


def run_device() -> torch.device:
    """This rank's device: its GPU when the ranks run on GPUs (NCCL, or the staged transport of
    ranks sharing GPUs: the pool or the launcher says so), else the CPU."""
    import os

    import torch.distributed as dist

    from ..ranks.worker import RANK_DEVICE_ENV

    on_gpu = os.environ.get(RANK_DEVICE_ENV, "cuda" if dist.get_backend() == "nccl" else "cpu") == "cuda"
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


@hands_over("the harness's hand-over of a DTensor")  # the check's own gather: collective mutants leave it alone
def whole(t):
    """t, or the whole tensor of a DTensor (collective: every rank calls it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def load_shard(module: torch.nn.Module, local: dict, owner: str = "ShardedLayer") -> None:
    """`local` (the client's shard) into the built module's parameters; ValueError naming
    `owner`.shard where the names or shapes differ."""
    params = dict(module.named_parameters())
    missing, unexpected = sorted(params.keys() - local.keys()), sorted(local.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"{owner}.shard must return exactly the built module's parameters: "
                         f"missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for n, param in params.items():
            if tuple(local[n].shape) != tuple(param.shape):
                raise ValueError(f"{owner}.shard gave {n} shape {tuple(local[n].shape)}; "
                                 f"the built module's parameter has {tuple(param.shape)}")
            param.copy_(local[n])


def _run_case(case: RankCase, groups, rank: int, device):
    if not case.recompute:
        return _run_once(case, groups, rank, device, False)[:3]
    plain = _run_once(case, groups, rank, device, False)[:3]  # a fresh module each: state from one run stays there
    return (*_run_once(case, groups, rank, device, case.recompute), plain)


def _run_once(case: RankCase, groups, rank: int, device, recompute):
    p = case.placement
    tp_rank, cp_rank = rank % p.tp, rank // p.tp % p.cp
    module = case.layer.build(p, groups, case.dtype, device)
    if case.layer.shard is not None:
        load_shard(module, case.layer.shard(case.weights, p, tp_rank))
    index = rank_token_index(case.cu_seqlens, p, tp_rank, cp_rank)
    x = case.x[:, index].to(device, case.dtype).requires_grad_()
    dy = case.dy[:, index].to(device, case.dtype)
    cu = case.cu_seqlens.to(device)
    padded = {} if case.cu_seqlens_padded is None else {"cu_seqlens_padded": case.cu_seqlens_padded.to(device)}

    def forward(x_in):
        return case.layer.forward(module, x_in, cu, p, **padded) if case.layer.forward else module(x_in, cu, **padded)

    y, calls = recorded_forward(forward, x, recompute)
    (y * dy).sum().backward()
    if case.layer.after_backward is not None:
        case.layer.after_backward(module, p)
    return y.detach(), x.grad, {n: whole(q.grad) for n, q in module.named_parameters()}, calls
