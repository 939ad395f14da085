"""What the vLLM GDN recurrence repros share (not a repro itself): vLLM 0.33.0's two recurrent
kernels loaded from the pinned wheel's files (`clients.engines.loader`; under Triton's interpreter
on a CPU), seeded inputs, a float64 loop of the kernels' recurrence, and one call of either kernel
on a pool in place.

    from vllm_gdn_recurrence import draws, loop, run_kernel, header
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # vLLM's Triton kernels on a CPU: the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # suites/: the loader of the pinned files

import triton  # noqa: E402
from clients.engines.fetch import VLLM  # noqa: E402
from clients.engines.loader import load_vllm  # noqa: E402

OPS = "vllm.third_party.flash_linear_attention.ops"
KERNELS = ("fused_sigmoid_gating_delta_rule_update", "fused_recurrent_gated_delta_rule")
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
H, HV, K, V = 1, 2, 16, 16


def draws(T):
    """Seeded inputs of T tokens (q, k `[1, T, H, K]`, v `[1, T, HV, V]`, a, b `[T, HV]`), A_log,
    dt_bias `[HV]` and a pool of 6 slots `[slots, HV, V, K]` (slot 0 is vLLM's null block)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 1, T, H, K, generator=gen).unbind() + (torch.randn(1, T, HV, V, generator=gen),)
    a, b = torch.randn(2, T, HV, generator=gen)
    A_log, dt_bias = torch.randn(2, HV, generator=gen) * 0.5
    pool = torch.randn(6, HV, V, K, generator=gen)
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias), pool


def loop(x, h, ts):
    """float64, the kernels' recurrence from state h over tokens ts: g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b), q and k l2-normed. Returns (outputs `[len(ts), HV, V]`, the state)."""
    h, outs = h.double(), []
    for t in ts:
        qt, kt = (x[n][0, t].double() * ((x[n][0, t].double() ** 2).sum(-1, keepdim=True) + 1e-6).rsqrt()
                  for n in ("q", "k"))
        qt, kt = qt.repeat_interleave(HV // H, 0), kt.repeat_interleave(HV // H, 0)
        g = -x["A_log"].double().exp() * F.softplus(x["a"][t].double() + x["dt_bias"].double())
        h = h * g.exp()[:, None, None]
        u = x["b"][t].double().sigmoid()[:, None] * (x["v"][0, t].double() - torch.einsum("hvk,hk->hv", h, kt))
        h = h + u[:, :, None] * kt[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", h, qt) * K ** -0.5)
    return torch.stack(outs), h


def run_kernel(name, x, pool, **indices):
    """One call of kernel `name` (KERNELS) on a copy of the pool, in place, with `indices`
    (cu_seqlens, ssm_state_indices, num_accepted_tokens as int32 tensors): (outputs, the pool after)."""
    work = pool.to(DEV).clone()
    d = dict(initial_state=work, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
             **{n: t.to(DEV) for n, t in indices.items()})
    q, k, v, a, b, A_log, dt_bias = (x[n].to(DEV) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias"))
    if name == KERNELS[0]:
        o, _ = load_vllm(f"{OPS}.fused_sigmoid_gating").fused_sigmoid_gating_delta_rule_update(
            A_log, a, b, dt_bias, q, k, v, **d)
    else:  # the same recurrence, g and beta given
        g, beta = -A_log.exp() * F.softplus(a + dt_bias), b.sigmoid()
        o, _ = load_vllm(f"{OPS}.fused_recurrent").fused_recurrent_gated_delta_rule(q, k, v, g[None], beta[None], **d)
    return o, work


def rel(x, y):  # relative Frobenius error
    return ((x.cpu().double() - y).norm() / y.norm()).item()


def header(what):
    print(f"vllm {VLLM.version} (its kernel files, sha256 as in the wheel), torch {torch.__version__}, "
          f"triton {triton.__version__}, {DEV}{' (TRITON_INTERPRET=1)' if DEV == 'cpu' else ''}, float32\n" + what)
