"""Where vLLM's KDA prefill in bf16 is off: its layer's tokens beside fla's and the float64 layer's.

    python suites/bench/engine_kda_bf16.py [--seeds 16] [--lengths 30,6,70,9]

On one GPU (the kernels compiled; vLLM's files from .engines/, fla installed). For each seed, a
batch of fresh sequences of --lengths tokens runs through three bf16 layers with the same bf16
weights and input, and through the float64 layer (linattn's on the CPU, on those weights): vLLM 0.33.0's KDA
layer (`clients.engines.vllm_kda.VllmKDA`: `chunk_kda_with_fused_gate`), linattn's layer on fla's
`chunk_kda` (the GPU route), and linattn's layer on torch's kernels in bf16 on the CPU. Each token's
error is |y_t - y_t(float64)| over the RMS of the float64 tokens (the serving checks' measure),
for the layer's output and for the recurrence's output o before the gated norm. Prints, per path,
the worst token's error and where (sequence, position), its median and 99th percentile, and the
same for o; then the worst tokens of vLLM's path with the other paths' errors on them. A kernel
defect shows as vLLM's worst tokens far above the other bf16 paths' on the same tokens; a bf16
outlier of the layer's math as the paths agreeing there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (str(ROOT), str(ROOT / "suites")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from cases.layer_parity import gpu_config, random_state_dict  # noqa: E402
from linattn.layers import LayerState, build_layer  # noqa: E402


def capture_o(module):
    """Keep the recurrence's output (before the gated norm) of the module's next forward on it."""
    inner = module._delta_rule

    def wrapped(*args, **kwargs):
        module.captured_o = inner(*args, **kwargs)
        return module.captured_o

    module._delta_rule = wrapped
    return module


def token_errors(y, ref):
    """Per token: |y_t - ref_t| over the RMS of ref's tokens (float64, on the CPU)."""
    y, ref = y.detach().cpu().double().flatten(2)[0], ref.detach().cpu().double().flatten(2)[0]
    rms = ref.norm(dim=-1).pow(2).mean().sqrt()
    return (y - ref).norm(dim=-1) / rms


def where(t, cu):
    n = int(torch.searchsorted(cu, torch.tensor(t), right=True)) - 1
    return f"seq {n} pos {t - int(cu[n])}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--lengths", default="30,6,70,9")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script in float32, vLLM's "
                        "kernels under Triton's interpreter and 'fla' on torch's kernels too (its figures mean nothing)")
    args = parser.parse_args()
    if args.device == "cpu":
        from linattn.emulation.interpreted import prepare_process

        prepare_process()
    from clients.engines.layout import call_with_pool
    from clients.engines.vllm_kda import VllmKDA

    config = gpu_config("kda", ratio=1, gate_lower_bound=-5.0)
    lengths = [int(n) for n in args.lengths.split(",")]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    # the smoke run in float32: the interpreter refuses bf16 (linattn.emulation.interpreted)
    dev, bf16 = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = {name: ([], []) for name in ("vllm", "fla", "emulation")}
    worst = []
    for seed in range(args.seeds):
        weights = random_state_dict(config, 41 + seed, round_to=bf16)
        ref = capture_o(build_layer(config, dtype=torch.float64))  # on the CPU: torch's kernels
        ref.load_state_dict(weights)
        x = torch.randn(1, int(cu[-1]), config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(bf16)
        with torch.no_grad():
            y_ref = ref(x.double(), cu)
        o_ref = ref.captured_o
        outs = {}
        vllm = capture_o(VllmKDA(config, dtype=bf16, device=dev))
        vllm.load_state_dict(weights)
        N = len(lengths)
        conv_dim = 2 * config.num_k_heads * config.head_k_dim + config.num_v_heads * config.head_v_dim
        pool = LayerState(torch.randn(N + 1, conv_dim, config.conv_size - 1, device=dev, dtype=bf16),
                          torch.randn(N + 1, config.num_v_heads, config.head_v_dim, config.head_k_dim, device=dev,
                                      dtype=torch.float32))
        slots = torch.arange(1, N + 1, dtype=torch.int32, device=dev)
        with torch.no_grad():
            y = call_with_pool(vllm, x.to(dev), cu.to(dev), kind="prefill", pool=pool, slots=slots,
                               has_initial_state=torch.zeros(N, dtype=torch.bool, device=dev))
        outs["vllm"] = (y, vllm.captured_o)
        for name, device in (("fla", dev), ("emulation", "cpu")):  # on CUDA fla's kernels, on the CPU torch's
            layer = capture_o(build_layer(config, dtype=bf16, device=device))
            layer.load_state_dict(weights)
            with torch.no_grad():
                outs[name] = (layer(x.to(device), cu.to(device)), layer.captured_o)
        errs = {name: (token_errors(y, y_ref), token_errors(o, o_ref)) for name, (y, o) in outs.items()}
        for name, (ey, eo) in errs.items():
            rows[name][0].append(ey.cpu())
            rows[name][1].append(eo.cpu())
        t = int(errs["vllm"][0].argmax())
        worst.append((float(errs["vllm"][0][t]), seed, t, {n: (float(e[0][t]), float(e[1][t])) for n, e in errs.items()}))
    print(f"KDA {config.num_k_heads} heads, dk {config.head_k_dim}, dv {config.head_v_dim}; fresh sequences {lengths}; "
          f"{args.seeds} seeds; bf16 layers against the float64 layer on the same bf16 weights and input")
    print(f"{'path':<10} {'worst y':>9} {'median y':>9} {'p99 y':>9} {'worst o':>9} {'median o':>9} {'p99 o':>9}")
    for name, (ey, eo) in rows.items():
        ey, eo = torch.cat(ey), torch.cat(eo)
        print(f"{name:<10} {ey.max():9.2e} {ey.median():9.2e} {ey.quantile(0.99):9.2e} "
              f"{eo.max():9.2e} {eo.median():9.2e} {eo.quantile(0.99):9.2e}")
    print("vLLM's worst token per seed (y, o) beside the other paths':")
    for e, seed, t, by in sorted(worst, reverse=True)[:8]:
        said = ", ".join(f"{n} {a:.2e} / {b:.2e}" for n, (a, b) in by.items())
        print(f"  seed {seed} {where(t, cu)}: {said}")


if __name__ == "__main__":
    main()
