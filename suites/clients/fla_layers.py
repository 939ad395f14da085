"""fla-based layers as downstream teams write them, for the fla-on-CPU tests (imported lazily:
importing fla costs seconds, so only the tests that use it pay).

- `fla_layer(kind, **options)`: fla's own GatedDeltaNet / KimiDeltaAttention, float64, its
  weights from the project's seeded `random_state_dict` through the fla name map.
- `HeadShardedGDN` / `fla_gdn_client()`: a team's tensor- and context-parallel gated delta net on
  fla's public ops, described to the harness (docs/getting-started.md's example is this client, at other sizes): its
  heads split over TP (q/k/v/a/b/g column-parallel, the per-channel short convs, A_log and
  dt_bias by head, o_norm replicated, o_proj row-parallel), its tokens over CP through fla's
  `build_cp_context(..., layout=placement.fla_layout)` and `cp_context=`. The reference is fla's
  own replicated GatedDeltaNet; parameter names are fla's, so `shard` only slices.
- `ContextParallelKDA` / `fla_kda_client(**options)`: fla's KimiDeltaAttention driven the way
  fla's context parallelism is called (`build_cp_context`, `cp_context=` on the conv and on
  chunk_kda), CP only.
- `fla_state_path(kind, differentiable=...)`: fla's own layer with fla's Cache (conv caches and
  recurrent state in, out), prefill chunks and decode steps as a serving loop calls them, for
  `assert_continuation_parity`; `fla_cached_forward` is the replicated reference's full forward.
- What the family clients (clients.delta_product, clients.gdn2, clients.rwkv7, clients.precond)
  share: table-driven TP shard / unshard of weights and states (`shard_by_table`,
  `shard_state_by_table`, ...), `short_convs` (with conv caches), `client_state_path` (the client's
  forward from a state, its state sharded by head; refused under CP: `refuse_state_under_cp`), and
  `training_setup` (the replicated weights' reduction once per training step, `finalize_grads`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from einops import rearrange
from fla.layers import GatedDeltaNet, KimiDeltaAttention
from fla.modules.convolution import causal_conv1d
from fla.ops.cp import build_cp_context
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.kda import chunk_kda

from cases.layer_parity import random_state_dict
from linattn.layers import config_from_fla_layer, to_fla_state_dict
from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn import ShardedLayer

SIZES = dict(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4, conv_size=4, norm_eps=1e-5)  # GVA 2
GDN_SIZES = dict(SIZES, expand_v=0.75)  # value heads of 6


def fla_layer(kind: str, *, seed: int, **options):
    """(fla layer in float64 with seeded weights, the project's config, the project's state dict)."""
    layer = GatedDeltaNet(**GDN_SIZES, **options) if kind == "gdn" else KimiDeltaAttention(**SIZES, **options)
    layer = layer.double()
    config = config_from_fla_layer(layer)
    state_dict = random_state_dict(config, seed)
    layer.load_state_dict(to_fla_state_dict(state_dict, config))
    return layer, config, state_dict


def fla_forward(layer, x, cu_seqlens):
    """How the harness calls fla's own (replicated) layers: `reference_forward=fla_forward`."""
    return layer(x, cu_seqlens=cu_seqlens.long())[0]


def seed_gated_weights(layer, seed, *, decays=("A_log",), steps=("dt_bias",), special=None):
    """An fla layer's weights fresh from `seed`, in place: decays exp(-A softplus) ~ 0.3-1 per token
    (A_log of A in [0.5, 2], dt_bias about -1), the output norm near 1, every other weight near its
    usual scale; `special` (name -> fn(standard normal draw)) sets a weight another way."""
    gen = torch.Generator().manual_seed(seed)
    special = special or {}
    with torch.no_grad():
        for name, p in layer.named_parameters():
            x = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name in decays:
                p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(0.5, 2.0, generator=gen).log())
            elif name in steps:
                p.copy_(x - 1.0)
            elif name in special:
                p.copy_(special[name](x))
            elif name == "o_norm.weight":
                p.copy_(1.0 + 0.2 * x)
            else:
                p.copy_(x / max(1, p.shape[-1]) ** 0.5)
    return layer


def short_convs(layer, x, seq, caches=None):
    """q, k, v: fla's layer's three projections through its short convs (`seq`: cp_context's
    words), and with `caches` (a tuple of three, None for an empty cache) the conv caches after the
    call (else None)."""
    pairs = ((layer.q_proj, layer.q_conv1d), (layer.k_proj, layer.k_conv1d), (layer.v_proj, layer.v_conv1d))
    if caches is None:
        return [conv(proj(x), **seq)[0] for proj, conv in pairs], None
    out = [conv(proj(x), cache=cache, output_final_state=True, **seq) for (proj, conv), cache in zip(pairs, caches)]
    return [y for y, _ in out], tuple(cache for _, cache in out)


def cp_context(cu_seqlens, placement, cp_group, conv_size, fla_layout=None):
    """The ops' sequence arguments: fla's CP context under CP, else the batch's cu_seqlens."""
    if cp_group is None:
        return dict(cu_seqlens=cu_seqlens.long())
    layout = fla_layout or placement.fla_layout  # "contiguous" or "zigzag" (Placement "fla-zigzag")
    return dict(cp_context=build_cp_context(cu_seqlens.long(), group=cp_group, conv1d_kernel_size=conv_size,
                                            layout=layout))


# ---- a head-sharded GDN on fla's ops, TP x CP ---------------------------------------------------

GDN_SPLIT = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "a_proj.weight": 0, "b_proj.weight": 0,
             "g_proj.weight": 0, "A_log": 0, "dt_bias": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0,
             "v_conv1d.weight": 0, "o_proj.weight": 1, "o_norm.weight": None}  # dim split over TP; None: replicated


class HeadShardedGDN(GatedDeltaNet):
    """fla's GatedDeltaNet holding num_heads / tp key heads and num_v_heads / tp value heads."""

    def __init__(self, placement, groups, fla_layout=None):
        tp = placement.tp
        super().__init__(**dict(GDN_SIZES, num_heads=GDN_SIZES["num_heads"] // tp,
                                num_v_heads=GDN_SIZES["num_v_heads"] // tp))
        self.placement, (self.tp_group, self.cp_group), self.fla_layout = placement, groups, fla_layout

    def forward(self, x, cu_seqlens):
        x = copy_to_tensor_parallel_region(x, self.tp_group)  # dx summed over the TP ranks' heads
        seq = cp_context(cu_seqlens, self.placement, self.cp_group, self.conv_size, self.fla_layout)
        q, k, v = (conv(proj(x), **seq)[0] for proj, conv in
                   ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d)))
        q, k = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        o, _ = chunk_gated_delta_rule(q, k, v, g=self.a_proj(x), beta=self.b_proj(x), A_log=self.A_log,
                                      dt_bias=self.dt_bias, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, **seq)
        o = self.o_norm(o, rearrange(self.g_proj(x), "... (h d) -> ... h d", d=self.head_v_dim))
        return reduce_from_tensor_parallel_region(self.o_proj(rearrange(o, "b t h d -> b t (h d)")), self.tp_group)


def build_gdn(placement, groups, dtype, device, fla_layout=None):
    return HeadShardedGDN(placement, groups, fla_layout).to(device, dtype)


def shard_by_head(t, tp, tp_rank, dim=0):
    """This TP rank's block of heads along dim."""
    return t.chunk(tp, dim)[tp_rank]


def shard_by_table(full, placement, tp_rank, split, sharders=None):
    """Every weight's TP shard by `split` (name -> the dim its heads lie along, None: replicated);
    `sharders` (name -> fn(t, tp, tp_rank)) shards a weight another way (a client's planted bug)."""
    sharders = sharders or {}
    return {n: t if split[n] is None else sharders.get(n, functools.partial(shard_by_head, dim=split[n]))(
        t, placement.tp, tp_rank) for n, t in full.items()}


def unshard_by_table(grads, placement, split):
    """The ranks' gradients put back together by `split` (a replicated weight's from rank 0)."""
    return {n: grads[0][n] if dim is None else torch.cat([g[n] for g in grads], dim) for n, dim in split.items()}


def reduce_replicated_grads(module, placement, names):
    """The trainer's finalize step: a weight in `names` is replicated over TP, each rank's gradient
    a partial sum over its heads."""
    if placement.tp > 1:
        for name, p in module.named_parameters():
            if name in names:
                dist.all_reduce(p.grad, group=module.tp_group)


def finalize_grads(module, placement, groups, names):
    """A trainer's finalize step for a family client, once a step's micro-batches are all done:
    every gradient summed over CP (each CP rank's a partial sum over its tokens), and the
    TP-replicated weights' in `names` over TP (each TP rank's a partial sum over its heads)."""
    tp_group, cp_group = groups
    for name, p in module.named_parameters():
        if p.grad is not None and cp_group is not None:
            dist.all_reduce(p.grad, group=cp_group)
        if p.grad is not None and tp_group is not None and name in names:
            dist.all_reduce(p.grad, group=tp_group)


def training_setup(client, **step):
    """(the client for the training-step check, its TrainingStep(**step)). The client's
    `after_backward` all-reduces its replicated weights' accumulated `.grad` after every backward:
    right for one backward (the parity check), wrong under gradient accumulation, where it
    reduces earlier micro-batches' part again at every micro-batch. A trainer reduces them once
    per step: here in `finalize_grads`, with the CP sum."""
    import dataclasses

    from pytest_linattn import TrainingStep

    return (dataclasses.replace(client, after_backward=None),
            TrainingStep(finalize_grads=functools.partial(finalize_grads, names=frozenset(client.replicated)), **step))


shard_gdn = functools.partial(shard_by_table, split=GDN_SPLIT)
unshard_gdn = functools.partial(unshard_by_table, split=GDN_SPLIT)
reduce_norm_grad = functools.partial(reduce_replicated_grads, names={"o_norm.weight"})


def fla_gdn_client(fla_layout=None):
    """The client; `fla_layout` fixes fla's layout whatever the placement (a layer with a wrong layout)."""
    return ShardedLayer(functools.partial(build_gdn, fla_layout=fla_layout), shard_gdn, unshard_gdn,
                        replicated={"o_norm.weight"}, after_backward=reduce_norm_grad)


# ---- fla's KDA layer through fla's CP API, CP only --------------------------------------------


class ContextParallelKDA(KimiDeltaAttention):
    """fla's KDA layer on this rank's piece of a packed batch, its short convs and its recurrence
    crossing rank boundaries through fla's CP context."""

    def __init__(self, placement, cp_group, **options):
        super().__init__(**SIZES, **options)
        self.placement, self.cp_group = placement, cp_group

    def forward(self, hidden_states, cu_seqlens):
        seq = cp_context(cu_seqlens, self.placement, self.cp_group, self.conv_size)
        q, k, v = (
            causal_conv1d(proj(hidden_states), weight=conv.weight.squeeze(1), activation="silu", **seq)[0]
            for proj, conv in ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        )
        q, k, g = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k, self.f_proj(hidden_states)))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        o, _ = chunk_kda(
            q=q, k=k, v=v, g=g, beta=self.b_proj(hidden_states), A_log=self.A_log, dt_bias=self.dt_bias,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            safe_gate=self.safe_gate, lower_bound=self.lower_bound, **seq,
        )
        o = self.o_norm(o, rearrange(self.g_proj(hidden_states), "... (h d) -> ... h d", d=self.head_v_dim))
        return self.o_proj(rearrange(o, "b t h d -> b t (h d)"))


def build_kda(placement, groups, dtype, device, options):
    return ContextParallelKDA(placement, groups[1], **options).to(device, dtype)


def whole(full, placement, tp_rank):
    return dict(full)


def first_tp_rank(grads, placement):
    return dict(grads[0])


def fla_kda_client(**options):
    return ShardedLayer(functools.partial(build_kda, options=options), whole, first_tp_rank)


# ---- fla's layers with fla's cache: the state path ----------------------------------------------


class FlaLayerState(NamedTuple):
    """What fla's GatedDeltaNet / KimiDeltaAttention keep in fla's Cache, one row per sequence:
    the three conv caches `[N, D, W]` and the recurrent state `[N, HV, V, K]` (state_v_first)."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor


def fla_cached_forward(layer, x, cu_seqlens, state):
    """fla's layer from `state` (None: an empty cache) with use_cache=True, as a serving loop calls
    it: `(y, FlaLayerState)`. cu_seqlens None: x `[N, T, hidden]`, one sequence per row."""
    from fla.models.utils import Cache

    cache = Cache()
    if state is not None:
        cache.update(recurrent_state=state.recurrent, conv_state=tuple(state[:3]), layer_idx=layer.layer_idx, offset=0)
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.long()}
    y, _, cache = layer(x, past_key_values=cache, use_cache=True, **extra)
    kept = cache[layer.layer_idx]
    return y, FlaLayerState(*kept["conv_state"], kept["recurrent_state"])


def fla_prefill(module, x, cu_seqlens, state, placement):
    return fla_cached_forward(module, x, cu_seqlens, state)


def fla_decode(module, x, state, placement):
    """One token of each of N sequences as fla's generation runs it: a batch `[N, 1, hidden]`."""
    y, state = fla_cached_forward(module, x.transpose(0, 1), None, state)
    return y.transpose(0, 1), state


def build_fla_cached(kind, options, placement, groups, dtype, device, sizes=None):
    sizes = sizes or (GDN_SIZES if kind == "gdn" else SIZES)
    layer = GatedDeltaNet(**sizes, **options) if kind == "gdn" else KimiDeltaAttention(**sizes, **options)
    layer.layer_idx = 0
    return layer.to(device, dtype).eval()


def same_weights(full, placement, tp_rank):
    return dict(full)


def first_rank_grads(grads, placement):
    return grads[0]


def fla_state_path(kind, *, differentiable=True, sizes=None, **options):
    """fla's own layer (replicated) with fla's cache, as the harness's StatePath. differentiable:
    under grad fla's layers always run the chunk kernels; without (an inference loop, eval mode)
    they run fused_recurrent for calls of at most 64 tokens and the conv's decode step. sizes:
    the layer's constructor sizes (default SIZES, GDN_SIZES for "gdn")."""
    from pytest_linattn import StatePath

    layer = ShardedLayer(functools.partial(build_fla_cached, kind, options, sizes=sizes), same_weights,
                         first_rank_grads)
    return StatePath(layer, prefill=fla_prefill, decode=fla_decode, differentiable=differentiable)


# ---- the family clients' state path: the client's own forward, its state sharded by head ---------

STATE_UNDER_CP = ("fla 0.6.0 takes no state in or out under CP (its causal_conv1d asserts 'Initial state is not "
                  "supported for CP', and its chunk ops refuse initial_state / output_final_state with cp_context)")


class ConvRecurrentState(NamedTuple):
    """A client's state, one row per sequence: the q / k / v conv caches `[N, D, W]` and the
    recurrent state `[N, HV, K, V]` as fla's chunk ops return it."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor


def conv_caches(state, output_final_state):
    """short_convs' `caches` for a stateful call: the state's three conv caches (empty ones without
    a state); None for a call without state in or out."""
    if state is None and not output_final_state:
        return None
    return (None,) * 3 if state is None else tuple(state[:3])


def refuse_state_under_cp(layer, state, output_final_state):
    """ValueError for a state in or out on a CP placement (fla has none there)."""
    if layer.cp_group is not None and (state is not None or output_final_state):
        raise ValueError(f"{type(layer).__name__}: state / output_final_state at CP {layer.placement.cp} refused: "
                         f"{STATE_UNDER_CP}; carry state at TP only")


def shard_state_by_table(state, placement, tp_rank, split, sharders=None):
    """A state's TP shard by `split` (field -> the dim its heads lie along, None: replicated);
    `sharders` (field -> fn(t, tp, tp_rank)) shards a field another way."""
    sharders = sharders or {}
    return type(state)(*(t if split[f] is None else sharders.get(f, functools.partial(shard_by_head, dim=split[f]))(
        t, placement.tp, tp_rank) for f, t in zip(state._fields, state)))


def unshard_state_by_table(states, placement, split, unsharders=None):
    """The TP ranks' states (or state gradients) put back together by `split` (a replicated
    field's from rank 0); `unsharders` (field -> fn(pieces)) for fields sharded another way."""
    unsharders = unsharders or {}
    fields = states[0]._fields
    out = []
    for i, f in enumerate(fields):
        pieces = [s[i] for s in states]
        out.append(pieces[0] if split[f] is None else
                   unsharders[f](pieces) if f in unsharders else torch.cat(pieces, split[f]))
    return type(states[0])(*out)


def stateful_call(module, x, cu_seqlens, state, placement):
    """A prefill call of a family client: its forward from `state`, returning `(y, state)`."""
    return module(x, cu_seqlens, state, output_final_state=True)


def packed_decode(module, x, state, placement, prefill=stateful_call):
    """One decode step through the client's prefill call: N one-token sequences packed `[1, N, hidden]`."""
    return prefill(module, x, torch.arange(x.shape[1] + 1, device=x.device), state, placement)


def client_state_path(client, split, sharders=None, unsharders=None, prefill=stateful_call):
    """The harness's StatePath of a family client whose forward takes `(x, cu_seqlens, state,
    output_final_state)`: prefill chunks and packed decode steps through `prefill` (default that
    forward: fla's chunk ops and its conv with a cache, differentiable), the state sharded over TP
    by `split`."""
    from pytest_linattn import StatePath

    return StatePath(client, prefill=prefill, decode=functools.partial(packed_decode, prefill=prefill),
                     shard_state=functools.partial(shard_state_by_table, split=split, sharders=sharders),
                     unshard_state=functools.partial(unshard_state_by_table, split=split, unsharders=unsharders))
