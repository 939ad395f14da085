"""How the benchmark scripts time a call: CUDA events on a GPU, time.perf_counter on a CPU; the
median over `iters` iterations after `warmup` untimed ones (the first of which compiles and
autotunes Triton kernels). Also what a failed iteration leaves: out of memory, the error's first
line, the memory to free before the next case.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time

import torch


def measure(fwd, bwd=None, *, iters: int, warmup: int, device, reset=None) -> dict:
    """Median ms of `fwd()` and of `fwd()` + `bwd(out)` over `iters` iterations after `warmup`.

    reset() runs untimed before every iteration (drop gradients). If bwd raises on the first
    iteration (not out of memory), the forward alone is timed and `bwd_error` says why.
    """
    result = measure_interleaved({"": (fwd, bwd, reset)}, iters=iters, warmup=warmup, device=device)[""]
    if isinstance(result, BaseException):
        raise result
    return result


def measure_interleaved(calls: dict, *, iters: int, warmup: int, device, isolate: bool = False) -> dict:
    """measure() for several callables (name -> (fwd, bwd or None, reset or None)) in rounds: each
    of `warmup` + `iters` rounds runs one iteration of every callable, in an order rotated every
    round, so drift (clocks, other processes) reaches all of them alike and their ratios compare
    fairly. A callable whose first iteration raises is dropped and gets the exception as its
    result; the others go on.

    isolate (CUDA): every iteration starts on an idle GPU with its L2 cache flushed (256 MiB
    written, as triton's do_bench does, then a synchronize), so no callable's time holds the
    work another left queued (which hides a short op's launch gaps) or the data it left in L2.
    For ops of a few ms; a layer step needs neither.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    flush = torch.empty(2 ** 26, dtype=torch.int32, device=device) if cuda and isolate else None
    names = list(calls)
    results, marks, bwd_error = {}, {n: [] for n in names}, dict.fromkeys(names)
    for i in range(warmup + iters):
        shift = i % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            fwd, bwd, reset = calls[name]
            try:
                stamps, refused = _iteration(fwd, None if bwd_error[name] else bwd, reset, cuda, flush)
            except Exception as exc:  # noqa: BLE001 - one callable fails, the others go on
                if i > 0:
                    raise
                results[name] = exc
                free_memory()
                continue
            if refused is not None:  # a refused backward is a result (forward only), not a crash
                if i > 0:
                    raise refused
                bwd_error[name] = first_line(refused)
            if i >= warmup:
                marks[name].append(stamps)
        names = [n for n in names if n not in results]
    if cuda:
        torch.cuda.synchronize(device)

    def ms(a, b):
        return a.elapsed_time(b) if cuda else (b - a) * 1e3

    for name in names:
        both = calls[name][1] is not None and bwd_error[name] is None
        results[name] = {"fwd_ms": statistics.median(ms(m[0], m[1]) for m in marks[name]),
                         "ms": statistics.median(ms(m[0], m[2]) for m in marks[name]) if both else None,
                         "bwd_error": bwd_error[name]}
    return results


def _iteration(fwd, bwd, reset, cuda: bool, flush=None):
    """One iteration: its three stamps (start, forward done, backward done; CUDA events on a GPU,
    read after one synchronize at the end; perf_counter on a CPU) and the exception bwd raised,
    if any (out of memory propagates). flush: a CUDA buffer to overwrite (evicting L2) and wait
    for before the start stamp."""

    def stamp():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    if reset is not None:
        reset()
    if flush is not None:
        flush.zero_()
        torch.cuda.synchronize(flush.device)
    stamps = [stamp()]
    out = fwd()
    stamps.append(stamp())
    refused = None
    if bwd is not None:
        try:
            bwd(out)
        except Exception as exc:  # noqa: BLE001 - the caller decides
            if is_oom(exc):
                raise
            refused = exc
    stamps.append(stamp())
    return stamps, refused


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    """Peak CUDA memory allocated since reset_peak, GiB (None on a CPU)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2 ** 30


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def oom_as_row(case_fn):
    """A rank function whose case running out of memory returns the row {"status": "OOM"}
    instead of raising (the benchmark goes on); memory is freed after every case."""
    @functools.wraps(case_fn)
    def run(case: dict) -> dict:
        try:
            out = case_fn(case)
        except Exception as exc:  # noqa: BLE001 - this case fails, the benchmark goes on
            if not is_oom(exc):
                raise
            out = {"status": "OOM"}
        free_memory()
        return out
    return run


def first_line(exc) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
