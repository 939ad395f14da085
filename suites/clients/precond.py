"""fla's preconditioned layers, PrecondGatedDeltaNet and PrecondKDA, as a downstream team shards
them, for the fla-on-CPU tests (imported lazily: importing fla costs seconds).

- `fla_precond_layer(seed)` / `fla_precond_kda_layer(seed)`: fla's own layer (GVA 2, negative
  eigenvalues, the output gate), float64, seeded weights.
- `HeadShardedPrecondGDN` / `fla_precond_client(shard_atk_gate=...)`: PrecondGatedDeltaNet with its
  heads split over TP. Per key head: q / k projections, q / k convs and the whole ATK
  preconditioner (a_atk_proj, b_atk_proj, A_log_atk, dt_bias_atk, log_atk_scale: ATK preconditions
  the keys); per value head: v projection, v conv, a / b projections, A_log, dt_bias, g_proj.
  fla's op takes GVA natively (value head j reads key head j // G), so a rank holding a block of
  key heads and the value heads that read them runs the op unchanged.
- `HeadShardedPrecondKDA` / `fla_precond_kda_client(shard_decay=...)`: PrecondKDA likewise. Its
  layer repeats q, k and beta to the value heads before the op, so everything after the
  projections is per value head, the ATK preconditioner included: per key head only the q / k
  projections and convs and b_proj; per value head v, a (the ATK gate), b_atk, the KDA decay's
  up-projection f_proj.1, A_log, dt_bias (per key channel), A_log_atk, dt_bias_atk,
  log_atk_scale, the output gate's up-projection g_proj.1. Replicated: the two low-rank
  down-projections f_proj.0 and g_proj.0 (every head reads them) and o_norm.
- Both: o_proj row-parallel; each replicated weight's TP gradient a partial sum, all-reduced after
  backward. The convs run CP through fla's `build_cp_context` and `cp_context=`.
- The recurrence under CP: fla 0.6.0's chunk_precond_gated_delta_rule and chunk_precond_kda refuse
  `cp_context` (no CP state plumbing for the preconditioned path), but take an initial state and
  an initial ATK state and return both final states with their gradients. So the client passes
  them itself (`precond_recurrence`): this rank's tokens moved to its contiguous piece of the
  batch (fla's zigzag: an all-to-all), the two states of a sequence crossing into the piece
  received from the previous rank as one message, the op run from them, those of a sequence
  crossing out sent to the next, and backward sends their gradients back the same way
  (linattn.parallel.cp's collectives). `passes_preconditioner=False` starts the ATK state from
  zero on every rank (a plant).
- Gates: both decay gates of PrecondGatedDeltaNet and PrecondKDA's ATK gate are computed in the
  input's dtype, at least float32 (fla's layers cast a_proj's / a_atk_proj's outputs and A_log /
  A_log_atk to float32 first), so fla's own layers are the clients only to ~1e-6 in float64.
  PrecondKDA's decay is fla's fused_kda_gate, as in fla's layer. The references,
  `replicated_precond` / `replicated_precond_kda`, are the same classes on one rank; parameter
  names are fla's, so sharding only slices.
- State (`fla_precond_state_path`, `fla_precond_kda_state_path`): the conv caches, the recurrent
  state and the ATK state from call to call (fla's cache carries the same), at TP; fla has no
  conv cache under CP.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from fla.layers.precond_gated_deltanet import PrecondGatedDeltaNet
from fla.layers.precond_kda import PrecondKDA
from fla.ops.kda.gate import fused_kda_gate
from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule
from fla.ops.precond_kda import chunk_precond_kda

from clients.fla_layers import (client_state_path, conv_caches, cp_context, reduce_replicated_grads, refuse_state_under_cp,
                         seed_gated_weights, shard_by_head, shard_by_table, short_convs, unshard_by_table)
from linattn.parallel import cp as linattn_cp
from linattn.parallel.cp.comm import global_rank, grad_anchor, receive_state_from_previous_rank, send_state_to_next_rank
from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn import ShardedLayer

SIZES = dict(hidden_size=20, head_dim=8, num_heads=2, num_v_heads=4, expand_v=0.75, conv_size=4,
             allow_neg_eigval=True, norm_eps=1e-5)  # GVA 2, value heads of 6
KDA_SIZES = SIZES  # the same arguments: PrecondKDA's low-rank f_proj / g_proj are head_v_dim wide

# the TP split of each parameter: dim 0 or 1 by head (key or value heads alike), None replicated
SPLIT = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "a_proj.weight": 0, "b_proj.weight": 0,
         "a_atk_proj.weight": 0, "b_atk_proj.weight": 0, "log_atk_scale": 0, "A_log": 0, "dt_bias": 0,
         "A_log_atk": 0, "dt_bias_atk": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0, "v_conv1d.weight": 0,
         "g_proj.weight": 0, "o_proj.weight": 1, "o_norm.weight": None}
KDA_SPLIT = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "a_proj.weight": 0, "f_proj.0.weight": None,
             "f_proj.1.weight": 0, "b_atk_proj.weight": 0, "b_proj.weight": 0, "A_log_atk": 0, "dt_bias_atk": 0,
             "A_log": 0, "dt_bias": 0, "log_atk_scale": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0,
             "v_conv1d.weight": 0, "g_proj.0.weight": None, "g_proj.1.weight": 0, "g_proj.1.bias": 0,
             "o_norm.weight": None, "o_proj.weight": 1}
REPLICATED = {name for name, dim in SPLIT.items() if dim is None}
KDA_REPLICATED = {name for name, dim in KDA_SPLIT.items() if dim is None}
FLA_CP_REFUSAL = ("fla 0.6.0's chunk_precond_gated_delta_rule and chunk_precond_kda refuse cp_context (the "
                  "preconditioned path has no CP state plumbing)")


class PrecondState(NamedTuple):
    """A preconditioned client's state, one row per sequence: the q / k / v conv caches `[N, D, W]`,
    the recurrent state `[N, HV, K, V]` and the ATK state `[N, H, K]` (PrecondKDA: `[N, HV, K]`)."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor
    preconditioner: torch.Tensor


def fla_precond_layer(seed: int, sizes=SIZES):
    """fla's PrecondGatedDeltaNet in float64, its weights fresh from `seed` (decays exp(-A softplus)
    ~ 0.3-1 per token for both recurrences, log_atk_scale near fla's -0.2, conv and projection
    weights near their usual scale)."""
    return _seeded(PrecondGatedDeltaNet(**sizes).double(), seed)


def fla_precond_kda_layer(seed: int, sizes=KDA_SIZES):
    """fla's PrecondKDA in float64, its weights fresh from `seed` (as fla_precond_layer's)."""
    return _seeded(PrecondKDA(**sizes).double(), seed)


def _seeded(layer, seed):
    return seed_gated_weights(layer, seed, decays=("A_log", "A_log_atk"), steps=("dt_bias", "dt_bias_atk"),
                              special={"log_atk_scale": _near_fla_atk_scale})


def _near_fla_atk_scale(x):
    return -0.2 + 0.3 * x


def replicated_precond(fla_layer, sizes=SIZES):
    """The client's layer on one rank with fla_layer's weights: the harness's reference."""
    return _replicated(HeadShardedPrecondGDN, fla_layer, sizes)


def replicated_precond_kda(fla_layer, sizes=KDA_SIZES):
    """The PrecondKDA client's layer on one rank with fla_layer's weights: the harness's reference."""
    return _replicated(HeadShardedPrecondKDA, fla_layer, sizes)


def _replicated(cls, fla_layer, sizes):
    from pytest_linattn import Placement

    layer = cls(Placement(), (None, None), sizes=sizes).double()
    layer.load_state_dict(fla_layer.state_dict())
    return layer


def gate_dtype(x):
    """The decay gates' dtype: the input's, at least float32 (fla's layers compute them in float32)."""
    return torch.promote_types(x.dtype, torch.float32)


def _op_context(cu_seqlens, placement, cp_group):
    """linattn's CP context of this rank's piece of the batch, in the placement's layout (fla's
    zigzag: rank r holds intervals r and 2cp-1-r of the batch cut in 2cp, fla's build_cp_context)."""
    cu = cu_seqlens.detach().cpu().long()
    if placement.cp_layout == "contiguous":
        return linattn_cp.build_context(cu, cp_group)
    if placement.cp_layout != "fla-zigzag":
        raise ValueError(f"placement.cp_layout: the precond clients run fla's layouts, 'contiguous' or 'fla-zigzag', "
                         f"got {placement.cp_layout!r}")
    return linattn_cp.build_context(cu, cp_group, "fla-zigzag",
                                    tokens_of_rank=functools.partial(_fla_zigzag_tokens, int(cu[-1]), placement.cp))


def _fla_zigzag_tokens(total, cp, rank):
    part = total // (2 * cp)
    return torch.cat([torch.arange(rank * part, (rank + 1) * part),
                      torch.arange((2 * cp - 1 - rank) * part, (2 * cp - rank) * part)])


def precond_recurrence(op, per_token, options, *, cu_seqlens, placement, cp_group, initial=None,
                       output_final_state=False, passes_preconditioner=True):
    """(o, final recurrent state, final ATK state) of `op` (fla's chunk_precond_gated_delta_rule or
    chunk_precond_kda) on this rank's tokens. per_token: the op's per-token arguments by name
    (`[1, T_local, ...]`, q, k, v first); options: the others. Without CP: the op on the batch from
    `initial` (recurrent, ATK) or zero. Under CP: the module docstring's state passing (no state in
    or out: fla's conv has none there); the final states are None."""
    if cp_group is None:
        h0, a0 = initial or (None, None)
        return op(**per_token, **options, initial_state=h0, initial_A_state=a0, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens.long())
    if initial is not None or output_final_state:
        raise ValueError("initial / output_final_state: no state in or out under CP (fla's conv takes none there), "
                         f"got CP {placement.cp}")
    ctx = _op_context(cu_seqlens, placement, cp_group)
    local = dict(zip(per_token, ctx.relayout.to_contiguous(*per_token.values())))
    q, k, v = local["q"], local["k"], local["v"]
    shapes = ((v.shape[2], k.shape[3], v.shape[3]), (k.shape[2], k.shape[3]))  # [HV, K, V], [H, K]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # fla's states: float32
    num_seqs = ctx.local_cu_seqlens.numel() - 1
    anchor = grad_anchor(q.device)
    h0 = a0 = None
    if ctx.first_seq_continues:  # both states of the sequence crossing in, one message
        upstream = [t for t in local.values() if t.requires_grad]
        message = receive_state_from_previous_rank((sum(sizes),), state_dtype, q.device, ctx.group,
                                                   global_rank(ctx.group, ctx.cp_rank - 1), anchor, *upstream)
        h0, a0 = (torch.cat([part.view(1, *shape), part.new_zeros(num_seqs - 1, *shape)])
                  for part, shape in zip(message.split(sizes), shapes))
        if not passes_preconditioner:
            a0 = None
    o, S, A = op(**local, **options, initial_state=h0, initial_A_state=a0, output_final_state=ctx.last_seq_continues,
                 cu_seqlens=ctx.local_cu_seqlens_on(q.device, torch.long))
    if ctx.last_seq_continues:
        message = torch.cat([S[-1].flatten(), A[-1].flatten()]).to(state_dtype)
        o = send_state_to_next_rank(message, o, anchor, ctx.group, global_rank(ctx.group, ctx.cp_rank + 1))
    return ctx.relayout.from_contiguous(o), None, None


class _HeadSharded:
    """What both clients share: the TP / CP bookkeeping, the convs, the output gate and o_proj."""

    def _setup(self, placement, groups, passes_preconditioner):
        self.placement, (self.tp_group, self.cp_group) = placement, groups
        self.passes_preconditioner = passes_preconditioner

    def _forward(self, x, cu_seqlens, state, output_final_state, project):
        # fla's layer's forward in training, with CP on its convs (fla's context) and on the
        # recurrence (precond_recurrence); with a state (PrecondState, TP only) as fla's layer runs
        # with a cache. project(x, q, k, v) -> (op, per-token arguments, options)
        refuse_state_under_cp(self, state, output_final_state)
        x = copy_to_tensor_parallel_region(x, self.tp_group)  # dx summed over the TP ranks' heads
        seq = cp_context(cu_seqlens, self.placement, self.cp_group, self.conv_size)
        (q, k, v), caches = short_convs(self, x, seq, conv_caches(state, output_final_state))
        q, k = (rearrange(t, "... (h d) -> ... h d", d=self.head_k_dim) for t in (q, k))
        v = rearrange(v, "... (h d) -> ... h d", d=self.head_v_dim)
        op, per_token, options = project(x, q, k, v)
        o, S, A = precond_recurrence(op, per_token, options, cu_seqlens=cu_seqlens, placement=self.placement,
                                     cp_group=self.cp_group, initial=None if state is None else state[3:],
                                     output_final_state=output_final_state,
                                     passes_preconditioner=self.passes_preconditioner)
        o = self.o_norm(o, rearrange(self.g_proj(x), "... (h d) -> ... h d", d=self.head_v_dim))
        y = reduce_from_tensor_parallel_region(self.o_proj(rearrange(o, "b t h d -> b t (h d)")), self.tp_group)
        return (y, PrecondState(*caches, S, A)) if output_final_state else y


class HeadShardedPrecondGDN(_HeadSharded, PrecondGatedDeltaNet):
    """fla's PrecondGatedDeltaNet holding num_heads / tp key heads and num_v_heads / tp value heads."""

    def __init__(self, placement, groups, passes_preconditioner=True, sizes=SIZES):
        tp = placement.tp
        PrecondGatedDeltaNet.__init__(self, **dict(sizes, num_heads=sizes["num_heads"] // tp,
                                                   num_v_heads=sizes["num_v_heads"] // tp))
        self._setup(placement, groups, passes_preconditioner)

    def forward(self, x, cu_seqlens, state=None, output_final_state=False):
        return self._forward(x, cu_seqlens, state, output_final_state, self._project)

    def _project(self, x, q, k, v):
        beta = self.b_proj(x).sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        # fla's layer takes a_proj(x).float() / a_atk_proj(x).float() and A_log(_atk).float() here
        dtype = gate_dtype(x)
        g = -self.A_log.exp() * F.softplus(self.a_proj(x).to(dtype) + self.dt_bias)
        g_atk = -self.A_log_atk.exp() * F.softplus(self.a_atk_proj(x).to(dtype) + self.dt_bias_atk)
        per_token = dict(q=q, k=k, v=v, g_atk=g_atk, g=g, beta_atk=self.b_atk_proj(x).sigmoid(), beta=beta)
        options = dict(use_qk_l2norm_in_kernel=True, x=self.squash_x, eps=self.squash_eps,
                       log_atk_scale=self.log_atk_scale)
        return chunk_precond_gated_delta_rule, per_token, options


class HeadShardedPrecondKDA(_HeadSharded, PrecondKDA):
    """fla's PrecondKDA holding num_heads / tp key heads and num_v_heads / tp value heads."""

    def __init__(self, placement, groups, passes_preconditioner=True, sizes=KDA_SIZES):
        tp = placement.tp
        PrecondKDA.__init__(self, **dict(sizes, num_heads=sizes["num_heads"] // tp,
                                         num_v_heads=sizes["num_v_heads"] // tp))
        self._setup(placement, groups, passes_preconditioner)

    def forward(self, x, cu_seqlens, state=None, output_final_state=False):
        return self._forward(x, cu_seqlens, state, output_final_state, self._project)

    def _project(self, x, q, k, v):
        g = rearrange(self.f_proj(x), "... (h d) -> ... h d", d=self.head_k_dim)
        beta = self.b_proj(x).sigmoid()
        if self.num_v_heads > self.num_heads:  # fla's repeat "(h g)": value head j reads key head j // G
            q, k, beta = (t.repeat_interleave(self.num_v_heads // self.num_heads, dim=2) for t in (q, k, beta))
        if self.allow_neg_eigval:
            beta = beta * 2.0
        # fla's layer takes a_proj(x).float() and A_log_atk.float() here
        g_atk = -self.A_log_atk.exp() * F.softplus(self.a_proj(x).to(gate_dtype(x)) + self.dt_bias_atk)
        g = fused_kda_gate(g=g, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound)
        per_token = dict(q=q, k=k, v=v, g=g, g_atk=g_atk, beta_atk=self.b_atk_proj(x).sigmoid(), beta=beta)
        options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, safe_gate=self.safe_gate,
                       lower_bound=self.lower_bound, x=self.squash_x_val, eps=self.squash_eps,
                       log_atk_scale=self.log_atk_scale)
        return chunk_precond_kda, per_token, options


def build_precond(placement, groups, dtype, device, passes_preconditioner=True, sizes=SIZES, cls=HeadShardedPrecondGDN):
    return cls(placement, groups, passes_preconditioner, sizes).to(device, dtype)


def fla_precond_client(shard_atk_gate=shard_by_head, passes_preconditioner=True, sizes=SIZES):
    """The PrecondGatedDeltaNet client; `shard_atk_gate(t, tp, tp_rank)` gives a TP rank its
    a_atk_proj rows (the ATK preconditioner's decay gate, one row per key head);
    `passes_preconditioner=False` passes only the recurrent state across CP ranks."""
    return _client(HeadShardedPrecondGDN, SPLIT, REPLICATED, {"a_atk_proj.weight": shard_atk_gate},
                   passes_preconditioner, sizes)


def fla_precond_kda_client(shard_decay=shard_by_head, passes_preconditioner=True, sizes=KDA_SIZES):
    """The PrecondKDA client; `shard_decay(t, tp, tp_rank)` gives a TP rank its f_proj.1 rows (the
    per-channel decay's up-projection, head_k_dim rows per value head); `passes_preconditioner=False`
    passes only the recurrent state across CP ranks."""
    return _client(HeadShardedPrecondKDA, KDA_SPLIT, KDA_REPLICATED, {"f_proj.1.weight": shard_decay},
                   passes_preconditioner, sizes)


def _client(cls, split, replicated, sharders, passes_preconditioner, sizes):
    return ShardedLayer(functools.partial(build_precond, passes_preconditioner=passes_preconditioner, sizes=sizes,
                                          cls=cls),
                        functools.partial(shard_by_table, split=split, sharders=sharders),
                        functools.partial(unshard_by_table, split=split), replicated=replicated,
                        after_backward=functools.partial(reduce_replicated_grads, names=replicated))


# the TP split of each state field (PrecondState): the heads' channels and states
STATE_SPLIT = {"conv_q": 1, "conv_k": 1, "conv_v": 1, "recurrent": 1, "preconditioner": 1}


def log_atk_call(module, x, cu_seqlens, state, placement=None):
    """The state path's prefill call (and, `placement` None, its reference forward): the layer's
    forward from `state` with the ATK state held as its log. The ATK state is a decayed sum of
    squares (positive) and the continuation check draws initial states from N(0, 1): in this layout
    every draw is a valid state, and negating one (the check's visibility probe) still changes it."""
    if state is not None:
        state = state._replace(preconditioner=state.preconditioner.exp())
    y, new = module(x, cu_seqlens, state, output_final_state=True)
    return y, new._replace(preconditioner=new.preconditioner.log())


def fla_precond_state_path(sizes=SIZES):
    """The PrecondGatedDeltaNet client carrying its state from call to call, sharded by head (the
    reference's forward: `log_atk_call`)."""
    return client_state_path(fla_precond_client(sizes=sizes), STATE_SPLIT, prefill=log_atk_call)


def fla_precond_kda_state_path(sizes=KDA_SIZES):
    """The PrecondKDA client likewise."""
    return client_state_path(fla_precond_kda_client(sizes=sizes), STATE_SPLIT, prefill=log_atk_call)
