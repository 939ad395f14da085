"""Gated DeltaNet (Qwen3-Next, Qwen3.5), head-sharded over TP.

Math, as HF's Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet (and fla's GatedDeltaNet layer):

    q, k, v, z, b, a = input projections of x          (layout per family, see state_dict.py)
    q | k | v        = silu(causal depthwise conv over the concatenated q, k, v channels)
    beta             = sigmoid(b)                        [HV]
    g                = -exp(A_log) * softplus(a + dt_bias)   (log decay per value head)
    o                = gated_delta_rule(q, k, v, g, beta, scale=dk^-0.5, L2-normalised q and k)
    o                = RMSNorm(o) * norm.weight * silu(z)    (per value head, eps = norm_eps)
    y                = out_proj(o)

Value head j reads key head j // (HV / H); the kernels take q, k with H heads and do the grouping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linattn import kernels
from linattn.kernels import at_least_float32

from .base import HeadShardedLinearAttention

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(HeadShardedLinearAttention):
    """Families 'qwen3_next' and 'qwen3_5': same math, different input projection layouts."""

    def _project_inputs(self, x: torch.Tensor):
        """x `[1, T, hidden]` -> (qkv `[1, T, conv_dim]` block-major [q | k | v], z `[1, T, HV, dv]`, b, a `[1, T, HV]`)."""
        c = self.local_config
        T = x.shape[1]
        HV, dv = c.num_v_heads, c.head_v_dim
        if c.family == "qwen3_next":
            # rows grouped per key head ([q dk | k dk | v r*dv | z r*dv] and [b r | a r] for each
            # head): the weight rows are gathered into block-major order so each projection writes
            # its output contiguously, with no copy of the activations
            qkv_rows, z_rows, b_rows, a_rows = self._qwen3_next_rows(x.device)
            w, w_ba = self.in_proj_qkvz.weight, self.in_proj_ba.weight
            return (F.linear(x, w[qkv_rows]), F.linear(x, w[z_rows]).view(1, T, HV, dv),
                    F.linear(x, w_ba[b_rows]), F.linear(x, w_ba[a_rows]))
        qkv = F.linear(x, self.in_proj_qkv.weight)
        z = F.linear(x, self.in_proj_z.weight).view(1, T, HV, dv)
        return qkv, z, F.linear(x, self.in_proj_b.weight), F.linear(x, self.in_proj_a.weight)

    def _qwen3_next_rows(self, device):
        """Row indices of in_proj_qkvz for block-major [q | k | v] and for z, of in_proj_ba for b and a."""
        cached = getattr(self, "_rows", None)
        if cached is None or cached[0].device != device:
            c = self.local_config
            H, r, dk, dv = c.num_k_heads, c.v_heads_per_k_head, c.head_k_dim, c.head_v_dim
            per_head = torch.arange(H, device=device).view(H, 1)
            qkvz = per_head * (2 * dk + 2 * r * dv)
            ba = per_head * (2 * r)

            def rows(base, start, width):
                return (base + torch.arange(start, start + width, device=device)).reshape(-1)

            qkv = torch.cat([rows(qkvz, 0, dk), rows(qkvz, dk, dk), rows(qkvz, 2 * dk, r * dv)])
            cached = (qkv, rows(qkvz, 2 * dk + r * dv, r * dv), rows(ba, 0, r), rows(ba, r, r))
            self._rows = cached
        return cached

    def _mix_tokens(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cp_context) -> torch.Tensor:
        c = self.local_config
        T = x.shape[1]
        qkv, z, b, a = self._project_inputs(x)
        qkv = self._short_conv(qkv, self.conv1d.weight.squeeze(1), cu_seqlens, cp_context)
        q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = q.reshape(1, T, c.num_k_heads, c.head_k_dim)
        k = k.reshape(1, T, c.num_k_heads, c.head_k_dim)
        v = v.reshape(1, T, c.num_v_heads, c.head_v_dim)
        # beta and the decay in at least float32 (HF: "if the model is loaded in fp16, A might be -inf")
        if self._fuses_gate(x, cp_context):
            o = self._delta_rule(q, k, v, a, b, cu_seqlens, **self._gate_in_kernel())
        else:
            g = kernels.log_decay(a, self.A_log, self.dt_bias)
            o = self._delta_rule(q, k, v, g, torch.sigmoid(at_least_float32(b)), cu_seqlens, cp_context)
        o = kernels.gated_rms_norm(o, z, self._replicated(self.norm.weight), self.config.norm_eps, "silu")
        return F.linear(o.reshape(1, T, c.value_dim), self.out_proj.weight)
