"""Time the float64 references: chunk vs recurrent, and fla's naive recurrent (float32) for scale.

Run: python suites/bench/bench_reference.py [--lengths 1024,4096,16384] [--repeats 3] [--no-kda]
      [--threads N] [--wall] [--full]
B=1, 4 heads, K=V=64. Prints one row per (op, T, implementation): forward and forward+backward
seconds (median of the repeats after one warm-up; recurrent rows at T >= 8192 run once), and how
many times slower than chunk each row is. The clock is this process's CPU time and torch runs one
thread by default, so other jobs on a shared machine disturb the numbers little; --wall and
--threads 0 time wall-clock with torch's own thread count instead. The recurrent backward at
T >= 8192 keeps every token's state for autograd (about 6 GB at 16k), so it is skipped unless --full.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from linattn.reference import gated_delta_rule, kda

H, K, V = 4, 64, 64
SLOW_TOKENS = 8192  # recurrent rows at or above this length run once, backward only with --full


def make_inputs(T, per_channel, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q = rand(1, T, H, K)
    k = F.normalize(rand(1, T, H, K), dim=-1)
    v = rand(1, T, H, V)
    g = F.logsigmoid(rand(1, T, H, K) if per_channel else rand(1, T, H))
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def fla_naive(per_channel):
    if per_channel:
        from fla.ops.kda.naive import naive_recurrent_kda
        return lambda q, k, v, g, beta: naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    return lambda q, k, v, g, beta: naive_recurrent_gated_delta_rule(q, k, v, beta, g, output_final_state=True)


def ours(per_channel, mode):
    op = kda if per_channel else gated_delta_rule
    return lambda q, k, v, g, beta: op(q, k, v, g, beta, output_final_state=True, mode=mode)


def seconds(fn, inputs, backward, repeats, clock=time.process_time):
    times = []
    for _ in range(repeats + (repeats > 1)):  # first of several is a warm-up
        start = clock()
        o, s = fn(*inputs)
        if backward:
            (o.sum() + s.sum()).backward()
        times.append(clock() - start)
        for x in inputs:
            x.grad = None
    return statistics.median(times[1:] if repeats > 1 else times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-kda", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own choice)")
    parser.add_argument("--wall", action="store_true", help="wall-clock seconds instead of this process's CPU seconds")
    parser.add_argument("--full", action="store_true", help="also run recurrent fwd+bwd at T >= 8192")
    args = parser.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    clock = time.perf_counter if args.wall else time.process_time
    print(f"B=1 H={H} K=V={K}, torch threads={torch.get_num_threads()}, "
          f"median {'wall-clock' if args.wall else 'CPU'} seconds")
    print(f"{'op':4} {'T':>6} {'impl':24} {'fwd':>8} {'fwd+bwd':>8} {'fwd/chunk':>11} {'f+b/chunk':>11}")
    for per_channel in ([False] if args.no_kda else [False, True]):
        name = "KDA" if per_channel else "GDN"
        for T in lengths:
            rows = [("chunk float64", ours(per_channel, "chunk"), torch.float64),
                    ("recurrent float64", ours(per_channel, "recurrent"), torch.float64),
                    ("fla naive recurrent f32", fla_naive(per_channel), torch.float32)]
            chunk_times = None
            for label, fn, dtype in rows:
                inputs = make_inputs(T, per_channel, dtype)
                slow = not label.startswith("chunk") and T >= SLOW_TOKENS
                repeats = 1 if slow else args.repeats
                fwd = seconds(fn, inputs, False, repeats, clock)
                both = seconds(fn, inputs, True, repeats, clock) if not slow or args.full else float("nan")
                if chunk_times is None:
                    chunk_times = (fwd, both)
                speed = [f"{t / c:.1f}x" if t == t else "skipped" for t, c in zip((fwd, both), chunk_times)]
                print(f"{name:4} {T:>6} {label:24} {fwd:8.3f} {both:8.3f} {speed[0]:>11} {speed[1]:>11}", flush=True)


if __name__ == "__main__":
    main()
