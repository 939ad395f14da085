"""vLLM 0.33.0 (no upstream report found): `fused_sigmoid_gating_delta_rule_update(is_kda=True)`
reads every token after a sequence's first with the gate of the wrong place.

    python suites/live_bugs/vllm_fused_sigmoid_gating_kda_gate_stride.py  # CUDA, or a CPU (interpreter)

With `is_kda=True` the gate input `a` is `[T, HV, K]` (one value per key channel): the kernel's pointer is
`a + (bos * HV + i_hv) * K + o_k` (third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:92), but
it steps by `p_a += HV` after each token (:178), where the next token is HV * K further on (the plain
GDN recurrence beside it steps KDA's gate by `HV * K`, fused_recurrent.py:175). Compared, on a verify call of
one sequence of 3 tokens (state indices [[1, 2, 3]], 1 accepted): each token's output and state against a
float64 loop of the kernel's KDA recurrence, and against the same loop given the gate read HV on per token.
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

gating = load_vllm("vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating")
dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
H, HV, K, V, T, gen = 1, 2, 16, 16, 3, torch.Generator().manual_seed(0)
q, k, v = torch.randn(2, 1, T, H, K, generator=gen).unbind() + (torch.randn(1, T, HV, V, generator=gen),)
a, b = torch.randn(T, HV, K, generator=gen), torch.randn(T, HV, generator=gen)  # KDA: a gate per key channel
A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV * K, generator=gen) * 0.5
pool = torch.randn(4, HV, V, K, generator=gen)  # [slots, HV, V, K]; slot 0 is vLLM's null block
idx, accepted, cu = (torch.tensor(x, dtype=torch.int32) for x in ([[1, 2, 3]], [1], [0, T]))


def loop(h, gate):
    """float64, the kernel's KDA recurrence: g = -exp(A_log) softplus(gate + dt_bias) per key channel,
    beta = sigmoid(b), q and k l2-normed; the output and the state after every token."""
    h, outs, states = h.double(), [], []
    for t in range(T):
        qt, kt = (x[0, t].double() * ((x[0, t].double() ** 2).sum(-1, keepdim=True) + 1e-6).rsqrt() for x in (q, k))
        qt, kt = qt.repeat_interleave(HV // H, 0), kt.repeat_interleave(HV // H, 0)
        g = -A_log.double().exp()[:, None] * F.softplus(gate[t].double() + dt_bias.double().view(HV, K))
        h = h * g.exp()[:, None, :]
        u = b[t].double().sigmoid()[:, None] * (v[0, t].double() - torch.einsum("hvk,hk->hv", h, kt))
        h = h + u[:, :, None] * kt[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", h, qt) * K ** -0.5)
        states.append(h)
    return torch.stack(outs), states


def rel(x, y):  # relative Frobenius error
    return ((x.cpu().double() - y).norm() / y.norm()).item()


flat = a.flatten()  # what the kernel reads for token t, head i_hv: K values from (i_hv * K + t * HV)
misread = torch.stack([torch.stack([flat[i * K + t * HV:i * K + t * HV + K] for i in range(HV)]) for t in range(T)])
print(f"vllm {VLLM.version} (its kernel files, sha256 as in the wheel), torch {torch.__version__}, "
      f"triton {triton.__version__}, {dev}{' (TRITON_INTERPRET=1)' if dev == 'cpu' else ''}, float32\n"
      f"fused_sigmoid_gating_delta_rule_update(is_kda=True): one sequence of {T} tokens, a [T, HV, K] = "
      f"{list(a.shape)}, ssm_state_indices [[1, 2, 3]], num_accepted_tokens [1]")
work = pool.to(dev).clone()
o, _ = gating.fused_sigmoid_gating_delta_rule_update(
    *(t.to(dev) for t in (A_log, a, b, dt_bias, q, k, v)), initial_state=work, inplace_final_state=True,
    cu_seqlens=cu.to(dev), ssm_state_indices=idx.to(dev), num_accepted_tokens=accepted.to(dev),
    use_qk_l2norm_in_kernel=True, is_kda=True)
for gate, what in ((a, "the loop (token t's gate at a[t])"), (misread, "the loop given the gate read HV on per token")):
    ref_o, ref_h = loop(pool[1], gate)
    print(f"  vs {what}: output per token " + ", ".join(f"{rel(o[0, t], ref_o[t]):.2e}" for t in range(T))
          + "; state in slots 1, 2, 3: " + ", ".join(f"{rel(work[1 + t], ref_h[t]):.2e}" for t in range(T)))
