"""vLLM 0.33.0 (no upstream report found): with one state slot per sequence (1-D `ssm_state_indices`) and
several tokens per sequence, the in-place store puts token t's state into the slot t places on: the next
requests' slots.

    python suites/live_bugs/vllm_flat_state_indices_multi_token_store.py  # CUDA, or a CPU (interpreter)

`fused_sigmoid_gating_delta_rule_update` (third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:157-166)
and `fused_recurrent_gated_delta_rule` (fused_recurrent.py:153-162) store the state after token t at slot
`ssm_state_indices[n * stride_indices_seq + t]` (`stride_indices_tok`, fused_sigmoid_gating.py:237, is never
read); the indices "map the input sequences to the initial/final states" (fused_recurrent.py:576). Compared,
on 2 sequences of 2 and 1 tokens, indices [2, 4]: each against a float64 loop of the kernel's recurrence
from its slot (the interpreter runs sequence 0's programs first; on a GPU the two race on slot 4).
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

ops = "vllm.third_party.flash_linear_attention.ops"
gating, recurrent = load_vllm(f"{ops}.fused_sigmoid_gating"), load_vllm(f"{ops}.fused_recurrent")
dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
H, HV, K, V, T, gen = 1, 2, 16, 16, 3, torch.Generator().manual_seed(0)
q, k, v = torch.randn(2, 1, T, H, K, generator=gen).unbind() + (torch.randn(1, T, HV, V, generator=gen),)
a, b = torch.randn(2, T, HV, generator=gen)
A_log, dt_bias = torch.randn(2, HV, generator=gen) * 0.5
pool = torch.randn(6, HV, V, K, generator=gen)  # [slots, HV, V, K]; slot 0 is vLLM's null block
idx, cu = (torch.tensor(x, dtype=torch.int32) for x in ([2, 4], [0, 2, 3]))


def loop(h, ts):
    """float64, the kernel's recurrence: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), q, k l2-normed."""
    h, outs = h.double(), []
    for t in ts:
        qt, kt = (x[0, t].double() * ((x[0, t].double() ** 2).sum(-1, keepdim=True) + 1e-6).rsqrt() for x in (q, k))
        qt, kt = qt.repeat_interleave(HV // H, 0), kt.repeat_interleave(HV // H, 0)
        g = -A_log.double().exp() * F.softplus(a[t].double() + dt_bias.double())
        h = h * g.exp()[:, None, None]
        u = b[t].double().sigmoid()[:, None] * (v[0, t].double() - torch.einsum("hvk,hk->hv", h, kt))
        h = h + u[:, :, None] * kt[:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", h, qt) * K ** -0.5)
    return torch.stack(outs), h


def rel(x, y):  # relative Frobenius error
    return ((x.cpu().double() - y).norm() / y.norm()).item()


print(f"vllm {VLLM.version} (its kernel files, sha256 as in the wheel), torch {torch.__version__}, "
      f"triton {triton.__version__}, {dev}{' (TRITON_INTERPRET=1)' if dev == 'cpu' else ''}, float32\n"
      "one call: sequences of 2 and 1 tokens (cu_seqlens [0, 2, 3]), ssm_state_indices [2, 4] (1-D), in place; "
      "each vs a float64 loop from its slot")
seq0_o, seq0_h = loop(pool[2], (0, 1))
_, first_h = loop(pool[2], (0,))
seq1_o, seq1_h = loop(pool[4], (2,))
moved_o, _ = loop(seq0_h, (2,))
for name in ("fused_sigmoid_gating_delta_rule_update", "fused_recurrent_gated_delta_rule"):
    work = pool.to(dev).clone()
    d = dict(initial_state=work, inplace_final_state=True, cu_seqlens=cu.to(dev), ssm_state_indices=idx.to(dev),
             use_qk_l2norm_in_kernel=True)
    qd, kd, vd, ad, bd, A_d, dt_d = (t.to(dev) for t in (q, k, v, a, b, A_log, dt_bias))
    if name.startswith("fused_sigmoid"):
        o, _ = gating.fused_sigmoid_gating_delta_rule_update(A_d, ad, bd, dt_d, qd, kd, vd, **d)
    else:  # the same recurrence, g and beta given
        g, beta = -A_d.exp() * F.softplus(ad + dt_d), bd.sigmoid()
        o, _ = recurrent.fused_recurrent_gated_delta_rule(qd, kd, vd, g[None], beta[None], **d)
    print(f"  {name}:\n    sequence 0 (2 tokens, slot 2): output {rel(o[0, :2], seq0_o):.2e}; "
          f"slot 2 vs its final state {rel(work[2], seq0_h):.2e}, vs after token 0 {rel(work[2], first_h):.2e}")
    print(f"    sequence 1 (1 token, slot 4): output {rel(o[0, 2:], seq1_o):.2e}, slot 4 {rel(work[4], seq1_h):.2e}; "
          f"as if started from sequence 0's final state: output {rel(o[0, 2:], moved_o):.2e}")
