"""sha256 of one bf16 GPU layer case's output, dx and parameter gradients (gpu-1's inputs, weights
and shapes: cases.layer_parity.BF16_CASES), to show that two machines pick the same kernels and so
compute the same bits. The case runs --repeat times in this process: equal hashes across repeats
say the kernels are run-to-run deterministic too; a tensor whose hash differs between repeats is
named (atomics in a backward kernel, say), so a difference between machines can be read right.

    python3 suites/bench/hash_bf16_layer.py [--case kda-gva2-lower_bound] [--autotune shipped]
        [--repeat 2] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (str(ROOT), str(ROOT / "suites")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from pytest_linattn import autotune  # noqa: E402


def tensor_sha256(t) -> str:
    import torch

    t = t.detach().contiguous().cpu()
    # bf16 has no numpy dtype: hash its bits as int16, with the shape and dtype alongside
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    h = hashlib.sha256(f"{tuple(t.shape)} {t.dtype}".encode())
    h.update(raw.numpy().tobytes())
    return h.hexdigest()


def run_case(case: str) -> dict[str, str]:
    """One forward + backward of the case's bf16 layer on cuda; {tensor name: sha256}."""
    import torch
    from cases.layer_parity import BF16_CASES, BF16_CU_SEQLENS, build_layer, gpu_config, random_state_dict, run_layer

    # the same weights and inputs as cases.layer_parity.check_bf16_layer draws for this case
    family, ratio, extra = BF16_CASES[case]
    config = gpu_config(family, ratio, **extra)
    seed = 2026 + list(BF16_CASES).index(case)
    sd = random_state_dict(config, seed, fla_init=True, round_to=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    T = BF16_CU_SEQLENS[-1]
    x, dy = (torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64)
             .to(torch.bfloat16) for _ in range(2))
    layer = build_layer(config, dtype=torch.bfloat16, device="cuda")
    layer.load_state_dict({n: t.to(torch.bfloat16) for n, t in sd.items()})
    cu = torch.tensor(BF16_CU_SEQLENS, dtype=torch.int32, device="cuda")
    y, dx, grads = run_layer(layer, x.cuda(), dy.cuda(), cu)
    torch.cuda.synchronize()
    out = {"y": tensor_sha256(y), "dx": tensor_sha256(dx)}
    out.update({f"grad {n}": tensor_sha256(g) for n, g in sorted(grads.items())})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="kda-gva2-lower_bound")
    parser.add_argument("--autotune", default="shipped", choices=autotune.MODES)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    plan = autotune.apply(args.autotune)  # before fla is imported: it reads FLA_CACHE_MODE then
    print(plan.describe())
    runs = [run_case(args.case) for _ in range(max(1, args.repeat))]
    unstable = sorted(n for n in runs[0] if len({r[n] for r in runs}) > 1)
    combined = hashlib.sha256(json.dumps(runs[0], sort_keys=True).encode()).hexdigest()
    width = max(len(n) for n in runs[0])
    for name, digest in runs[0].items():
        print(f"{name:<{width}}  {digest[:16]}{'  (differs between repeats)' if name in unstable else ''}")
    print(f"case {args.case}: all tensors sha256 {combined}; "
          f"{'repeats identical' if not unstable else f'{len(unstable)} tensor(s) differ between repeats'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"case": args.case, "plan": plan.describe(), "combined": combined,
                                         "tensors": runs[0], "differ_between_repeats": unstable}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
