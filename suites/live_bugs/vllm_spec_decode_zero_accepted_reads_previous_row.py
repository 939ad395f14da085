"""vLLM 0.33.0 (no upstream report found): in a speculative-decoding call, a row given
`num_accepted_tokens = 0` starts from the previous row's last slot, another sequence's state.

    python suites/live_bugs/vllm_spec_decode_zero_accepted_reads_previous_row.py  # CUDA, or a CPU (interpreter)

`fused_sigmoid_gating_delta_rule_update` (third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:106-110)
and `fused_recurrent_gated_delta_rule` (fused_recurrent.py:107-111) read row n's first state at slot
`ssm_state_indices[n * stride + num_accepted_tokens[n] - 1]`: with 0 accepted, row n - 1's last slot (row 0:
the int before the tensor), without an error. Compared, on a verify call of 2 rows x 2 tokens, indices
[[1, 2], [3, 4]], num_accepted_tokens [1, 0]: row 1 against a float64 loop of the kernel's recurrence from
its own first slot, and from row 0's last state (the interpreter runs row 0's programs first; on a GPU
row 1's load races row 0's store to slot 2).
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
H, HV, K, V, T = 1, 2, 16, 16, 4
gen = torch.Generator().manual_seed(0)
q, k, v = torch.randn(2, 1, T, H, K, generator=gen).unbind() + (torch.randn(1, T, HV, V, generator=gen),)
a, b = torch.randn(2, T, HV, generator=gen)
A_log, dt_bias = torch.randn(2, HV, generator=gen) * 0.5
pool = torch.randn(6, HV, V, K, generator=gen)  # [slots, HV, V, K]; slot 0 is vLLM's null block
idx, accepted, cu = (torch.tensor(x, dtype=torch.int32) for x in ([[1, 2], [3, 4]], [1, 0], [0, 2, 4]))


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
      "verify call: 2 rows x 2 tokens, ssm_state_indices [[1, 2], [3, 4]], num_accepted_tokens [1, 0]")
row0_o, row0_state = loop(pool[1], (0, 1))
own_o, own_h = loop(pool[3], (2, 3))
prev_o, prev_h = loop(row0_state, (2, 3))
for name in ("fused_sigmoid_gating_delta_rule_update", "fused_recurrent_gated_delta_rule"):
    work = pool.to(dev).clone()
    d = dict(initial_state=work, inplace_final_state=True, cu_seqlens=cu.to(dev), ssm_state_indices=idx.to(dev),
             num_accepted_tokens=accepted.to(dev), use_qk_l2norm_in_kernel=True)
    qd, kd, vd, ad, bd, A_d, dt_d = (t.to(dev) for t in (q, k, v, a, b, A_log, dt_bias))
    if name.startswith("fused_sigmoid"):
        o, _ = gating.fused_sigmoid_gating_delta_rule_update(A_d, ad, bd, dt_d, qd, kd, vd, **d)
    else:  # the same recurrence, g and beta given
        g, beta = -A_d.exp() * F.softplus(ad + dt_d), bd.sigmoid()
        o, _ = recurrent.fused_recurrent_gated_delta_rule(qd, kd, vd, g[None], beta[None], **d)
    print(f"  {name}: row 0 (1 accepted) vs the loop from slot 1: output {rel(o[0, :2], row0_o):.2e}; "
          f"row 1 (own slots [3, 4], 0 accepted):")
    print(f"    vs the loop from its first slot 3: output {rel(o[0, 2:], own_o):.2e}, slot 4 {rel(work[4], own_h):.2e}")
    print(f"    vs the loop from row 0's last state (slot 2): output {rel(o[0, 2:], prev_o):.2e}, "
          f"slot 4 {rel(work[4], prev_h):.2e} (started from another sequence's state)")
