"""fla's RWKV7Attention as a downstream team shards it, for the fla-on-CPU tests (imported lazily:
importing fla costs seconds).

- `fla_rwkv7_layer(seed)`: fla's own RWKV7Attention (a non-first layer: the value LoRA mixes in
  the first layer's values, here the input itself), float64, seeded weights.
- `HeadShardedRWKV7` / `fla_rwkv7_client(shard_lora=...)`: that layer with its heads split over TP
  and its tokens over CP through fla's `build_cp_context` and `cp_context=`. r / k / v projections,
  the low-rank adapters' up-projections (`*_lora.lora.2`: one row per head channel), k_k, k_a, r_k
  and the group norm split by head; o_proj row-parallel; the token mixes x_* and the adapters'
  down-projections (`*_lora.lora.0`) replicated, their gradients summed over TP after backward.
  fla's token_shift takes no CP context: under CP the shift x_{t-1} - x_t is fla's causal_conv1d
  of width 2 with weights (1, -1) and the context, which brings the previous token across the
  rank boundary (and its gradient back). fla's layer computes in the input's dtype throughout
  (no float32 cast on the forward path), so the client's replicated layer equals fla's own.
- `fla_rwkv7_state_path()`: the client carrying its token-shift cache (the last input token, whole
  on every TP rank: its gradient is summed over TP inside the forward) and recurrent state (by
  head) from call to call, for `assert_continuation_parity`; TP only (fla takes no state under CP).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from einops import rearrange
from fla.layers import RWKV7Attention
from fla.layers.rwkv6 import LoRA
from fla.modules.causal_conv1d import causal_conv1d
from fla.modules.token_shift import token_shift
from fla.ops.rwkv7 import chunk_rwkv7
from fla.ops.rwkv7.fused_addcmul import fused_addcmul_rwkv7
from fla.ops.rwkv7.fused_k_update import fused_k_rwkv7
from fla.ops.rwkv7.gate_output_correction import gate_output_correction
from torch import nn

from clients.fla_layers import client_state_path, cp_context, reduce_replicated_grads, refuse_state_under_cp
from linattn.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from pytest_linattn import ShardedLayer

SIZES = dict(hidden_size=16, head_dim=4, decay_low_rank_dim=4, gate_low_rank_dim=6, a_low_rank_dim=4,
             v_low_rank_dim=5, norm_eps=1e-5, layer_idx=1, num_hidden_layers=2)  # 4 heads of 4
LOG_DECAY_BOUND = -0.6065306597126334  # RWKV-7's w = LOG_DECAY_BOUND * sigmoid(.), fla's lower_bound
REPLICATED = {f"x_{m}" for m in "rwkvag"} | {f"{m}_lora.lora.0.weight" for m in "wvag"}
HEAD_ROWS = {"r_proj.weight", "k_proj.weight", "v_proj.weight", "k_k", "k_a", "r_k", "g_norm.weight", "g_norm.bias",
             *(f"{m}_lora.lora.2.{p}" for m in "wva" for p in ("weight", "bias")), "g_lora.lora.2.weight"}


class ShiftRecurrentState(NamedTuple):
    """The client's state, one row per sequence: the token shift's cache (the last input token,
    `[N, hidden]`, whole on every TP rank) and the recurrent state `[N, H, K, V]`."""

    shift: torch.Tensor
    recurrent: torch.Tensor


def fla_rwkv7_layer(seed: int, sizes=SIZES):
    """fla's RWKV7Attention in float64, its weights fresh from `seed` (decays exp(w), w in (-0.61, 0);
    token mixes in (0, 1); projections near their usual scale)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla's note on its RWKV implementation
        layer = RWKV7Attention(**sizes).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            x = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.startswith("x_"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64))
            elif name in ("k_k", "k_a", "g_norm.weight"):
                p.copy_(1.0 + 0.2 * x)
            elif name.endswith("bias") or name == "r_k":
                p.copy_(0.5 * x)
            else:
                p.copy_(x / max(1, p.shape[-1]) ** 0.5)
    return layer


def fla_forward(layer, x, cu_seqlens):
    """fla's own layer as the harness calls a reference: the input stands in for the first layer's values."""
    return layer(x, v_first=x, cu_seqlens=cu_seqlens.long())[0]


def replicated_rwkv7(fla_layer, sizes=SIZES):
    """The client's layer on one rank with fla_layer's weights: the harness's reference."""
    from pytest_linattn import Placement

    layer = HeadShardedRWKV7(Placement(), (None, None), sizes=sizes).double()
    layer.load_state_dict(fla_layer.state_dict())
    return layer


class HeadShardedRWKV7(RWKV7Attention):
    """fla's RWKV7Attention holding num_heads / tp heads (fla ties its key width to hidden_size,
    so the head-sized parts are rebuilt at their TP size)."""

    def __init__(self, placement, groups, op_gets_cp_context=True, sizes=SIZES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            super().__init__(**sizes)
        self.placement, (self.tp_group, self.cp_group) = placement, groups
        self.op_gets_cp_context = op_gets_cp_context
        heads = self.num_heads // placement.tp
        self.num_heads, self.key_dim, self.value_dim = heads, heads * self.head_dim, heads * self.head_v_dim
        hidden, key_dim, value_dim = self.hidden_size, self.key_dim, self.value_dim
        self.k_k, self.k_a = nn.Parameter(torch.zeros(key_dim)), nn.Parameter(torch.zeros(key_dim))
        self.r_k = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.r_proj, self.k_proj = nn.Linear(hidden, key_dim, bias=False), nn.Linear(hidden, key_dim, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, value_dim, bias=False), nn.Linear(value_dim, hidden, bias=False)
        self.w_lora = LoRA(hidden, key_dim, low_rank_dim=self.decay_low_rank_dim, activation="tanh")
        self.v_lora = LoRA(hidden, value_dim, low_rank_dim=self.v_low_rank_dim, activation=None)
        self.a_lora = LoRA(hidden, key_dim, low_rank_dim=self.a_low_rank_dim, activation=None)
        self.g_lora = LoRA(hidden, value_dim, low_rank_dim=self.gate_low_rank_dim, activation="sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(heads, value_dim, eps=self.head_dim * sizes["norm_eps"], affine=True)

    def forward(self, x, cu_seqlens, state=None, output_final_state=False):
        # fla's layer's forward in training (layer_idx 1, fuse_norm off), with CP on the shift and the
        # op; with a state (ShiftRecurrentState, TP only) as fla's layer runs with a cache
        refuse_state_under_cp(self, state, output_final_state)
        tp_rank = 0 if self.tp_group is None else dist.get_rank(self.tp_group)
        shift_out = None
        if output_final_state:  # each sequence's last input token, from x before the TP copy: its
            # cotangent is whole on every TP rank and must not be summed over them
            _, shift_out = token_shift(x, cu_seqlens.long(), cache=None if state is None else state.shift,
                                       output_cache=True)
        x = copy_to_tensor_parallel_region(x, self.tp_group)  # dx summed over the TP ranks' heads
        seq = cp_context(cu_seqlens, self.placement, self.cp_group, conv_size=2)
        if "cp_context" in seq:  # the previous token, across the rank boundary where a sequence crosses it
            shift = torch.tensor([1.0, -1.0], dtype=x.dtype, device=x.device).expand(x.shape[-1], 2)
            delta = causal_conv1d(x, weight=shift, **seq)[0]
        else:  # the cache's gradient, a partial sum over this rank's heads, summed over TP as x's
            cache = None if state is None else copy_to_tensor_parallel_region(state.shift, self.tp_group)
            delta = token_shift(x, seq["cu_seqlens"], cache=cache)
        xr, xw, xk, xv, xa, xg = fused_addcmul_rwkv7(x, delta, self.x_r, self.x_w, self.x_k, self.x_v, self.x_a,
                                                     self.x_g)
        r = self.r_proj(xr)
        w = LOG_DECAY_BOUND * self.w_lora(xw).sigmoid()
        k, v = self.k_proj(xk), self.v_proj(xv)
        v_first = x.chunk(self.placement.tp, dim=-1)[tp_rank]  # this rank's heads of the first layer's values
        v = torch.lerp(v, v_first, self.v_lora(xv).sigmoid())
        a, g = self.a_lora(xa).sigmoid(), self.g_lora(xg)
        kk = nn.functional.normalize(rearrange(k * self.k_k, "b t (h d) -> b t h d", d=self.head_dim), dim=-1, p=2.0)
        k = fused_k_rwkv7(k, a, self.k_a)
        r, w, k, a = (rearrange(t, "b t (h d) -> b t h d", d=self.head_dim) for t in (r, w, k, a))
        v = rearrange(v, "b t (h d) -> b t h d", d=self.head_v_dim)
        op_seq = seq
        if "cp_context" in seq and not self.op_gets_cp_context:  # this rank's piece alone: no state comes in
            op_seq = dict(cu_seqlens=seq["cp_context"].cu_seqlens)
        o, final = chunk_rwkv7(r=r, w=w, k=k, v=v, a=-kk, b=kk * a, scale=1.0, safe_gate=True,
                               lower_bound=LOG_DECAY_BOUND, chunk_size=64,
                               initial_state=None if state is None else state.recurrent,
                               output_final_state=output_final_state, **op_seq)
        B, T = x.shape[:2]
        o = self.g_norm(rearrange(o, "b t h d -> (b t) (h d)")).view(B, T, -1)
        o = gate_output_correction(o, r, k, self.r_k, v, g)
        y = reduce_from_tensor_parallel_region(self.o_proj(o), self.tp_group)
        return (y, ShiftRecurrentState(shift_out, final)) if output_final_state else y


def build_rwkv7(placement, groups, dtype, device, op_gets_cp_context=True, sizes=SIZES):
    return HeadShardedRWKV7(placement, groups, op_gets_cp_context, sizes).to(device, dtype)


def head_block(t, tp, tp_rank):
    """This TP rank's heads: its contiguous block of rows."""
    return t.chunk(tp, dim=0)[tp_rank]


def shard(full, placement, tp_rank, shard_lora=head_block):
    out = {}
    for name, t in full.items():
        if name in REPLICATED:
            out[name] = t
        elif name == "o_proj.weight":
            out[name] = t.chunk(placement.tp, dim=1)[tp_rank]
        elif name.startswith("a_lora.lora.2"):
            out[name] = shard_lora(t, placement.tp, tp_rank)
        elif name in HEAD_ROWS:
            out[name] = head_block(t, placement.tp, tp_rank)
        else:
            raise KeyError(f"{name}: no TP rule for this parameter")
    return out


def unshard(grads, placement):
    out = {}
    for name in grads[0]:
        if name in REPLICATED:
            out[name] = grads[0][name]
        else:
            out[name] = torch.cat([g[name] for g in grads], dim=1 if name == "o_proj.weight" else 0)
    return out


def fla_rwkv7_client(shard_lora=head_block, op_gets_cp_context=True, sizes=SIZES):
    """The client; `shard_lora(t, tp, tp_rank)` gives a TP rank its a-adapter up-projection rows;
    `op_gets_cp_context=False` gives the op this rank's cu_seqlens instead (a layer whose recurrence
    never hears of CP); `sizes` fla's layer arguments (default SIZES)."""
    return ShardedLayer(functools.partial(build_rwkv7, op_gets_cp_context=op_gets_cp_context, sizes=sizes),
                        functools.partial(shard, shard_lora=shard_lora), unshard,
                        replicated=REPLICATED,
                        after_backward=functools.partial(reduce_replicated_grads, names=REPLICATED))


def fla_rwkv7_state_path(sizes=SIZES):
    """The client carrying its state (the shift cache, replicated; the recurrent state by head) from call to call."""
    return client_state_path(fla_rwkv7_client(sizes=sizes), {"shift": None, "recurrent": 1})
