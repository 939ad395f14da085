"""fla PR #955 (open; live in fla 0.6.0): causal_conv1d with cu_seqlens and a batch of B > 1 rows
returns a wrong dweight; y and dx are right.

    python suites/live_bugs/fla_955_causal_conv1d_varlen_batch.py     # CUDA, or a CPU under Triton's interpreter

fla's backward (fla/modules/causal_conv1d/ops.py) sizes its per-chunk weight-gradient buffer
B*NT rows (`dw = weight.new_empty(B*NT, ...)`), the varlen branch of its kernel writes rows
`i_tg = i_t` < NT whatever the batch index, and `dw.sum(0)` adds the B*NT - NT rows nobody wrote.
The reference: the same tokens in float64, row by row, sequence by sequence.
"""
import os

import torch

if not torch.cuda.is_available():  # fla's Triton kernels on a CPU: the interpreter, one autotune config
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.autotuner import Autotuner

    _prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs: _prune(self, kwargs)[:1]  # benchmarking needs a GPU

import fla  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fla.modules.causal_conv1d import causal_conv1d  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
B, T, D, W = 2, 24, 32, 4
cu_rows = [[0, 10, 24], [0, 6, 24]]  # the sequences of each row
cu = torch.tensor([0, 10, 24, 30, 48], device=device)  # the same over the B*T flattened tokens
gen = torch.Generator().manual_seed(0)
x64, w64, dy64 = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((B, T, D), (D, W), (B, T, D)))


def dweight_reference():
    w = w64.clone().requires_grad_()
    for b in range(B):
        for bos, eos in zip(cu_rows[b][:-1], cu_rows[b][1:]):
            seq = x64[b, bos:eos].T[None]  # [1, D, L]
            y = F.silu(F.conv1d(F.pad(seq, (W - 1, 0)), w[:, None], groups=D))[0].T
            (y * dy64[b, bos:eos]).sum().backward()
    return w.grad


def dweight_fla(rows):
    x = x64.float().reshape(rows, B * T // rows, D).to(device).requires_grad_()
    w = w64.float().to(device).requires_grad_()
    y, _ = causal_conv1d(x, weight=w, activation="silu", cu_seqlens=cu)
    y.backward(dy64.float().reshape(x.shape).to(device))
    return w.grad.double().cpu()


ref = dweight_reference()
interpreted = " (TRITON_INTERPRET=1)" if device == "cpu" else ""
print(f"fla {fla.__version__}, torch {torch.__version__}, {device}{interpreted}")
print(f"dweight's relative error against float64 (row by row, sequence by sequence), cu_seqlens {cu.tolist()}:")
for fill in (False, True):  # True: torch.empty fills floats with NaN (PyTorch's deterministic mode)
    torch.use_deterministic_algorithms(fill, warn_only=True)
    memory = "uninitialized memory NaN" if fill else "memory as the allocator left it"
    for rows in (1, B):
        err = ((dweight_fla(rows) - ref).norm() / ref.norm()).item()
        print(f"  x [{rows}, {B * T // rows}, {D}], {memory}: {err:.2e}")
