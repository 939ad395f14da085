"""Gated DeltaNet (Qwen3-Next, Qwen3.5), head-sharded over TP.

Math, as HF's Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet (and fla's GatedDeltaNet layer):

    q, k, v, z, b, a = input projections of x          (layout per family, see state_dict.py)
    q | k | v        = silu(causal depthwise conv over the concatenated q, k, v channels)
    beta             = sigmoid(b)                        [HV]
    g                = -exp(A_log) * softplus(a + dt_bias)   (log decay per value head)
    o                = gated_delta_rule(q, k, v, g, beta, scale=dk^-0.5, L2-normalised q and k)
    o                = RMSNorm(o) * norm.weight * silu(z)    (per value head, eps = norm_eps)
    y                = out_proj(o)

Value head j reads key head j // (HV / H), or j % H for config.head_pairing "tiled"; the kernels
take q, k with H heads and do the pairing.
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
        """x `[1, T, hidden]` -> ([q, k, v] `[1, T, key_dim | key_dim | value_dim]`, b, a `[1, T, HV]`)."""
        c = self.local_config
        if c.family == "qwen3_next":
            # rows grouped per key head ([q dk | k dk | v r*dv | z r*dv] and [b r | a r] for each
            # head): the weight rows are gathered into block-major order so each projection writes
            # its output contiguously, with no copy of the activations
            rows = self._qwen3_next_rows(x.device)
            q, k, v = self.in_proj_qkvz.weight[rows["qkv"]].split([c.key_dim, c.key_dim, c.value_dim], dim=0)
            b, a = self.in_proj_ba.weight[rows["ba"]].split(c.num_v_heads, dim=0)
            return [F.linear(x, w) for w in (self._key_head(q), self._key_head(k), v)], F.linear(x, b), F.linear(x, a)
        q, k, v = self.in_proj_qkv.weight.split([c.key_dim, c.key_dim, c.value_dim], dim=0)
        qkv = [F.linear(x, w) for w in (self._key_head(q), self._key_head(k), v)]
        return qkv, F.linear(x, self.in_proj_b.weight), F.linear(x, self.in_proj_a.weight)

    def _project_output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """z `[1, T, HV, dv]`: projected after the recurrence, so it is not held through it."""
        c = self.local_config
        if c.family == "qwen3_next":
            z = F.linear(x, self.in_proj_qkvz.weight[self._qwen3_next_rows(x.device)["z"]])
        else:
            z = F.linear(x, self.in_proj_z.weight)
        return z.view(1, x.shape[1], c.num_v_heads, c.head_v_dim)

    def _qwen3_next_rows(self, device) -> dict:
        """Row indices of [q | k | v] and of z in in_proj_qkvz, and of [b | a] in in_proj_ba
        (block-major order: one gather each)."""
        cached = getattr(self, "_rows", None)
        if cached is None or cached["qkv"].device != device:
            c = self.local_config
            H, r, dk, dv = c.num_k_heads, c.v_heads_per_k_head, c.head_k_dim, c.head_v_dim
            per_head = torch.arange(H, device=device).view(H, 1)
            qkvz, ba = per_head * (2 * dk + 2 * r * dv), per_head * (2 * r)

            def rows(base, start, width):
                return (base + torch.arange(start, start + width, device=device)).reshape(-1)

            cached = dict(qkv=torch.cat([rows(qkvz, 0, dk), rows(qkvz, dk, dk), rows(qkvz, 2 * dk, r * dv)]),
                          z=rows(qkvz, 2 * dk + r * dv, r * dv), ba=torch.cat([rows(ba, 0, r), rows(ba, r, r)]))
            self._rows = cached
        return cached

    def _mix_tokens(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cp_context, carry=None) -> torch.Tensor:
        c = self.local_config
        T = x.shape[1]
        qkv, b, a = self._project_inputs(x)
        q_w, k_w, v_w = self.conv1d.weight.squeeze(1).split([c.key_dim, c.key_dim, c.value_dim], dim=0)
        q, k, v = self._short_conv(qkv, [self._key_head(q_w), self._key_head(k_w), v_w], cu_seqlens, cp_context, carry)
        del qkv  # the projections are the conv's inputs only: without grad, not held through the recurrence
        q = q.reshape(1, T, c.num_k_heads, c.head_k_dim)
        k = k.reshape(1, T, c.num_k_heads, c.head_k_dim)
        v = v.reshape(1, T, c.num_v_heads, c.head_v_dim)
        # beta and the decay in at least float32 (HF: "if the model is loaded in fp16, A might be -inf")
        if self._fuses_gate(x, cp_context):
            o = self._delta_rule(q, k, v, a, b, cu_seqlens, carry=carry, use_gate_in_kernel=True, A_log=self.A_log,
                                 dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True)
        else:
            g = kernels.log_decay(a, self.A_log, self.dt_bias)
            o = self._delta_rule(q, k, v, g, torch.sigmoid(at_least_float32(b)), cu_seqlens, cp_context, carry)
        o = kernels.gated_rms_norm(o, self._project_output_gate(x), self._replicated(self.norm.weight),
                                   self.config.norm_eps, "silu")
        return F.linear(o.reshape(1, T, c.value_dim), self.out_proj.weight)
