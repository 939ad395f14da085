"""Every torch.distributed entry point on the staged transport (pytest_linattn.ranks.staged), checked
on a rank against the values each op must give: the cpu suite runs it on CPU tensors, gpu-2 and
gpu-4 on CUDA tensors of ranks sharing one GPU. Each rank's inputs are distinct (its rank in them),
so a wrong order, a missing rank or a stale buffer changes a value."""

from __future__ import annotations

import torch


def check_ranks_sharing_a_gpu(spawn, world_size: int) -> None:
    """gpu-2's and gpu-4's test: every op, and every refusal, on CUDA tensors of `world_size` ranks
    sharing one GPU; skipped where each rank has a GPU of its own (NCCL, not this transport)."""
    import pytest

    if spawn.ranks_per_gpu < 2:
        pytest.skip(f"each rank has a GPU of its own: NCCL, not the staged transport (--linattn-ranks-per-gpu "
                    f"{world_size} runs it)")
    assert_every_op_carried(spawn(check_every_op, world_size, "cuda"))
    refused = spawn(refused_ops, world_size, "cuda")[0]
    assert all(why != "no error" for why in refused.values()), refused


def assert_every_op_carried(per_rank: list[dict]) -> None:
    """check_every_op's results from every rank: nothing wrong, and every rank checked the ops
    (rank 0 also the gather's result, rank 1 the receives)."""
    for rank, checks in enumerate(per_rank):
        wrong = {op: why for op, why in checks.items() if why is not None}
        assert not wrong, f"rank {rank}: {wrong}"
    assert len(per_rank[0]) >= 30 and "recv from any source" in per_rank[1], sorted(per_rank[1])


def _check(failures: dict, name: str, got, want) -> None:
    got = got if isinstance(got, torch.Tensor) else torch.as_tensor(got)
    want = want if isinstance(want, torch.Tensor) else torch.as_tensor(want)
    if got.shape != want.shape or not torch.allclose(got.double().cpu(), want.double().cpu()):
        failures[name] = f"got {got.tolist()}, want {want.tolist()}"
    else:
        failures.setdefault(name, None)


def check_every_op(device: str) -> dict[str, str | None]:
    """Rank function: {op: None if right, else what was wrong}, every op on the default group
    (which must be staged) and on a `new_group()`, which must inherit the transport."""
    import warnings

    with warnings.catch_warnings():  # torch's deprecation notes for the older names called here
        warnings.simplefilter("ignore", FutureWarning)
        return _check_every_op(device)


def _check_every_op(device: str) -> dict[str, str | None]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _coalescing_manager

    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    r, W = dist.get_rank(), dist.get_world_size()
    f: dict[str, str | None] = {}
    ranks = torch.arange(W, dtype=torch.float64)

    def full(n, value, dtype=torch.float32):
        return torch.full((n,), float(value), dtype=dtype, device=dev)

    _check(f, "backend", dist.get_backend() == "staged" and dist.get_backend(dist.new_group()) == "staged", True)
    for op, want in (("SUM", ranks.sum() + W), ("AVG", (ranks.sum() + W) / W), ("MAX", W), ("MIN", 1)):
        t = full(3, r + 1)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        _check(f, f"all_reduce {op}", t, torch.full((3,), float(want)))
    t = full(2, r + 1, torch.bfloat16)
    dist.all_reduce(t)
    _check(f, "all_reduce bf16", t, torch.full((2,), float(ranks.sum() + W)))
    a, b = full(2, r), full(3, 2 * r)
    dist.all_reduce_coalesced([a, b])
    _check(f, "all_reduce_coalesced", torch.cat([a, b]), torch.tensor([ranks.sum()] * 2 + [2 * ranks.sum()] * 3))

    out = torch.empty(2 * W, device=dev)
    dist.all_gather_into_tensor(out, full(2, r))
    _check(f, "all_gather_into_tensor", out, ranks.repeat_interleave(2))
    out = torch.empty(W, 3, 2, device=dev)  # shapes NCCL takes as they are (fla's CP gathers so)
    dist.all_gather_into_tensor(out, full(6, r).reshape(1, 3, 2))
    _check(f, "all_gather_into_tensor [1,3,2] -> [W,3,2]", out.reshape(-1), ranks.repeat_interleave(6))
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.ones(W, 2, device=dev) * (r + 1))
    _check(f, "reduce_scatter_tensor [W,2] -> [2]", out, [float(ranks.sum() + W)] * 2)
    outs = [torch.empty(2, device=dev) for _ in range(W)]
    dist.all_gather(outs, full(2, r))
    _check(f, "all_gather", torch.cat(outs), ranks.repeat_interleave(2))
    outs = [[torch.empty(1, device=dev) for _ in range(W)]]
    dist.all_gather_coalesced(outs, [full(1, r)])
    _check(f, "all_gather_coalesced", torch.cat(outs[0]), ranks)

    inp = torch.arange(2 * W, dtype=torch.float32, device=dev) + r  # rank r's row: 2r.. + r
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, inp)
    whole = torch.arange(2 * W, dtype=torch.float64) * W + ranks.sum()
    _check(f, "reduce_scatter_tensor", out, whole.reshape(W, 2)[r])
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.MAX)
    _check(f, "reduce_scatter_tensor MAX", out, (torch.arange(2 * W, dtype=torch.float64) + W - 1).reshape(W, 2)[r])
    dist.reduce_scatter(out, list(inp.reshape(W, 2).unbind(0)))
    _check(f, "reduce_scatter", out, whole.reshape(W, 2)[r])

    inp = torch.arange(W, dtype=torch.float32, device=dev) + 10 * r
    out = torch.empty(W, device=dev)
    dist.all_to_all_single(out, inp)
    _check(f, "all_to_all_single", out, 10 * ranks + r)
    splits = [i + 1 for i in range(W)]  # rank r sends i+1 values to rank i, gets r+1 from each
    inp = torch.cat([torch.full((i + 1,), 10. * r + i) for i in range(W)]).to(dev)
    out = torch.empty(W * (r + 1), device=dev)
    dist.all_to_all_single(out, inp, [r + 1] * W, splits)
    _check(f, "all_to_all_single uneven", out, (10 * ranks + r).repeat_interleave(r + 1))
    outs = [torch.empty(1, device=dev) for _ in range(W)]
    dist.all_to_all(outs, [full(1, 10 * r + i) for i in range(W)])
    _check(f, "all_to_all", torch.cat(outs), 10 * ranks + r)

    t = full(2, r)
    dist.broadcast(t, src=W - 1)
    _check(f, "broadcast", t, [W - 1.0] * 2)
    t = full(2, r + 1)
    dist.reduce(t, dst=0)
    _check(f, "reduce", t, [float(ranks.sum() + W) if r == 0 else r + 1.0] * 2)
    gathered = [torch.empty(1, device=dev) for _ in range(W)] if r == 0 else None
    dist.gather(full(1, r), gathered, dst=0)
    if r == 0:
        _check(f, "gather", torch.cat(gathered), ranks)
    out = torch.empty(1, device=dev)
    dist.scatter(out, [full(1, 5 * i) for i in range(W)] if r == 0 else None, src=0)
    _check(f, "scatter", out, [5.0 * r])
    dist.barrier()
    _check(f, "barrier", True, True)

    # point to point: a ring where every rank sends first (completion at issue would deadlock),
    # then three messages in a row to one peer, which must arrive in order
    nxt, prv = (r + 1) % W, (r - 1) % W
    got = torch.empty(2, device=dev)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, full(2, r), nxt), dist.P2POp(dist.irecv, got, prv)])
    for w in works:
        w.wait()
    _check(f, "batch_isend_irecv ring", got, [float(prv)] * 2)
    if r == 0:
        sent = [full(1, 7 + i) for i in range(3)]
        for w in [dist.isend(t, 1) for t in sent]:
            w.wait()
        dist.send(full(1, 99), 1)
    elif r == 1:
        got = [torch.empty(1, device=dev) for _ in range(3)]
        for w in [dist.irecv(t, 0) for t in got]:
            w.wait()
        _check(f, "isend/irecv in order", torch.cat(got), [7.0, 8.0, 9.0])
        last = torch.empty(1, device=dev)
        src = dist.recv(last)  # from any source
        _check(f, "recv from any source", [src, last.item()], [0, 99.0])

    a, b = full(2, r), full(3, r)
    with _coalescing_manager(device=dev):
        dist.all_reduce(a)
        dist.all_reduce(b)
    _check(f, "coalescing manager all_reduce", torch.cat([a, b]), [float(ranks.sum())] * 5)
    outs = [torch.empty(W, device=dev) for _ in range(2)]
    with _coalescing_manager(async_ops=True) as cm:
        for o in outs:
            dist.all_gather_into_tensor(o, full(1, r))
    cm.wait()
    _check(f, "coalescing manager all_gather", torch.cat(outs), ranks.repeat(2))

    world = dist.group.WORLD
    _check(f, "funcol all_reduce", funcol.all_reduce(full(2, r), "sum", world), [float(ranks.sum())] * 2)
    _check(f, "funcol all_gather", funcol.all_gather_tensor(full(1, r), 0, world), ranks)
    got = funcol.reduce_scatter_tensor(torch.arange(W, dtype=torch.float32, device=dev), "sum", 0, world)
    _check(f, "funcol reduce_scatter", got, [float(W * r)])
    got = funcol.all_to_all_single(torch.arange(W, dtype=torch.float32, device=dev) + 10 * r, None, None, world)
    _check(f, "funcol all_to_all_single", got, 10 * ranks + r)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device, (W,))
    whole = torch.arange(4 * W, dtype=torch.float32, device=dev).reshape(2 * W, 2)
    _check(f, "DTensor Shard -> Replicate", distribute_tensor(whole, mesh, [Shard(0)]).full_tensor(), whole)
    for how, want in (("sum", ranks.sum() + W), ("avg", (ranks.sum() + W) / W)):
        part = DTensor.from_local(torch.ones(2, 2, device=dev) * (r + 1), mesh, [Partial(how)])
        _check(f, f"DTensor Partial({how}) -> Replicate", part.redistribute(mesh, [Replicate()]).to_local(),
               torch.full((2, 2), float(want)))
    part = DTensor.from_local(torch.ones(2 * W, 2, device=dev) * (r + 1), mesh, [Partial()])
    _check(f, "DTensor Partial -> Shard", part.redistribute(mesh, [Shard(0)]).to_local(),
           torch.full((2, 2), float(ranks.sum() + W)))

    # DDP: the C++ reducer all-reduces the gradients and reads the Work's future
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False).to(dev)
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if device == "cuda" else None)
    x = torch.full((1, 3), float(r + 1), device=dev)
    ddp(x).sum().backward()
    _check(f, "DDP gradient average", model.weight.grad.reshape(-1), [float(ranks.sum() + W) / W] * 3)

    if hasattr(torch, "float8_e4m3fn"):
        out = torch.empty(2 * W, dtype=torch.float8_e4m3fn, device=dev)
        dist.all_gather_into_tensor(out, full(2, r).to(torch.float8_e4m3fn))
        _check(f, "all_gather float8 (as bytes)", out.float(), ranks.repeat_interleave(2))
    return f


def refused_ops(device: str) -> dict[str, str]:
    """Rank function: what the transport refuses, with its message (the same on every rank, so
    no rank waits in a collective the others skipped)."""
    import torch.distributed as dist

    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    out = {}
    calls = {"all_reduce PREMUL_SUM": lambda: dist.all_reduce(torch.ones(2, device=dev),
                                                              op=dist._make_nccl_premul_sum(2.0)),
             "all_reduce AVG of int": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64, device=dev),
                                                              op=dist.ReduceOp.AVG)}
    if hasattr(torch, "float8_e4m3fn"):
        calls["all_reduce float8"] = lambda: dist.all_reduce(torch.ones(2, device=dev).to(torch.float8_e4m3fn))
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except NotImplementedError as exc:
            out[name] = str(exc)
    return out
