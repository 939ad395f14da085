"""Kimi delta attention (Kimi Linear and successors), head-sharded over TP.

Math, as fla's KimiDeltaAttention layer (fla/layers/kda.py with use_gate_in_kernel) and HF's
KimiLinearDeltaAttention:

    q, k, v   = silu(causal depthwise conv(q_proj x)), same for k and v (three convs, W taps)
    f         = f_b_proj(f_a_proj(x)) + dt_bias          [HV, dk]  (f_a_proj: hidden -> dv, low rank)
    g         = -exp(A_log) * softplus(f)                 without a lower bound
              = lower_bound * sigmoid(exp(A_log) * f)     with one (fla's safe gate), in [lb, 0)
    beta      = sigmoid(b_proj x)                          [HV]
    o         = kda(q, k, v, g, beta, scale=dk^-0.5, L2-normalised q and k)
    o         = RMSNorm(o) * o_norm.weight * sigmoid(gate)   gate = g_proj x (or g_b_proj(g_a_proj x))
    y         = o_proj(o)

Under CP the three convolutions run as one call on the concatenated [q | k | v] channels, so a
context-parallel conv exchanges one halo (see HeadShardedLinearAttention._short_conv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linattn import kernels
from linattn.kernels import at_least_float32

from .base import HeadShardedLinearAttention

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(HeadShardedLinearAttention):
    """Family 'kda'."""

    def _mix_tokens(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cp_context, carry=None) -> torch.Tensor:
        c = self.local_config
        T = x.shape[1]
        HV, dk, dv = c.num_v_heads, c.head_k_dim, c.head_v_dim
        q, k, v = self._short_conv(
            [F.linear(x, self._key_head(self.q_proj.weight)), F.linear(x, self._key_head(self.k_proj.weight)),
             F.linear(x, self.v_proj.weight)],
            [self._key_head(self.q_conv1d.weight).squeeze(1), self._key_head(self.k_conv1d.weight).squeeze(1),
             self.v_conv1d.weight.squeeze(1)],
            cu_seqlens, cp_context, carry)
        q = q.reshape(1, T, c.num_k_heads, dk)
        k = k.reshape(1, T, c.num_k_heads, dk)
        v = v.reshape(1, T, HV, dv)

        # The gate in at least float32 from its input projections on: dt_bias (~ log dt, -7 to -2)
        # cancels most of f_b_proj's output, so bf16 rounding of the projections is a large error
        # in f, and with the lower bound sigmoid(exp(A_log) * f) multiplies it by up to 16. fla and
        # HF round the projections to bf16. On CUDA they run on bf16 tensor cores with float32
        # output (kernels.float32_linear). f_a_proj is replicated (its output feeds every rank's
        # heads); under TP its gradient is summed in float32 (without TP there is no sum, and no
        # float32 copy of the weight).
        proj = "bf16_split" if x.is_cuda else "torch"
        f_a_weight = self.f_a_proj.weight if self.tp_size == 1 else self._replicated(at_least_float32(self.f_a_proj.weight))
        f_low_rank = kernels.float32_linear(x, f_a_weight, proj)
        b = F.linear(x, self.b_proj.weight)
        if self._fuses_gate(x, cp_context):
            # dt_bias added in float32 with f_b_proj: the kernel then takes f + dt_bias rounded to
            # the layer dtype once, after the cancellation, like fla's layer takes its bf16 f
            f = kernels.float32_linear(f_low_rank, self.f_b_proj.weight, proj, bias=self.dt_bias.reshape(-1),
                                       round_to=x.dtype).view(1, T, HV, dk)
            o = self._delta_rule(q, k, v, f, b, cu_seqlens, carry=carry, use_gate_in_kernel=True, A_log=self.A_log,
                                 lower_bound=self.config.gate_lower_bound, use_beta_sigmoid_in_kernel=True)
        else:
            f = kernels.float32_linear(f_low_rank, self.f_b_proj.weight, proj).view(1, T, HV, dk)
            g = kernels.log_decay(f, self.A_log, self.dt_bias, self.config.gate_lower_bound)
            o = self._delta_rule(q, k, v, g, torch.sigmoid(at_least_float32(b)), cu_seqlens, cp_context, carry)

        if self.config.output_gate_rank is None:
            gate = F.linear(x, self.g_proj.weight)
        else:
            gate = F.linear(F.linear(x, self._replicated(self.g_a_proj.weight)), self.g_b_proj.weight)
        o = kernels.gated_rms_norm(o, gate.view(1, T, HV, dv), self._replicated(self.o_norm.weight),
                                   self.config.norm_eps, "sigmoid")
        return F.linear(o.reshape(1, T, c.value_dim), self.o_proj.weight)
