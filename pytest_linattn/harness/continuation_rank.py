"""What a rank of a continuation check runs: build the client's layer, load its weights, then
every call of the schedule in order (prefill chunks, then decode steps), each sequence's state
carried from one call to its next, then the backward call by call (`_backward`); the test process
(`pytest_linattn.harness.continuation`) puts the results together. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses

import torch

from .cases import DECODE_LAYOUTS, StatePath
from .placement import Placement
from .sharded_parity_rank import load_shard, run_device

__all__ = ["Call", "RankContinuation", "cp_share", "decode_in_layout", "default_decode", "default_prefill",
           "rank_coordinates", "run_continuation_on_rank"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of the schedule: kind "prefill" (chunk `index` of each sequence) or "decode"
    (step `index`); the sequences it runs and their tokens (global indices, in the call's order);
    a prefill call's boundaries `cu_seqlens` (a filler's included) and filler (input `[1, P,
    hidden]`, initial state rows), or None."""

    kind: str
    index: int
    sequences: tuple
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor | None
    filler: tuple | None


@dataclasses.dataclass(frozen=True)
class RankContinuation:
    """What every rank gets: the client's path, the placement, the replicated weights, the batch's
    input and cotangents, the initial states and their cotangents (replicated layer's layout), the calls."""

    path: StatePath
    placement: Placement
    weights: dict
    x: torch.Tensor
    dy: torch.Tensor
    h0: tuple
    dht: tuple
    calls: list
    dtype: torch.dtype


def default_prefill(module, x, cu_seqlens, state, placement):
    """StatePath.prefill when the client gives none: the layer's forward from `state`."""
    return module(x, cu_seqlens, state, output_final_state=True)


def default_decode(module, x, state, placement):
    """StatePath.decode when the client gives none: the layer's one-token step."""
    return module.step(x, state)


def decode_in_layout(decode, module, x, state, placement, layout):
    """One decode step with its N tokens `[1, N, hidden]` laid out as the client declared
    (StatePath.decode_layout), its output back as `[1, N, hidden]`."""
    batched = layout == "batched"
    x_in = x.transpose(0, 1) if batched else x
    y, new = decode(module, x_in, state, placement)
    if tuple(y.shape[:2]) != tuple(x_in.shape[:2]):
        raise ValueError(f"StatePath.decode returned y of shape {tuple(y.shape)} for x of shape {tuple(x_in.shape)}: "
                         f"decode_layout {layout!r} ({DECODE_LAYOUTS[layout]}) lays out y as x")
    return (y.transpose(0, 1) if batched else y), new


def rank_coordinates(placement: Placement) -> tuple[int, int]:
    """(tp_rank, cp_rank) of this process in `placement` (global rank = tp_rank + tp * cp_rank, the
    order of `placement`'s module docstring)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    return rank % placement.tp, rank // placement.tp % placement.cp


def cp_share(num_tokens: int, num_real: int, cp: int, cp_rank: int) -> tuple[slice, torch.Tensor]:
    """What CP rank `cp_rank` holds of a prefill call of `num_tokens` packed tokens (a multiple of
    cp: the call's `num_real` own tokens, then a filler's, `continuation_plans.cp_filler`): the
    slice of one contiguous piece of num_tokens / cp tokens, and which of them are the call's own
    (`[num_tokens / cp]` bool). The state path's checks split every prefill call so; their decode
    steps run whole on every rank."""
    if num_tokens % cp:
        raise ValueError(f"a prefill call under CP must hold a multiple of cp={cp} tokens (a filler pads it), "
                         f"got {num_tokens}")
    n_local = num_tokens // cp
    piece = slice(cp_rank * n_local, (cp_rank + 1) * n_local)
    return piece, torch.arange(num_tokens)[piece] < num_real


def _rebuild(like, fields):
    return type(like)(*fields) if hasattr(like, "_fields") else type(like)(fields)


def run_continuation_on_rank(case: RankContinuation) -> dict:
    """Rank function (for spawn): this rank's outputs, input gradients, final states and
    initial-state gradients, with masks of the tokens it holds."""
    p, path, device = case.placement, case.path, run_device()
    tp_rank, cp_rank = rank_coordinates(p)
    groups = path.layer.process_groups(p)
    module = path.layer.build(p, groups, case.dtype, device)
    if path.layer.shard is not None:
        load_shard(module, path.layer.shard(case.weights, p, tp_rank))
    prefill = path.prefill or default_prefill
    decode = path.decode or default_decode
    grad = path.differentiable

    def local(state):
        return state if p.tp == 1 else path.shard_state(state, p, tp_rank)

    h0 = local(case.h0)
    dht = [t.to(device, case.dtype) for t in local(case.dht)]
    F, N, T = len(h0), h0[0].shape[0], case.x.shape[1]
    rows = [[t.detach().to(device, case.dtype)[n] for t in h0] for n in range(N)]  # each sequence's current state
    x = case.x.to(device, case.dtype).requires_grad_(grad)
    dy = case.dy.to(device, case.dtype)
    y_out = torch.zeros(1, T, case.x.shape[2], dtype=case.dtype)
    held_here, decoded = (torch.zeros(T, dtype=torch.bool) for _ in range(2))
    runs = []  # per call: (its sequences, its state leaves, y, dy of y, its new state, whether a prefill)
    with torch.set_grad_enabled(grad):
        for call in case.calls:
            fields = [[rows[n][i] for n in call.sequences] for i in range(F)]
            if call.filler is not None:  # its state, [1, ...] per field, sharded as the sequences'
                for i, row in enumerate(local(_rebuild(case.h0, call.filler[1]))):
                    fields[i].append(row.to(device, case.dtype)[0])
            # each call starts from leaves: its backward runs on its own (see the module docstring)
            leaves = [torch.stack(f).detach().requires_grad_(grad) for f in fields]
            state = _rebuild(h0, leaves)
            tokens = call.tokens
            if call.kind == "decode":
                y, new = decode_in_layout(decode, module, x[:, tokens], state, p, path.decode_layout)
                held = tokens
                decoded[tokens] = True
            else:
                x_call = x[:, tokens]
                if call.filler is not None:
                    x_call = torch.cat([x_call, call.filler[0].to(device, case.dtype)], dim=1)
                piece, own = cp_share(x_call.shape[1], tokens.numel(), p.cp, cp_rank)
                y, new = prefill(module, x_call[:, piece], call.cu_seqlens.to(device), state, p)
                y, held = y[:, own.to(y.device)], tokens[torch.arange(x_call.shape[1])[piece][own]]
            y_out[:, held] = y.detach().cpu().to(case.dtype)
            held_here[held] = True
            runs.append((call.sequences, leaves, y, dy[:, held], list(new), call.kind == "prefill"))
            for j, n in enumerate(call.sequences):
                rows[n] = [f[j] for f in new]
    final = [torch.stack([rows[n][i] for n in range(N)]).detach().cpu() for i in range(F)]
    dh0 = None
    if grad:
        dh0 = _backward(runs, dht, _cp_groups(p, tp_rank))
        dh0 = _rebuild(h0, [d.detach().cpu() for d in dh0])
    return dict(y=y_out, held=held_here, decoded=decoded, dx=x.grad.detach().cpu() if grad else None,
                ht=_rebuild(h0, final), dh0=dh0)


def _cp_groups(p, tp_rank):
    """This rank's group of the CP ranks holding the same heads (None without CP); collective."""
    import torch.distributed as dist

    if p.cp == 1:
        return None
    mine = None
    for t in range(p.tp):
        group = dist.new_group([t + p.tp * c for c in range(p.cp)])
        if t == tp_rank:
            mine = group
    return mine


def _backward(runs, dht, cp_group):
    """Backward call by call, the last first: each call's from its outputs' cotangents and its
    final states' (the gradients its sequences' next calls left on their state leaves, or dht
    where none came after); returns the gradients of the initial states `[N, ...]` per field.

    Under CP a prefill call's state gradients are each rank's share (a sequence's next call uses
    its state on the rank where it goes on): they are summed over the CP ranks before they reach
    the previous call, whose final states take a gradient that is whole on every rank. A decode
    step runs whole on every rank: its gradients are whole already. One backward per call rather
    than one through the chained calls: a sharded call's backward runs collectives (a CP rank's
    halo and state exchange) whose order across ranks is fixed within a call, but not across calls
    that autograd would interleave differently on each rank."""
    import torch.distributed as dist

    N = dht[0].shape[0]
    after = [[d[n] for d in dht] for n in range(N)]  # each sequence's state cotangent, latest call first
    for sequences, leaves, y, dy, new, prefill in reversed(runs):
        cotangents = [torch.stack([after[n][i] for n in sequences]) for i in range(len(new))]
        filler = new[0].shape[0] - len(sequences)  # a filler sequence's final state: unchecked
        cotangents = [torch.cat([c, c.new_zeros((filler,) + tuple(c.shape[1:]))]) for c in cotangents]
        torch.autograd.backward([y] + new, [dy] + [c.to(f.dtype) for c, f in zip(cotangents, new)])
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        if cp_group is not None and prefill:
            for g in grads:
                dist.all_reduce(g, group=cp_group)
        for j, n in enumerate(sequences):
            after[n] = [g[j] for g in grads]
    return [torch.stack([after[n][i] for n in range(N)]) for i in range(len(dht))]
