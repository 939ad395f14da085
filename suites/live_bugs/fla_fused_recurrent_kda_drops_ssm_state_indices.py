"""fla 0.6.0 (no upstream report found): the public `fused_recurrent_kda` takes `ssm_state_indices`
into `**kwargs` and never reads it, silently; its forward `fused_recurrent_kda_fwd` honours it.

    python suites/live_bugs/fla_fused_recurrent_kda_drops_ssm_state_indices.py  # CUDA, or a CPU (Triton interpreter)

`fused_recurrent_kda` (fla/ops/kda/fused_recurrent.py:338) names no `ssm_state_indices` (the
continuous-batching state pool: the slot each sequence reads and writes) but takes `**kwargs`, and
calls `fused_recurrent_kda_fwd` (:236, which has the argument) without it: a decode step given a pool
and a slot reads slot 0 and writes no slot. Compared, on one decode token from a pool of 4 states:
the public call with `ssm_state_indices=[2]` against the same call without it, and against
`fused_recurrent_kda_fwd` given the same indices (slot 2's state read, written in place).
"""
import os

import torch

if not torch.cuda.is_available():  # fla's Triton kernels on a CPU: the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import fla  # noqa: E402
from fla.ops.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, K, V, P = 1, 1, 2, 16, 16, 4
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, T, H, D, generator=gen) for D in (K, K, V))
k = torch.nn.functional.normalize(k, dim=-1)
g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen))
beta = torch.rand(B, T, H, generator=gen)
pool = torch.randn(P, H, K, V, generator=gen)
x = [t.to(device) for t in (q, k, v, g, beta)]
slot = torch.tensor([2], device=device)

public_pool = pool.to(device).clone()
o_public, ht_public = fused_recurrent_kda(*x, initial_state=public_pool, output_final_state=True,
                                         ssm_state_indices=slot)
o_without, ht_without = fused_recurrent_kda(*x, initial_state=pool.to(device).clone(), output_final_state=True)
fwd_pool = pool.to(device).clone()
o_fwd, _ = fused_recurrent_kda_fwd(*x, initial_state=fwd_pool, inplace_final_state=True, ssm_state_indices=slot)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


interpreted = " (TRITON_INTERPRET=1)" if device == "cpu" else ""
print(f"fla {fla.__version__}, torch {torch.__version__}, {device}{interpreted}, float32")
print(f"one decode token, a pool of {P} states, ssm_state_indices=[2]:")
print(f"  fused_recurrent_kda with the indices vs without them: output {rel(o_public, o_without):.2e}, "
      f"final state {rel(ht_public[:1], ht_without[:1]):.2e} (the argument has no effect)")
print(f"  fused_recurrent_kda vs fused_recurrent_kda_fwd given the same indices: output {rel(o_public, o_fwd):.2e}")
print(f"  the pool's slot 2 after the public call: changed by {rel(public_pool[2], pool[2].to(device)):.2e}; "
      f"after fused_recurrent_kda_fwd: by {rel(fwd_pool[2], pool[2].to(device)):.2e}")
