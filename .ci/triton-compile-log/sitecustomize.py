"""Where a GPU run's compile time goes: with this folder on PYTHONPATH and LINATTN_COMPILE_LOG=DIR,
every Triton compile of every Python process (test processes, xdist workers, ranks) appends one
line to DIR/<pid>.tsv: the test running (PYTEST_CURRENT_TEST), the kernel, a key of its
specialization (signature, constexprs, options), seconds (a disk-cache hit takes milliseconds),
the arguments' alignment attributes.

    python3 .ci/triton-compile-log/sitecustomize.py DIR     # the summary: per test, per kernel
"""
import os
import sys
import time

_DIR = os.environ.get("LINATTN_COMPILE_LOG")


def _install():
    import hashlib

    import triton.compiler  # jit's binder reads triton.compiler.compile when it is first built

    compile_ = triton.compiler.compile

    def compile(src, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return compile_(src, *args, **kwargs)
        finally:
            fn = getattr(src, "fn", None)
            name = getattr(fn, "__name__", None) or getattr(src, "name", "?")
            spec = repr((getattr(src, "signature", None), getattr(src, "constexprs", None), kwargs.get("options")))
            key = hashlib.md5(spec.encode()).hexdigest()[:10]
            attrs = repr(getattr(src, "attrs", None))  # alignment / divisibility of the arguments
            test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
            with open(os.path.join(_DIR, f"{os.getpid()}.tsv"), "a") as f:
                f.write(f"{test}\t{name}\t{key}\t{time.perf_counter() - t0:.3f}\t{attrs}\n")

    triton.compiler.compile = compile


def summary(folder):
    from collections import defaultdict

    rows = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            rows += [(name.split(".")[0], *line.rstrip("\n").split("\t")[:4]) for line in f if line.strip()]
    per_test, per_kernel, keys = defaultdict(float), defaultdict(lambda: [0, 0.0]), defaultdict(set)
    for pid, test, kernel, key, seconds in rows:
        per_test[test] += float(seconds)
        per_kernel[kernel][0] += 1
        per_kernel[kernel][1] += float(seconds)
        keys[(kernel, key)].add(pid)
    total = sum(float(r[-1]) for r in rows)
    twice = sum(1 for pids in keys.values() if len(pids) > 1)
    print(f"{len(rows)} compiles, {total:.1f} s, {len(keys)} distinct specializations, "
          f"{twice} compiled in more than one process, {len({r[0] for r in rows})} processes")
    print("\nseconds per test:")
    for test, s in sorted(per_test.items(), key=lambda kv: -kv[1]):
        print(f"{s:8.1f}  {test}")
    print("\nseconds per kernel (compiles):")
    for kernel, (n, s) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"{s:8.1f}  {n:3d}  {kernel}")


if __name__ == "__main__":
    summary(sys.argv[1])
elif _DIR:
    try:
        _install()
    except Exception as exc:  # no triton here (pip, tools): nothing to log
        print(f"triton-compile-log: not installed in {sys.argv[0]!r}: {exc}", file=sys.stderr)
