"""fla's GatedDeltaProduct as a downstream team shards it, for the fla-on-CPU tests (imported
lazily: importing fla costs seconds).

- `fla_delta_product_layer(seed)`: fla's own GatedDeltaProduct (2 steps per token, GVA 2, the
  forget gate, negative eigenvalues, the output gate), float64, seeded weights.
- `HeadShardedDeltaProduct` / `fla_delta_product_client(shard_keys=...)`: that layer with its heads
  split over TP and its tokens over CP through fla's `build_cp_context` and `cp_context=`. The
  k / v / b projections and the k / v convs hold every step of every head, step-major
  (`(step, head, dim)` rows: fla's rearrange `(n h d) -> (t n) h d`), so a TP rank's rows are
  its heads' rows within every step (`shard_steps`); q / a / g, A_log and dt_bias split by head;
  o_proj row-parallel; o_norm replicated. Its decay gate is computed in the input's dtype (fla's
  layer casts A_log to float32). The reference, `replicated_delta_product`, is the same class on
  one rank; parameter names are fla's, so sharding only slices.
- `fla_delta_product_state_path()`: the client carrying its conv caches and recurrent state from
  call to call, sharded by head (the k / v caches' channels step-major, as their conv weights), for
  `assert_continuation_parity`; TP only (fla takes no state under CP).
"""

from __future__ import annotations

import functools

import torch
from einops import rearrange
from fla.layers import GatedDeltaProduct
from fla.ops.gated_delta_product import chunk_gated_delta_product

from clients.fla_layers import (ConvRecurrentState, client_state_path, conv_caches, cp_context, reduce_norm_grad,
                         refuse_state_under_cp, seed_gated_weights, short_convs)
from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn import ShardedLayer

NUM_STEPS = 2  # num_householder
SIZES = dict(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4, expand_v=0.75, conv_size=4,
             num_householder=NUM_STEPS, norm_eps=1e-5)  # GVA 2, value heads of 6

# how each parameter splits over TP: ("head", dim) by head, ("steps", heads per step) by head within
# every step, None replicated
SPLIT = {"q_proj.weight": ("head", 0), "a_proj.weight": ("head", 0), "g_proj.weight": ("head", 0),
         "A_log": ("head", 0), "dt_bias": ("head", 0), "q_conv1d.weight": ("head", 0), "o_proj.weight": ("head", 1),
         "k_proj.weight": ("steps", "num_heads"), "k_conv1d.weight": ("steps", "num_heads"),
         "v_proj.weight": ("steps", "num_v_heads"), "v_conv1d.weight": ("steps", "num_v_heads"),
         "b_proj.weight": ("steps", "num_v_heads"), "o_norm.weight": None}


def fla_delta_product_layer(seed: int, sizes=SIZES):
    """fla's GatedDeltaProduct in float64, its weights fresh from `seed` (decays exp(-A softplus)
    ~ 0.3-1 per token, conv and projection weights near their usual scale)."""
    layer = GatedDeltaProduct(**sizes).double()
    return seed_gated_weights(layer, seed)


def replicated_delta_product(fla_layer, sizes=SIZES):
    """The client's layer on one rank with fla_layer's weights: the harness's reference (fla's own
    layer is that within its float32 gate cast, checked beside it)."""
    from pytest_linattn import Placement

    layer = HeadShardedDeltaProduct(Placement(), (None, None), sizes=sizes).double()
    layer.load_state_dict(fla_layer.state_dict())
    return layer


class HeadShardedDeltaProduct(GatedDeltaProduct):
    """fla's GatedDeltaProduct holding num_heads / tp key heads and num_v_heads / tp value heads."""

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
        n = self.num_householder
        q = rearrange(q, "... (h d) -> ... h d", d=self.head_k_dim)
        k = rearrange(k, "... t (n h d) -> ... (t n) h d", n=n, d=self.head_k_dim)
        v = rearrange(v, "... t (n h d) -> ... (t n) h d", n=n, d=self.head_v_dim)
        if self.num_v_heads > self.num_heads:
            q, k = (t.repeat_interleave(self.num_v_heads // self.num_heads, dim=-2) for t in (q, k))
        beta = rearrange(self.b_proj(x).sigmoid() * 2.0, "... t (n h) -> ... (t n) h", n=n)  # allow_neg_eigval
        # fla's layer takes A_log.float() here: under CP each rank's partial A_log gradient would be
        # rounded to float32 on its own (measured 4e-8 against one rounding); the gate stays in x's dtype
        g = -self.A_log.exp() * torch.nn.functional.softplus(self.a_proj(x) + self.dt_bias)
        op_seq = seq
        if "cp_context" in seq and not self.op_gets_cp_context:  # this rank's piece alone: no state comes in
            op_seq = dict(cu_seqlens=seq["cp_context"].cu_seqlens)
        o, final = chunk_gated_delta_product(q=q, k=k, v=v, g=g, beta=beta, num_householder=n,
                                             use_qk_l2norm_in_kernel=True,
                                             initial_state=None if state is None else state.recurrent,
                                             output_final_state=output_final_state, **op_seq)
        o = self.o_norm(o, rearrange(self.g_proj(x), "... (h d) -> ... h d", d=self.head_v_dim))
        y = reduce_from_tensor_parallel_region(self.o_proj(rearrange(o, "b t h d -> b t (h d)")), self.tp_group)
        return (y, ConvRecurrentState(*caches, final)) if output_final_state else y


def build_delta_product(placement, groups, dtype, device, op_gets_cp_context=True, sizes=SIZES):
    return HeadShardedDeltaProduct(placement, groups, op_gets_cp_context, sizes).to(device, dtype)


def shard_steps(t, heads, tp, tp_rank):
    """Rows `(step, head, ...)` of t -> this TP rank's heads within every step."""
    per_step = t.unflatten(0, (NUM_STEPS, heads, -1))
    return per_step.chunk(tp, dim=1)[tp_rank].flatten(0, 2)


def unshard_steps(pieces, heads):
    return torch.cat([p.unflatten(0, (NUM_STEPS, heads // len(pieces), -1)) for p in pieces], dim=1).flatten(0, 2)


def shard(full, placement, tp_rank, shard_keys=shard_steps, sizes=SIZES):
    out = {}
    for name, t in full.items():
        rule = SPLIT[name]
        if rule is None:
            out[name] = t
        elif rule[0] == "head":
            out[name] = t.chunk(placement.tp, rule[1])[tp_rank]
        else:
            split = shard_keys if name.startswith("k_") else shard_steps
            out[name] = split(t, sizes[rule[1]], placement.tp, tp_rank)
    return out


def unshard(grads, placement, sizes=SIZES):
    out = {}
    for name, rule in SPLIT.items():
        if rule is None:
            out[name] = grads[0][name]
        elif rule[0] == "head":
            out[name] = torch.cat([g[name] for g in grads], rule[1])
        else:
            out[name] = unshard_steps([g[name] for g in grads], sizes[rule[1]])
    return out


def fla_delta_product_client(shard_keys=shard_steps, op_gets_cp_context=True, sizes=SIZES):
    """The client; `shard_keys(t, heads, tp, tp_rank)` gives a TP rank its k_proj / k_conv1d rows;
    `op_gets_cp_context=False` gives the op this rank's cu_seqlens instead (a layer whose recurrence
    never hears of CP); `sizes` fla's layer arguments (default SIZES)."""
    return ShardedLayer(functools.partial(build_delta_product, op_gets_cp_context=op_gets_cp_context, sizes=sizes),
                        functools.partial(shard, shard_keys=shard_keys, sizes=sizes),
                        functools.partial(unshard, sizes=sizes),
                        replicated={"o_norm.weight"}, after_backward=reduce_norm_grad)


def _shard_cache_steps(t, tp, tp_rank, heads):
    """A conv cache `[N, D, W]` whose channels are step-major `(step, head, dim)`: this TP rank's
    heads within every step."""
    return shard_steps(t.transpose(0, 1), heads, tp, tp_rank).transpose(0, 1)


def _unshard_cache_steps(pieces, heads):
    return unshard_steps([p.transpose(0, 1) for p in pieces], heads).transpose(0, 1)


def fla_delta_product_state_path(sizes=SIZES):
    """The client carrying its state (conv caches, recurrent state) from call to call, sharded by
    head: the k / v caches' channels step-major as the k / v conv weights."""
    split = {"conv_q": 1, "conv_k": 1, "conv_v": 1, "recurrent": 1}
    heads = {"conv_k": sizes["num_heads"], "conv_v": sizes["num_v_heads"]}
    return client_state_path(fla_delta_product_client(sizes=sizes), split,
                             sharders={f: functools.partial(_shard_cache_steps, heads=h) for f, h in heads.items()},
                             unsharders={f: functools.partial(_unshard_cache_steps, heads=h) for f, h in heads.items()})
