"""What a rank of a training-step spawn runs: build the sharded layer, load its shard, then every
step: each micro-batch's forward, loss and backward (gradients accumulating, the client's
`after_backward` after each), the trainer's reduction, the gradient norm, clipping and the
optimizer step; a snapshot of what the test process compares after every step. The test
process: `pytest_linattn.harness.training_step`. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses

import torch

from .cases import ShardedLayer, TrainingStep
from .placement import Placement, default_process_groups, rank_token_index
from .recompute import recorded_forward
from .sharded_parity_rank import load_shard, run_device, whole

__all__ = ["RankTraining", "default_grad_norm", "run_training_on_rank", "sum_grads_over"]


@dataclasses.dataclass(frozen=True)
class RankTraining:
    """What a rank needs of a training case: x[step][micro_batch], dy likewise (whole batches)."""

    layer: ShardedLayer
    placement: Placement
    weights: dict | None
    micro_batches: list
    x: list
    dy: list
    dtype: torch.dtype
    step: TrainingStep
    data_parallel: int = 1  # DP rank d takes micro-batches d, d + data_parallel, ...
    recompute: bool | str = False  # the layer's forward under torch.utils.checkpoint (harness.recompute)


def default_loss(y, dy, tokens, micro_batches):
    """A token mean over the whole micro-batch, averaged over the micro-batches (this rank's part)."""
    return (y * dy).sum() / (tokens * micro_batches)


def sum_grads_over(module: torch.nn.Module, group) -> None:
    """Every gradient summed over `group` (the default reduction: over the CP and DP ranks)."""
    import torch.distributed as dist

    if group is None:
        return
    for q in module.parameters():
        if q.grad is not None:
            dist.all_reduce(q.grad, group=group)


def default_grad_norm(module: torch.nn.Module, replicated, tp_group) -> torch.Tensor:
    """The global gradient norm, each parameter counted once: TP-sharded squares summed over
    `tp_group`; the `replicated` ones and DTensor gradients (whole on every rank) once. In a
    module that holds DTensors (a DTensor TP plan), the plain parameters are the replicated ones.
    float64."""
    import torch.distributed as dist

    params = list(module.named_parameters())
    plan = any(hasattr(q, "full_tensor") for _, q in params)
    device = params[0][1].device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    once = torch.zeros((), dtype=torch.float64, device=device)
    for name, q in params:
        if q.grad is None:
            continue
        if plan or name in replicated:
            once += whole(q.grad).double().pow(2).sum()
        else:
            sharded += q.grad.double().pow(2).sum()
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    return (sharded + once).sqrt()


def run_training_on_rank(cases):
    """Rank function (for spawn): per case, per step, (loss part, grad norm, gradients after the
    reduction, parameters after the optimizer step, {micro-batch: its loss part}), whole tensors on
    this rank. Under recompute, per case (those steps, the same steps without recompute, the
    checkpointed forwards' collectives as {(step, micro-batch): calls per call of the forward})."""
    import torch.distributed as dist

    rank, device = dist.get_rank(), run_device()
    # Groups are made once per (process_groups, tp, cp), collectively (every rank the same).
    client_groups, harness_groups = {}, {}
    results = []
    for case in cases:
        p, make = case.placement, case.layer.process_groups
        at = (make, p.tp, p.cp)
        if at not in client_groups:
            client_groups[at] = make(p)
        # The harness's own reduction and norm need the TP group and the group of this rank's CP
        # and DP peers (the ranks of its TP rank), whatever the client's groups are: made only for
        # a step that uses them.
        if (case.step.finalize_grads is None or case.step.grad_norm is None) and at not in harness_groups:
            groups = client_groups[at]
            tp_group, cp_group = groups if make is default_process_groups else default_process_groups(p)
            peers = cp_group if dist.get_world_size() == p.size else _same_tp_rank_group(p.tp, rank)
            harness_groups[at] = (tp_group, peers)
        snapshots, calls = _train(case, client_groups[at], harness_groups.get(at), rank, device, case.recompute)
        if case.recompute:  # the same steps without recompute, on a fresh module, to compare bitwise
            plain, _ = _train(case, client_groups[at], harness_groups.get(at), rank, device, False)
            results.append((snapshots, plain, calls))
        else:
            results.append(snapshots)
    return results


def _same_tp_rank_group(tp: int, rank: int):
    """The ranks holding the same TP shard: every CP and DP rank of this rank's TP rank.
    Collective: every rank makes every group."""
    import torch.distributed as dist

    world, mine = dist.get_world_size(), None
    for t in range(tp):
        group = dist.new_group(list(range(t, world, tp)))
        if t == rank % tp:
            mine = group
    return mine


def _train(case: RankTraining, groups, own, rank: int, device, recompute):
    p, layer, step = case.placement, case.layer, case.step
    tp_rank, cp_rank, dp_rank = rank % p.tp, rank // p.tp % p.cp, rank // (p.tp * p.cp)
    module = layer.build(p, groups, case.dtype, device)
    if layer.shard is not None:
        load_shard(module, layer.shard(case.weights, p, tp_rank))
    params = list(module.parameters())
    optimizer = step.optimizer(params)
    loss_fn = step.loss or default_loss
    M = len(case.micro_batches)
    snapshots, calls = [], {}
    for s in range(step.steps):
        parts = {}  # this rank's loss part of each of its micro-batches
        if step.zero_grads is not None:
            step.zero_grads(module, optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), dtype=torch.float64)
        for m in range(dp_rank, M, case.data_parallel):  # this DP rank's share of the step's micro-batches
            cu = case.micro_batches[m]
            index = rank_token_index(cu, p, tp_rank, cp_rank)
            x = case.x[s][m][:, index].to(device, case.dtype)
            dy = case.dy[s][m][:, index].to(device, case.dtype)
            cu_here = cu.to(device)

            def forward(x_in, cu_here=cu_here):
                return layer.forward(module, x_in, cu_here, p) if layer.forward else module(x_in, cu_here)

            y, calls[s, m] = recorded_forward(forward, x, recompute)
            part = loss_fn(y, dy, int(cu[-1]), M)
            part.backward()
            if layer.after_backward is not None:
                layer.after_backward(module, p)
            parts[m] = part.detach().double().cpu()
            loss += parts[m]
        if step.finalize_grads is not None:
            step.finalize_grads(module, p, groups)
        else:
            sum_grads_over(module, own[1])
        norm = (step.grad_norm(module, p, groups) if step.grad_norm is not None
                else default_grad_norm(module, layer.replicated, own[0]))
        grads = {n: _snapshot(q.grad) for n, q in module.named_parameters()}
        if step.max_norm is not None:
            clip = step.clip or torch.nn.utils.clip_grads_with_norm_
            clip([q for q in params if q.grad is not None], step.max_norm, norm)
        optimizer.step()
        weights = {n: _snapshot(q.detach()) for n, q in module.named_parameters()}
        snapshots.append((loss, torch.as_tensor(whole(norm)).detach().double().cpu(), grads, weights, parts))
    return snapshots, calls


def _snapshot(t):
    return None if t is None else whole(t).detach().clone()
