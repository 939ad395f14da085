"""fla's GatedDeltaNet2 (GDN-2) as a downstream team shards it, for the fla-on-CPU tests (imported
lazily: importing fla costs seconds).

- `fla_gdn2_layer(seed)`: fla's own GatedDeltaNet2 (GVA 2, negative eigenvalues, the output gate),
  float64, seeded weights.
- `HeadShardedGDN2` / `fla_gdn2_client(shard_write_gate=...)`: that layer with its heads split over
  TP and its tokens over CP through fla's `build_cp_context` and `cp_context=`. Per key head:
  q / k / b projections, q / k convs, the decay's up-projection f_proj.1, A_log, dt_bias; per value
  head: v / w projections, the v conv, the output gate's up-projection g_proj.1 (weight and bias);
  o_proj row-parallel. Replicated: the two low-rank down-projections f_proj.0 and g_proj.0 (every
  head reads them: each TP rank's gradient is a partial sum, all-reduced after backward) and o_norm.
  Its decay gate is computed in the input's dtype: fla's layer casts f_proj's output and A_log to
  float32 (`.float()`) before the softplus, so fla's own layer is the client only to ~1e-6.
  The reference, `replicated_gdn2`, is the same class on one rank; parameter names are fla's, so
  sharding only slices.
- `fla_gdn2_state_path()`: the client carrying its conv caches and recurrent state from call to
  call (`forward(x, cu_seqlens, state, output_final_state)`, as fla's layer with a cache), sharded
  by head, for `assert_continuation_parity`; TP only (fla takes no state under CP).
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from einops import rearrange
from fla.layers.gdn2 import GatedDeltaNet2
from fla.ops.gdn2 import chunk_gdn2

from clients.fla_layers import (ConvRecurrentState, client_state_path, cp_context, reduce_replicated_grads,
                         conv_caches, refuse_state_under_cp, seed_gated_weights, shard_by_head, shard_by_table,
                         short_convs, unshard_by_table)
from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn import ShardedLayer

SIZES = dict(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4, expand_v=0.75, conv_size=4,
             allow_neg_eigval=True, norm_eps=1e-5)  # GVA 2, value heads of 6

# the TP split of each parameter: dim 0 or 1 by head (key or value heads alike: a rank holds its key
# heads and the value heads that read them), None replicated
SPLIT = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0,
         "v_conv1d.weight": 0, "f_proj.1.weight": 0, "b_proj.weight": 0, "w_proj.weight": 0, "A_log": 0,
         "dt_bias": 0, "g_proj.1.weight": 0, "g_proj.1.bias": 0, "o_proj.weight": 1,
         "f_proj.0.weight": None, "g_proj.0.weight": None, "o_norm.weight": None}
REPLICATED = {name for name, dim in SPLIT.items() if dim is None}


def fla_gdn2_layer(seed: int, sizes=SIZES):
    """fla's GatedDeltaNet2 in float64, its weights fresh from `seed` (decays exp(-A softplus) ~
    0.3-1 per token, conv and projection weights near their usual scale)."""
    layer = GatedDeltaNet2(**sizes).double()
    return seed_gated_weights(layer, seed)


def replicated_gdn2(fla_layer, sizes=SIZES):
    """The client's layer on one rank with fla_layer's weights: the harness's reference."""
    from pytest_linattn import Placement

    layer = HeadShardedGDN2(Placement(), (None, None), sizes=sizes).double()
    layer.load_state_dict(fla_layer.state_dict())
    return layer


class HeadShardedGDN2(GatedDeltaNet2):
    """fla's GatedDeltaNet2 holding num_heads / tp key heads and num_v_heads / tp value heads."""

    def __init__(self, placement, groups, op_gets_cp_context=True, sizes=SIZES):
        tp = placement.tp
        super().__init__(**dict(sizes, num_heads=sizes["num_heads"] // tp, num_v_heads=sizes["num_v_heads"] // tp))
        self.placement, (self.tp_group, self.cp_group) = placement, groups
        self.op_gets_cp_context = op_gets_cp_context

    def forward(self, x, cu_seqlens, state=None, output_final_state=False):
        # fla's layer's forward in training, with CP on its convs and on the op; with a state
        # (ConvRecurrentState, TP only) as fla's layer runs with a cache
        refuse_state_under_cp(self, state, output_final_state)
        x = copy_to_tensor_parallel_region(x, self.tp_group)  # dx summed over the TP ranks' heads
        seq = cp_context(cu_seqlens, self.placement, self.cp_group, self.conv_size)
        (q, k, v), caches = short_convs(self, x, seq, conv_caches(state, output_final_state))
        # fla's layer takes f_proj(x).float() and A_log.float() here; the gate stays in x's dtype
        g = F.softplus(self.f_proj(x) + self.dt_bias)
        b, w = self.b_proj(x).sigmoid(), self.w_proj(x).sigmoid()
        q, k, g, b = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k, g, b))
        v, w = (rearrange(t, "... (h d) -> ... h d", d=self.head_v_dim) for t in (v, w))
        g = -self.A_log.exp().unsqueeze(-1) * g
        if self.num_v_heads > self.num_heads:  # value head j reads key head j // G, as fla's repeat "(h g)"
            q, k, g, b = (t.repeat_interleave(self.num_v_heads // self.num_heads, dim=-2) for t in (q, k, g, b))
        if self.allow_neg_eigval:
            b = b * 2.0
        op_seq = seq
        if "cp_context" in seq and not self.op_gets_cp_context:  # this rank's piece alone: no state comes in
            op_seq = dict(cu_seqlens=seq["cp_context"].cu_seqlens)
        o, final = chunk_gdn2(q=q, k=k, v=v, g=g, b=b, w=w, use_qk_l2norm_in_kernel=True,
                              initial_state=None if state is None else state.recurrent,
                              output_final_state=output_final_state, **op_seq)
        o = self.o_norm(o, rearrange(self.g_proj(x), "... (h d) -> ... h d", d=self.head_v_dim))
        y = reduce_from_tensor_parallel_region(self.o_proj(rearrange(o, "b t h d -> b t (h d)")), self.tp_group)
        return (y, ConvRecurrentState(*caches, final)) if output_final_state else y


def build_gdn2(placement, groups, dtype, device, op_gets_cp_context=True, sizes=SIZES):
    return HeadShardedGDN2(placement, groups, op_gets_cp_context, sizes).to(device, dtype)


def fla_gdn2_client(shard_write_gate=shard_by_head, op_gets_cp_context=True, sizes=SIZES):
    """The client; `shard_write_gate(t, tp, tp_rank)` gives a TP rank its w_proj rows;
    `op_gets_cp_context=False` gives the op this rank's cu_seqlens instead (a layer whose recurrence
    never hears of CP); `sizes` fla's layer arguments (default SIZES)."""
    return ShardedLayer(functools.partial(build_gdn2, op_gets_cp_context=op_gets_cp_context, sizes=sizes),
                        functools.partial(shard_by_table, split=SPLIT, sharders={"w_proj.weight": shard_write_gate}),
                        functools.partial(unshard_by_table, split=SPLIT), replicated=REPLICATED,
                        after_backward=functools.partial(reduce_replicated_grads, names=REPLICATED))


# the TP split of each state field (ConvRecurrentState): the heads' channels, the value heads' states
STATE_SPLIT = {"conv_q": 1, "conv_k": 1, "conv_v": 1, "recurrent": 1}


def fla_gdn2_state_path(sizes=SIZES):
    """The client carrying its state (conv caches, recurrent state) from call to call, sharded by head."""
    return client_state_path(fla_gdn2_client(sizes=sizes), STATE_SPLIT)
