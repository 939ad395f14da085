"""fla-based layers as downstream teams write them, for the fla-on-CPU tests (imported lazily:
importing fla costs seconds, so only the tests that use it pay).

- `fla_layer(kind, **options)`: fla's own GatedDeltaNet / KimiDeltaAttention, float64, its
  weights from the project's seeded `random_state_dict` through the fla name map.
- `ContextParallelKDA`: fla's KimiDeltaAttention driven the way fla's context parallelism is
  called (`build_cp_context`, `cp_context=` on the conv and on chunk_kda); `run_cp_layer` is its
  rank function for `spawn`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from einops import rearrange
from fla.layers import GatedDeltaNet, KimiDeltaAttention
from fla.modules.convolution import causal_conv1d
from fla.ops.cp import build_cp_context
from fla.ops.kda import chunk_kda

from layer_parity import random_state_dict
from linattn.layers import config_from_fla_layer, to_fla_state_dict

SIZES = dict(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4, conv_size=4, norm_eps=1e-5)  # GVA 2


def fla_layer(kind: str, *, seed: int, **options):
    """(fla layer in float64 with seeded weights, the project's config, the project's state dict)."""
    if kind == "gdn":
        layer = GatedDeltaNet(**SIZES, expand_v=0.75, **options)
    else:
        layer = KimiDeltaAttention(**SIZES, **options)
    layer = layer.double()
    config = config_from_fla_layer(layer)
    state_dict = random_state_dict(config, seed)
    layer.load_state_dict(to_fla_state_dict(state_dict, config))
    return layer, config, state_dict


class ContextParallelKDA(KimiDeltaAttention):
    """fla's KDA layer on this rank's contiguous piece of a packed batch, its short convs and its
    recurrence crossing rank boundaries through fla's CP context."""

    def forward(self, hidden_states, cp_context):
        q, k, v = (
            causal_conv1d(proj(hidden_states), weight=conv.weight.squeeze(1), activation="silu",
                          cp_context=cp_context)[0]
            for proj, conv in ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        )
        q, k, g = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k, self.f_proj(hidden_states)))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        o, _ = chunk_kda(
            q=q, k=k, v=v, g=g, beta=self.b_proj(hidden_states), A_log=self.A_log, dt_bias=self.dt_bias,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=self.safe_gate, lower_bound=self.lower_bound, cp_context=cp_context,
        )
        o = self.o_norm(o, rearrange(self.g_proj(hidden_states), "... (h d) -> ... h d", d=self.head_v_dim))
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))


def run_cp_layer(fla_state_dict, options, x, dy, cu_seqlens):
    """Rank function: this rank's contiguous piece (rank r holds tokens [r T/cp, (r+1) T/cp)) of
    x through ContextParallelKDA, forward and backward: (y, dx, parameter grads)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = ContextParallelKDA(**SIZES, **options).double()
    layer.load_state_dict(fla_state_dict)
    context = build_cp_context(cu_seqlens.long(), group=dist.group.WORLD, conv1d_kernel_size=SIZES["conv_size"])
    piece = slice(rank * x.shape[1] // world, (rank + 1) * x.shape[1] // world)
    x_local = x[:, piece].clone().requires_grad_()
    y = layer(x_local, cp_context=context)
    (y * dy[:, piece]).sum().backward()
    return y.detach(), x_local.grad, {n: p.grad for n, p in layer.named_parameters()}
