"""A planted gate-gradient cancellation in a fused delta-rule backward (the bug record's entry for
FlashQLA's fused backward, check gate-gradients): an op with kernels.gated_delta_rule's signature
whose backward rounds one of the two cancelling copies of the gate gradient to bf16.

Where it lived: FlashQLA's fused TileLang backward for the gated delta rule (flash_qla/ops/
gated_delta_rule/chunk/*/fused_bwd.py) forms each chunk's gate gradient as
sum((dA*A) - (dA*A)^T) over the chunk's gated pair products A and their gradient dA, in float32
fragments, but the transposed copy went through bf16 shared memory: the maintainers' reading is
"storing FP32 data into BF16 shared memory during the matrix transpose operation", fixed by
moving the float32 bits through as two 16-bit halves. The diagonal (decay exp(0) = 1) then no
longer cancels: a residue of 2^-9 of each diagonal term is left in every token's gate gradient.
At mild decay that is within bf16 noise; at strong decay it is all a fast-decaying head's gate
gradient holds, and A_log's and dt_bias's gradients (sums of it over the head's tokens, times
|g_t| up to 45) come out O(1) off while the forward is exact (cases.gate_gradients).

Here: linattn's chunked reference in float32 (the op's compute dtype for bf16 inputs) with the
intra-chunk decay exp(G_i - G_j) (reference.delta_rule.scalar_lower_decay, which takes the
per-token log decay g and sums it to G itself) given a backward of that form:
dG = rowsum(M - bf16(M^T)), M = dD * D, then through the cumulative sum to g (dg_t = sum over
i >= t of dG_i), everything else float32. Torch code only, so it runs on CPU and CUDA tensors
alike; the gate is computed before it, as kernels.log_decay does.
"""

from __future__ import annotations

import re
from unittest import mock

import torch

from linattn import kernels, reference
from linattn.reference import delta_rule

_LOWER_DECAY = delta_rule.scalar_lower_decay


class _DecayWithBf16Transpose(torch.autograd.Function):
    """D[i, j] = exp(G_i - G_j) for i >= j (else 0), G = cumsum(g); backward dG = rowsum(M - bf16(M^T)),
    M = dD * D, and dg its suffix sums (the chain through G = cumsum(g))."""

    @staticmethod
    def forward(ctx, g):
        D = _LOWER_DECAY(g)
        ctx.save_for_backward(D)
        return D

    @staticmethod
    def backward(ctx, dD):
        (D,) = ctx.saved_tensors
        M = dD * D  # float32: the fused kernel's accumulator fragment
        through_shared = M.transpose(-1, -2).to(torch.bfloat16).to(M.dtype)  # the transpose, stored in bf16
        dG = (M - through_shared).sum(-1)
        return dG.flip(-1).cumsum(-1).flip(-1)


def gated_delta_rule_with_a_bf16_transposed_gate_gradient(q, k, v, g, beta, scale=None, initial_state=None,
                                                          output_final_state=False, cu_seqlens=None, *,
                                                          use_gate_in_kernel=False, A_log=None, dt_bias=None):
    """The planted op: kernels.gated_delta_rule's result (float32 compute for half-precision inputs,
    output in q's dtype), its gate gradient cancelled through a bf16 transpose."""
    if use_gate_in_kernel:
        g = kernels.log_decay(g, A_log, dt_bias)
    compute = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    # the forward builds the graph; the planted Function's backward is in it from then on
    with mock.patch.object(delta_rule, "scalar_lower_decay", _DecayWithBf16Transpose.apply):
        o, final_state = reference.gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                    cu_seqlens, compute_dtype=compute)
    return o.to(q.dtype), final_state


def located(sizes=None) -> str:
    """The plant's report at strong decay (cases.gate_gradients): A_log's and dt_bias's gradient rows, each
    at a fast-decaying value head (exp(A_log) >= 8: the heads whose true gate gradient the residue swamps)."""
    from cases.gate_gradients import RATES, SIZES

    def parity_row(name, where):  # bug_record.located.parity_row, without importing the record's checks
        return re.escape(name) + r"\s+\S+\s+\S+\s+\S+\s+" + where

    sizes = sizes or SIZES
    fast = "|".join(re.escape(f"value head {h} (exp(A_log) = {RATES[h % len(RATES)]:g})")
                    for h in range(sizes.value_heads) if RATES[h % len(RATES)] >= 8)
    return parity_row("dA_log", f"(?:{fast})") + r"[^\n]*\n\s+" + parity_row("ddt_bias", f"(?:{fast})")
