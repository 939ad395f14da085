"""fla's PrecondGatedDeltaNet (preconditioned GDN) as a downstream team shards it, for the fla-on-CPU
tests (imported lazily: importing fla costs seconds).

- `fla_precond_layer(seed)`: fla's own PrecondGatedDeltaNet (GVA 2, negative eigenvalues, the
  output gate), float64, seeded weights.
- `HeadShardedPrecondGDN` / `fla_precond_client(shard_atk_gate=...)`: that layer with its heads
  split over TP. Per key head: q / k projections, q / k convs and the whole ATK preconditioner
  (a_atk_proj, b_atk_proj, A_log_atk, dt_bias_atk, log_atk_scale: ATK preconditions the keys);
  per value head: v projection, v conv, a / b projections, A_log, dt_bias, g_proj; o_proj
  row-parallel; o_norm replicated (each TP rank's gradient is a partial sum, all-reduced after
  backward). fla's op takes GVA natively (value head j reads key head j // G), so a rank holding a
  block of key heads and the block of value heads that read them runs the op unchanged.
- No CP: fla's chunk_precond_gated_delta_rule refuses `cp_context` (the preconditioned path has
  no CP state plumbing), so the client refuses a CP placement when it is built.
- Both decay gates are computed in the input's dtype: fla's layer casts a_proj's and a_atk_proj's
  outputs and A_log / A_log_atk to float32 (`.float()`) before the softplus, so fla's own layer is
  the client only to ~1e-6. The reference, `replicated_precond`, is the same class on one rank;
  parameter names are fla's, so sharding only slices.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from einops import rearrange
from fla.layers.precond_gated_deltanet import PrecondGatedDeltaNet
from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule

from fla_clients import reduce_replicated_grads, seed_gated_weights, shard_by_head, shard_by_table, unshard_by_table
from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn import ShardedLayer

SIZES = dict(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4, expand_v=0.75, conv_size=4,
             allow_neg_eigval=True, norm_eps=1e-5)  # GVA 2, value heads of 6

# the TP split of each parameter: dim 0 or 1 by head (key or value heads alike), None replicated
SPLIT = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "a_proj.weight": 0, "b_proj.weight": 0,
         "a_atk_proj.weight": 0, "b_atk_proj.weight": 0, "log_atk_scale": 0, "A_log": 0, "dt_bias": 0,
         "A_log_atk": 0, "dt_bias_atk": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0, "v_conv1d.weight": 0,
         "g_proj.weight": 0, "o_proj.weight": 1, "o_norm.weight": None}
REPLICATED = {name for name, dim in SPLIT.items() if dim is None}
CP_REFUSAL = ("fla's chunk_precond_gated_delta_rule refuses cp_context (the preconditioned path has no CP "
              "state plumbing)")


def fla_precond_layer(seed: int):
    """fla's PrecondGatedDeltaNet in float64, its weights fresh from `seed` (decays exp(-A softplus)
    ~ 0.3-1 per token for both recurrences, log_atk_scale near fla's -0.2, conv and projection
    weights near their usual scale)."""
    layer = PrecondGatedDeltaNet(**SIZES).double()
    return seed_gated_weights(layer, seed, decays=("A_log", "A_log_atk"), steps=("dt_bias", "dt_bias_atk"),
                              special={"log_atk_scale": _near_fla_atk_scale})


def _near_fla_atk_scale(x):
    return -0.2 + 0.3 * x


def replicated_precond(fla_layer):
    """The client's layer on one rank with fla_layer's weights: the harness's reference."""
    from pytest_linattn import Placement

    layer = HeadShardedPrecondGDN(Placement(), (None, None)).double()
    layer.load_state_dict(fla_layer.state_dict())
    return layer


class HeadShardedPrecondGDN(PrecondGatedDeltaNet):
    """fla's PrecondGatedDeltaNet holding num_heads / tp key heads and num_v_heads / tp value heads."""

    def __init__(self, placement, groups):
        if placement.cp > 1:
            raise ValueError(f"PrecondGatedDeltaNet client: CP {placement.cp} refused: {CP_REFUSAL}; "
                             "shard its heads (TP) only")
        tp = placement.tp
        super().__init__(**dict(SIZES, num_heads=SIZES["num_heads"] // tp, num_v_heads=SIZES["num_v_heads"] // tp))
        self.placement, (self.tp_group, _) = placement, groups

    def forward(self, x, cu_seqlens):
        # fla's layer's forward in training (chunk mode, no cache)
        x = copy_to_tensor_parallel_region(x, self.tp_group)  # dx summed over the TP ranks' heads
        cu = cu_seqlens.long()
        q, k, v = (conv(proj(x), cu_seqlens=cu)[0] for proj, conv in
                   ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d)))
        q, k = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        beta = self.b_proj(x).sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        # fla's layer takes a_proj(x).float() / a_atk_proj(x).float() and A_log(_atk).float() here;
        # both gates stay in x's dtype
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)
        beta_atk = self.b_atk_proj(x).sigmoid()
        g_atk = -self.A_log_atk.exp() * F.softplus(self.a_atk_proj(x) + self.dt_bias_atk)
        o, _, _ = chunk_precond_gated_delta_rule(q=q, k=k, v=v, g=g, g_atk=g_atk, beta=beta, beta_atk=beta_atk,
                                                 use_qk_l2norm_in_kernel=True, cu_seqlens=cu, x=self.squash_x,
                                                 eps=self.squash_eps, log_atk_scale=self.log_atk_scale)
        o = self.o_norm(o, rearrange(self.g_proj(x), "... (h d) -> ... h d", d=self.head_v_dim))
        return reduce_from_tensor_parallel_region(self.o_proj(rearrange(o, "b t h d -> b t (h d)")), self.tp_group)


def build_precond(placement, groups, dtype, device):
    return HeadShardedPrecondGDN(placement, groups).to(device, dtype)


def fla_precond_client(shard_atk_gate=shard_by_head):
    """The client; `shard_atk_gate(t, tp, tp_rank)` gives a TP rank its a_atk_proj rows (the ATK
    preconditioner's decay gate, one row per key head)."""
    return ShardedLayer(build_precond,
                        functools.partial(shard_by_table, split=SPLIT, sharders={"a_atk_proj.weight": shard_atk_gate}),
                        functools.partial(unshard_by_table, split=SPLIT), replicated=REPLICATED,
                        after_backward=functools.partial(reduce_replicated_grads, names=REPLICATED))
