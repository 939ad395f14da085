"""Per-test cost of a distributed test: cold torch.multiprocessing.spawn vs the persistent pool.

    python suites/bench/bench_pool.py [--tests 20] [--world-size 4]

Each "test" is trivial: every rank all-reduces one tensor on gloo. Cold: one
torch.multiprocessing.spawn per test (start processes, init the process group, all_reduce,
destroy). Pool: pytest_linattn's rank pool, timed after one warm-up call. Target: the pool's
per-test overhead <= 0.05 s and >= 50x below cold spawn.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pytest_linattn.ranks.pool import PoolManager


def trivial():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _cold_rank(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    assert trivial() == world_size
    dist.destroy_process_group()


def cold(tests: int, world_size: int) -> list[float]:
    times = []
    for _ in range(tests):
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            mp.spawn(_cold_rank, args=(world_size, os.path.join(d, "init")), nprocs=world_size,
                     join=True)
            times.append(time.perf_counter() - start)
    return times


def pooled(tests: int, world_size: int) -> tuple[float, list[float]]:
    with PoolManager("cpu") as pools:
        start = time.perf_counter()
        pools.run(trivial, world_size)  # warm-up: starts the pool
        warm_up = time.perf_counter() - start
        times = []
        for _ in range(tests):
            start = time.perf_counter()
            assert pools.run(trivial, world_size) == [float(world_size)] * world_size
            times.append(time.perf_counter() - start)
    return warm_up, times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", type=int, default=20, help="trivial tests per method")
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args(argv)
    if args.tests < 1:
        parser.error("--tests must be >= 1")
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    n, ws = args.tests, args.world_size
    warm_up, pool_t = pooled(n, ws)
    cold_t = cold(n, ws)
    rows = [
        ("cold mp.spawn", sum(cold_t), statistics.mean(cold_t), statistics.median(cold_t)),
        ("pool (warm)", sum(pool_t), statistics.mean(pool_t), statistics.median(pool_t)),
    ]
    print(f"{n} trivial {ws}-rank tests on gloo ({os.cpu_count()} CPU cores)")
    print(f"{'method':<16}{'total s':>10}{'per test s':>12}{'median s':>10}")
    for name, total, mean, median in rows:
        print(f"{name:<16}{total:>10.3f}{mean:>12.4f}{median:>10.4f}")
    print(f"pool warm-up (start {ws} ranks + init process group): {warm_up:.2f} s, once per session")
    ratio = statistics.mean(cold_t) / statistics.mean(pool_t)
    print(f"pool per-test overhead {statistics.mean(pool_t):.4f} s "
          f"({'meets' if statistics.mean(pool_t) <= 0.05 else 'MISSES'} <= 0.05 s); "
          f"{ratio:.0f}x below cold spawn ({'meets' if ratio >= 50 else 'MISSES'} >= 50x)")


if __name__ == "__main__":
    main()
