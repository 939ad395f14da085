"""fla 0.6.0 (QwenLM/FlashQLA #28, part 1): `chunk_gated_delta_rule` on a packed batch padded past
its last boundary (T > cu_seqlens[-1]) writes neither the outputs nor the input gradients of the
padding tail: they are whatever the allocator held, and a trainer's projection sums them into its
weight gradients unless it zeroes them itself. fla accepts the input without an error.

    python suites/live_bugs/fla_varlen_padded_tail_unwritten.py  # CUDA, or a CPU (Triton's interpreter)

Two sequences of 10 and 20 tokens, then a tail of 10 padding tokens (T = 40), float32, with
PyTorch's fill of uninitialized memory (NaN) on: the real tokens against a float64 loop of the
gated delta rule, then the tail's outputs and gradients.
"""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # fla's Triton kernels on a CPU: the interpreter, with linattn's two patches
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from linattn.emulation.interpreted import prepare_process

    prepare_process()

import fla  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
T, H, K, V = 40, 2, 16, 16
cu = [0, 10, 30]
gen = torch.Generator().manual_seed(28)
q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
        for _ in range(2))
v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64)
beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
do = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)


def loop(q, k, v, g, beta):
    """The gated delta rule token by token in float64, one state per sequence (scale K ** -0.5)."""
    o = torch.zeros_like(v)
    for a, b in zip(cu[:-1], cu[1:]):
        S = torch.zeros(1, H, K, V, dtype=torch.float64)
        for t in range(a, b):
            S = S * g[:, t].exp()[..., None, None]
            kt, vt = k[:, t], v[:, t]
            u = beta[:, t][..., None] * (vt - torch.einsum("bhk,bhkv->bhv", kt, S))
            S = S + kt[..., None] * u[..., None, :]
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S)
    return o


torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = True
leaves = [t.float().to(device).requires_grad_() for t in (q, k, v, g, beta)]
o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=torch.tensor(cu, device=device))
o.backward(do.float().to(device))
ref = [t[:, :cu[-1]].clone().requires_grad_() for t in (q, k, v, g, beta)]
o_ref = loop(*ref)
o_ref.backward(do[:, :cu[-1]])

print(f"torch {torch.__version__}, fla {fla.__version__}, device {device}"
      + (" (Triton's interpreter)" if device == "cpu" else ""))
print(f"T = {T}, cu_seqlens = {cu}: tokens {cu[-1]}..{T - 1} are padding")
err = lambda a, b: float((a.double().cpu() - b).norm() / b.norm())  # noqa: E731
print(f"real tokens against the float64 loop: o {err(o[:, :cu[-1]].detach(), o_ref.detach()):.2e}, "
      + ", ".join(f"d{n} {err(x.grad[:, :cu[-1]], r.grad):.2e}" for n, x, r in zip("qkvgb", leaves, ref)))
tails = {"o": o.detach()[:, cu[-1]:], **{f"d{n}": x.grad[:, cu[-1]:] for n, x in zip(("q", "k", "v", "g", "beta"),
                                                                                       leaves)}}
print("padding tail (unwritten memory NaN): "
      + ", ".join(f"{n} {int(torch.isnan(t).sum())} of {t.numel()} NaN" for n, t in tails.items()))
