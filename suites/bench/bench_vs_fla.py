"""The project's layer beside fla's own layer of the same family and sizes, timed interleaved.

    python suites/bench/bench_vs_fla.py [--quick] [--shapes prod] [--tokens 4k,16k,64k] [--iters 10]
        [--warmup 3] [--autotune first|shipped|search] [--profile N] [--forward-only] [--json FILE]
        (and the other options every bench script takes, suites/bench/_common.py)

KDA shapes run against `fla.layers.KimiDeltaAttention`, GDN shapes against `fla.layers.GatedDeltaNet`
(fla's weight layout is Qwen3.5's; the project's qwen3-next layer gets the same weights through
`qwen3_next_to_qwen3_5`). Both layers get the same weights and input; the `out err` column is their
outputs' relative difference, so a row times two layers computing the same function.

A row is forward + backward, each layer's median over --iters rounds after --warmup untimed ones
(the first compiles; `_timing.measure_interleaved`: a round runs both layers, in rotated order). `GiB` is a step's peak
memory above what was allocated before it (the step's activations, gradients and workspace; the
weights and the input are resident for both), measured from an emptied allocator cache: the
allocator's blocks (`max_memory_allocated`; `MiB over` is ours minus fla's) and the bytes the tensors
asked for (`tensor MiB over`; a block may exceed its request by up to 1 MiB, where the allocator
does not split it, so the two figures differ by the allocator's packing). Where fla refuses GDN's backward
(`linattn.selection.choose_gdn_route`), GDN rows time the forward only, for both layers, and the
`step` column says so.

Kernel configs (--autotune, `pytest_linattn.autotune`): `first` (default) gives every Triton
kernel its first config, no search, so both layers run the same kernels with the same configs;
`search` is Triton's autotune (minutes per shape on a fresh machine); `shipped` reads the
configs shipped for the GPU. The header names the mode. On a CPU (a smoke run) fla's layers run
under `linattn.emulation.fla_on_cpu` and the times mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys

import torch

from _common import (DTYPES, add_common_args, checkpoint, cu_seqlens, finish, fmt, make_config,  # sets sys.path
                     print_table, resolve_args, tokens_label)
from _layer_case import full_weights
from _timing import free_memory, is_oom, measure_interleaved, peak_gib, reset_peak
from linattn import selection
from linattn.layers import build_layer, qwen3_next_to_qwen3_5, to_fla_state_dict
from pytest_linattn import autotune

GIB = 2 ** 30


def fla_layer_for(config, state_dict, dtype, device):
    """fla's layer of config's family and sizes, holding state_dict's weights."""
    from fla.layers import GatedDeltaNet, KimiDeltaAttention

    sizes = dict(hidden_size=config.hidden_size, head_dim=config.head_k_dim, num_heads=config.num_k_heads,
                 num_v_heads=config.num_v_heads, expand_v=config.head_v_dim / config.head_k_dim,
                 conv_size=config.conv_size, norm_eps=config.norm_eps, mode="chunk")
    if config.family == "kda":
        layer = KimiDeltaAttention(**sizes, lower_bound=config.gate_lower_bound)
        fla_state = to_fla_state_dict(state_dict, config)
    else:
        layer = GatedDeltaNet(**sizes, use_gate=True)
        as_qwen3_5 = dataclasses.replace(config, family="qwen3_5")
        if config.family == "qwen3_next":
            state_dict = qwen3_next_to_qwen3_5(state_dict, config)
        fla_state = to_fla_state_dict(state_dict, as_qwen3_5)
    layer = layer.to(device=device, dtype=dtype)
    layer.load_state_dict({n: t.to(device=device, dtype=dtype) for n, t in fla_state.items()})
    return layer


def layer_calls(call, params, x, dy, backward: bool):
    """(fwd, bwd, reset) for `_timing.measure_interleaved`: a fresh input leaf and no gradients
    before every step; forward only runs under no_grad."""
    leaf = [x]

    def reset():
        for p in params:
            p.grad = None
        leaf[0] = x.detach().requires_grad_(backward)

    def fwd():
        if backward:
            return call(leaf[0])
        with torch.no_grad():
            return call(leaf[0])

    return fwd, (lambda out: out.backward(dy)) if backward else None, reset


def step_peak_gib(fwd, bwd, reset, device) -> tuple[float | None, float | None]:
    """(allocated, requested) peak GiB of one step above what was allocated before it ((None, None)
    on a CPU), from an empty cache: a block the allocator hands out from a cached segment may be
    larger than asked for, so the figure would depend on what ran before (rows 40 KB apart by the
    order they ran in). `allocated` counts the allocator's blocks (`max_memory_allocated`), which may
    exceed a request by up to 1 MiB where the allocator does not split a block; `requested` counts
    the bytes the tensors asked for."""
    if device.type != "cuda":
        return None, None
    reset()
    free_memory()
    torch.cuda.synchronize()
    base, base_requested = torch.cuda.memory_allocated(), torch.cuda.memory_stats()["requested_bytes.all.current"]
    reset_peak(device)
    out = fwd()
    if bwd is not None:
        bwd(out)
    del out
    requested = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base_requested
    return peak_gib(device) - base / GIB, requested / GIB


def print_profile(title, fwd, bwd, reset, device, top: int) -> None:
    """One step under torch.profiler: the `top` device kernels by total time, and the sum."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    reset()
    with profile(activities=activities) as prof:
        out = fwd()
        if bwd is not None:
            bwd(out)
        if device.type == "cuda":
            torch.cuda.synchronize()
    del out
    events = [e for e in prof.key_averages() if e.device_type.name == ("CUDA" if device.type == "cuda" else "CPU")]
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events.sort(key=lambda e: -getattr(e, attr))
    total = sum(getattr(e, attr) for e in events) / 1e3
    print(f"-- profile {title}: {len(events)} kernels, {total:.2f} ms in all", flush=True)
    for e in events[:top]:
        print(f"   {getattr(e, attr) / 1e3:8.3f} ms  x{e.count:<4d} {e.key[:110]}", flush=True)


def live_at_peak(title, fwd, bwd, reset, device, top: int) -> collections.Counter:
    """CUDA: one step under the allocator's trace (`torch.cuda.memory._record_memory_history`),
    replayed to the step's peak: prints the `top` places holding the most bytes there (the first
    project or fla frames that allocated them; `?` where no Python frame did, as autograd's own
    gradient buffers) and returns the live requested sizes, so two layers' sets can be compared."""
    reset()
    free_memory()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        out = fwd()
        if bwd is not None:
            bwd(out)
        del out
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, current, peak, at_peak = {}, 0, -1, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _allocated_at(event.get("frames", [])))
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    by_place = collections.defaultdict(list)
    for size, place in at_peak.values():
        by_place[place].append(size)
    print(f"-- live at the step's peak, {title}: {peak / 2 ** 20:.3f} MiB requested in {len(at_peak)} tensors", flush=True)
    for place, sizes in sorted(by_place.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"   {sum(sizes) / 2 ** 20:10.3f} MiB x{len(sizes):<3d} {place}", flush=True)
    return collections.Counter(size for size, _ in at_peak.values())


def _allocated_at(frames) -> str:
    places = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in frames
              if ("/linattn/" in f["filename"] or "/fla/" in f["filename"])]
    return " < ".join(places[:2]) or "?"


def run_row(shape, T, args, device, dtype, gdn_forward_only) -> dict:
    config = make_config(shape)
    state_dict = full_weights(shape, args.seed)  # drawn once per shape (kimi-k3: 17 s on 2 cores)
    ours = build_layer(config, dtype=dtype, device=device)
    ours.load_state_dict({n: t.to(device=device, dtype=dtype) for n, t in state_dict.items()})
    theirs = fla_layer_for(config, state_dict, dtype, device)
    gen = torch.Generator().manual_seed(args.seed + T)
    x = torch.randn(1, T, config.hidden_size, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(1, T, config.hidden_size, generator=gen).to(device=device, dtype=dtype)
    cu = cu_seqlens(T, args.seqs).to(device)
    cu_long = cu.long()
    backward = not (args.forward_only or (config.family != "kda" and gdn_forward_only))
    calls = {"ours": layer_calls(lambda h: ours(h, cu), list(ours.parameters()), x, dy, backward),
             "fla": layer_calls(lambda h: theirs(h, cu_seqlens=cu_long)[0], list(theirs.parameters()), x, dy, backward)}
    with torch.no_grad():
        y_ours, y_fla = ours(x, cu).double(), theirs(x, cu_seqlens=cu_long)[0].double()
    out_err = ((y_ours - y_fla).norm() / y_fla.norm()).item()
    del y_ours, y_fla
    timed = measure_interleaved(calls, iters=args.iters, warmup=args.warmup, device=device)
    for name, result in timed.items():
        if isinstance(result, BaseException):
            raise result
    key = "ms" if backward else "fwd_ms"
    ms, fla_ms = timed["ours"][key], timed["fla"][key]
    (gib, tensor_gib), (fla_gib, fla_tensor_gib) = (step_peak_gib(*calls[name], device) for name in ("ours", "fla"))
    if args.profile:
        for name in ("ours", "fla"):
            print_profile(f"{shape} {tokens_label(T)} {name}", *calls[name], device, args.profile)
        if device.type == "cuda":
            sizes = {name: live_at_peak(f"{shape} {tokens_label(T)} {name}", *calls[name], device, args.profile)
                     for name in ("ours", "fla")}
            for a, b in (("ours", "fla"), ("fla", "ours")):
                only = sorted((sizes[a] - sizes[b]).elements(), reverse=True)
                print(f"   live at the peak in {a} only (bytes): {only[:args.profile] or 'none'}", flush=True)
    row = dict(shape=shape, family=config.family, tokens=T, tokens_label=tokens_label(T),
               step="fwd+bwd" if backward else "fwd only",
               ms=ms, fla_ms=fla_ms, time_ratio=ms / fla_ms, gib=gib, fla_gib=fla_gib,
               memory_ratio=gib / fla_gib if gib is not None else None,
               mib_over=(gib - fla_gib) * 1024 if gib is not None else None, tensor_gib=tensor_gib,
               fla_tensor_gib=fla_tensor_gib,
               tensor_mib_over=(tensor_gib - fla_tensor_gib) * 1024 if gib is not None else None, out_err=out_err)
    del ours, theirs, calls, x, dy
    free_memory()
    return row


TABLE = [("shape", "shape"), ("tokens_label", "tokens"), ("step", "step"), ("ms", "ours ms"), ("fla_ms", "fla ms"),
         ("time_ratio", "time x", ".3f"), ("gib", "ours GiB"), ("fla_gib", "fla GiB"), ("mib_over", "MiB over", ".3f"),
         ("tensor_mib_over", "tensor MiB over", ".3f"),
         ("out_err", "out err", ".1e")]
DEFAULTS = dict(shapes="prod", tokens="4k,16k,64k", iters=10, warmup=3)
QUICK = dict(shapes="glm-5.3-flash,qwen3-next", tokens="16k")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_common_args(parser)
    parser.set_defaults(autotune="first")  # both layers on one config per kernel: no search
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each row, profile one step of each layer and print its N costliest kernels "
                             "(on CUDA also the N places holding the most memory at the step's peak)")
    parser.add_argument("--forward-only", action="store_true", help="time every row's forward only (no grad)")
    args = resolve_args(parser, argv, DEFAULTS, QUICK)  # on CUDA this applies --autotune
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        emulation = contextlib.nullcontext()
        configs = f"kernel configs: --autotune {args.autotune} ({autotune.apply(args.autotune).describe()})"
        gdn_forward_only = selection.choose_gdn_route(selection.read_facts()).value == "kda"
        name = torch.cuda.get_device_name()
    else:
        from linattn.emulation import fla_on_cpu

        emulation, configs = fla_on_cpu(), "CPU smoke run: fla's layers under fla_on_cpu"
        gdn_forward_only, name = False, "cpu"
    header = (f"bench_vs_fla on {name}, {args.dtype}, {args.seqs} sequence(s) per batch; {configs}; "
              f"GDN: {'forward only (fla refuses its backward here)' if gdn_forward_only else 'forward + backward'}")
    print(header, flush=True)
    rows = []
    with emulation:
        for shape in args.shape_list:
            for T in args.token_list:
                try:
                    row = run_row(shape, T, args, device, dtype, gdn_forward_only)
                except Exception as exc:  # noqa: BLE001 - out of memory is a row, the benchmark goes on
                    if not is_oom(exc):
                        raise
                    free_memory()
                    print(f"{shape} {tokens_label(T)}: OOM", flush=True)
                    continue
                rows.append(row)
                print(f"{shape} {tokens_label(T)} {row['step']}: ours {fmt(row['ms'])} ms / fla {fmt(row['fla_ms'])} ms"
                      f" = {fmt(row['time_ratio'], '.3f')}; {fmt(row['gib'])} / {fmt(row['fla_gib'])} GiB, "
                      f"{fmt(row['mib_over'], '.3f')} MiB over ({fmt(row['tensor_mib_over'], '.3f')} in tensor bytes); out err {fmt(row['out_err'], '.1e')}", flush=True)
                checkpoint("vs_fla", args, rows)
    print(header)
    print_table(rows, TABLE)
    finish("vs_fla", args, rows, {"header": header})
    return 0


if __name__ == "__main__":
    sys.exit(main())
