"""Layer benchmark: the head-sharded layer, forward + backward, per shape, tokens and TP x CP.

    python suites/bench/bench_layers.py [--quick] [--shapes prod] [--tokens 4k,8k,16k,32k,64k]
        [--tp 1,2] [--cp 1,2] [--world N] [--sp] [--cp-layout contiguous] [--no-check]
        [--iters 10] [--device auto] [--json FILE] [--plot DIR]
    torchrun --nproc-per-node 4 suites/bench/bench_layers.py ...      (the launcher's world instead)

Every placement runs in one world of --world ranks (default: the largest tp * cp asked for that
fits the GPUs; spawned through pytest_linattn's rank pool, gloo on CPU, NCCL on GPU); ranks beyond
tp * cp are data-parallel replicas doing the same work. A placement needing more ranks is skipped.
Per row: median ms of forward and of forward + backward over --iters after --warmup (the slowest
rank), peak GiB (the largest rank), and the relative error ||sharded - replicated|| / ||replicated||
of the output and the input gradient against the replicated layer on the same weights and batch
(same dtype; skipped at tp = cp = 1 and with --no-check). Out of memory prints OOM and goes on.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from _common import Ranks, add_common_args, add_placement_args, case_row, finish, fmt, parse_ints, print_table, resolve_args, sweep
from _layer_case import build_case, parallel_groups, time_layer_step
from _timing import free_memory, is_oom, oom_as_row

DEFAULTS = dict(shapes="prod", tokens="4k,8k,16k,32k,64k", iters=10, warmup=3, tp="1,2", cp="1,2")
QUICK = dict(shapes="qwen3-next,kimi-k3", tokens="16k")


@oom_as_row
def layer_case(case: dict) -> dict:
    """Rank function: time this rank's shard, then compare it with the replicated layer."""
    from cases.layer_parity import local_tokens
    from linattn.parallel import group_rank

    out = {"status": "ok"}
    tp_group, cp_group = parallel_groups(case["tp"], case["cp"])
    layer, x, dy, cu = build_case(case, tp_group, cp_group)
    out.update(time_layer_step(layer, x, dy, cu, iters=case["iters"], warmup=case["warmup"]))
    if case["check"] and case["tp"] * case["cp"] > 1:
        y = layer(x, cu)
        y.backward(dy)
        mine = (y.detach(), x.grad)
        del layer, x, dy, y
        free_memory()
        out.update(_errors(case, mine, tp_group, cp_group, local_tokens, group_rank))
    return out


def _errors(case, mine, tp_group, cp_group, local_tokens, group_rank) -> dict:
    """Relative Frobenius error of (output, input gradient), summed over every rank's tokens."""
    try:
        layer, x, dy, cu = build_case(case, sharded=False)
        y = layer(x, cu)
        y.backward(dy)
        placement = dict(cu_seqlens=cu.cpu(), tp=case["tp"], cp=case["cp"], layout=case["layout"], sp=case["sp"])
        refs = [local_tokens(t, placement, group_rank(tp_group), group_rank(cp_group)) for t in (y.detach(), x.grad)]
        sums = torch.tensor([v for a, r in zip(mine, refs)
                             for v in ((a.double() - r.double()).pow(2).sum(), r.double().pow(2).sum())],
                            device=x.device, dtype=torch.float64)
        del layer, x, dy, y, refs
        failed = torch.zeros(1, device=sums.device, dtype=torch.float64)
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        free_memory()
        sums = torch.zeros(4, dtype=torch.float64, device=mine[0].device)
        failed = torch.ones(1, device=sums.device, dtype=torch.float64)
    if dist.is_initialized():  # DP replicas and TP copies weigh both sums alike: the ratio stands
        dist.all_reduce(sums)
        dist.all_reduce(failed)
    if failed.item():
        return {"err_y": None, "err_dx": None, "check": "OOM"}
    s = sums.tolist()
    return {"err_y": (s[0] / s[1]) ** 0.5, "err_dx": (s[2] / s[3]) ** 0.5, "check": "ok"}


def merge(case: dict, status: str, per_rank) -> dict:
    row = case_row(case, status, per_rank)
    if status != "ok":
        return row
    if any(r["status"] == "OOM" for r in per_rank):
        return {**row, "status": "OOM"}
    row.update(status="ok", fwd_ms=max(r["fwd_ms"] for r in per_rank), ms=max(r["ms"] for r in per_rank),
               err_y=per_rank[0].get("err_y"), err_dx=per_rank[0].get("err_dx"), check=per_rank[0].get("check"))
    peaks = [r["peak_gib"] for r in per_rank if r.get("peak_gib") is not None]
    row["peak_gib"] = max(peaks) if peaks else None
    return row


def describe(row: dict) -> str:
    return (f"{fmt(row.get('ms'), '.3f')} ms, peak {fmt(row.get('peak_gib'))} GiB, "
            f"err y {fmt(row.get('err_y'), '.1e')}, dx {fmt(row.get('err_dx'), '.1e')}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_common_args(parser)
    add_placement_args(parser, tp="1,2", cp="1,2")
    parser.add_argument("--world", type=int, help="ranks to spawn (default: largest tp*cp that fits)")
    parser.add_argument("--sp", action="store_true", help="sequence parallel with TP")
    parser.add_argument("--cp-layout", choices=("contiguous", "zigzag"), default="contiguous")
    parser.add_argument("--no-check", action="store_true", help="skip the sharded-vs-replicated error")
    args = resolve_args(parser, argv, DEFAULTS, QUICK)
    placements = [(tp, cp) for tp in parse_ints(args.tp) for cp in parse_ints(args.cp)]
    limit = torch.cuda.device_count() if args.device == "cuda" else None
    world = args.world or max([tp * cp for tp, cp in placements if limit is None or tp * cp <= limit] or [1])

    with Ranks(args.device, world) as ranks:
        if ranks.is_main:
            print(f"layers on {args.device} ({args.dtype}), world of {ranks.world_size} rank(s), "
                  f"{args.iters} iters after {args.warmup} warm-up, median ms")
        rows = sweep("layers", args, ranks, placements, layer_case, merge, describe, sp=args.sp,
                     layout=args.cp_layout, check=not args.no_check)
    if not ranks.is_main:
        return
    print()
    print_table(rows, [("shape", "shape"), ("T", "tokens"), ("tp", "tp"), ("cp", "cp"), ("fwd_ms", "fwd ms", ".2f"),
                       ("ms", "fwd+bwd ms", ".2f"), ("peak_gib", "peak GiB", ".2f"), ("err_y", "err y", ".1e"),
                       ("err_dx", "err dx", ".1e"), ("status", "status"), ("error", "error")])
    finish("layers", args, rows, {"world_size": ranks.world_size})


if __name__ == "__main__":
    main()
