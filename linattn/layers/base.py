"""What every head-sharded linear-attention layer shares: parameters from the layout table,
input checks, the TP/SP region around the token mixer, context parallelism around the token
mixer, and the two kernel call sites.

Forward of every family, on one (TP rank, CP rank) holding 1/tp of the heads and 1/cp of the tokens:

    x = enter(hidden_states)         SP: all-gather tokens    | else: copy (bwd all-reduce of dx)
                                     -> this CP rank's tokens, in the CP layout
    x = relayout.to_contiguous(x)    zigzag only: all-to-all over CP into the contiguous piece
    y = family mixer on local heads  column-parallel in, per-head conv + recurrence + gated norm,
                                     row-parallel out (partial sums over the TP ranks); conv halo
                                     and recurrent state cross CP ranks (linattn.parallel.cp)
    y = relayout.from_contiguous(y)  zigzag only: the inverse all-to-all
    return exit(y)                   SP: reduce-scatter tokens | else: all-reduce

Replicated weights (norm weight, KDA's f_a_proj and g_a_proj) pass through
copy_to_tensor_parallel_region where they are used, so their gradient is summed over TP
inside backward, like the input's. Beyond the key heads (tp_size a multiple of num_k_heads),
the key-head weights (q and k projections and conv channels) pass through
copy_to_key_head_replicas: their gradient is summed over the ranks holding the same key head. Over CP nothing is summed (see linattn.parallel.cp).

Context parallelism acts at exactly two methods: `_short_conv` (every short convolution of a
family goes through one call) and `_delta_rule` (the recurrence). Both get the layer's CP
context (its contiguous piece), or None without CP.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from linattn import kernels, selection
from linattn.parallel import cp
from linattn.parallel.groups import group_rank, group_size
from linattn.parallel.mappings import (
    copy_to_key_head_replicas,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from linattn.checks import validate_cu_seqlens, wants_grad

from .config import LinearAttentionConfig
from .state import LayerState, check_layer_state
from .state_dict import FLATTENABLE, parameter_layouts

__all__ = ["HeadShardedLinearAttention"]


class _Parameters(nn.Module):
    """Holder for a dotted parameter name's prefix (`in_proj_qkvz` in `in_proj_qkvz.weight`)."""


class HeadShardedLinearAttention(nn.Module):
    """Base of GatedDeltaNet and KimiDeltaAttention; build them with `linattn.layers.build_layer`.

    `config` is the replicated layer's; this module holds the TP rank's shard, whose sizes are
    `local_config` (1/tp of the key and value heads). Parameter names and shapes are those of
    `parameter_layouts(local_config)`: the HF names, so with tp_group=None a checkpoint's layer
    state dict loads directly, and `shard_state_dict` gives each TP rank its piece. Under CP every
    CP rank holds the same parameters (CP splits tokens, not weights).
    """

    def __init__(
        self,
        config: LinearAttentionConfig,
        *,
        tp_group=None,
        cp_group=None,
        cp_layout: str = "contiguous",
        sequence_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device="cpu",
    ):
        super().__init__()
        if not isinstance(config, LinearAttentionConfig):
            raise ValueError(f"config must be a LinearAttentionConfig, got {type(config).__name__}")
        if cp_layout not in cp.LAYOUTS:
            raise ValueError(f"cp_layout must be one of {cp.LAYOUTS}, got {cp_layout!r}")
        self.config = config
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.local_config = config.local(self.tp_size)  # raises for a tp_size the heads do not split into
        # beyond the key heads, this many consecutive TP ranks hold each key head
        self.key_head_replicas = config.key_head_replicas(self.tp_size)
        # SP is a TP variant: with one rank there is nothing to split
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1
        self.cp_group = cp_group
        self.cp_size = group_size(cp_group)
        self.cp_rank = group_rank(cp_group)
        self.cp_layout = cp_layout
        _check_group_grid(tp_group, cp_group)
        for name, layout in parameter_layouts(self.local_config).items():
            owner = self
            *prefixes, leaf = name.split(".")
            for prefix in prefixes:
                if not hasattr(owner, prefix):
                    owner.add_module(prefix, _Parameters())
                owner = getattr(owner, prefix)
            tensor = torch.empty(layout.shape, dtype=dtype, device=device)
            owner.register_parameter(leaf, nn.Parameter(self._initial_value(name, tensor)))

    # ---- initialisation (HF / fla defaults; a checkpoint or shard_state_dict overwrites them) ----

    def _initial_value(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if name == "A_log":
                return tensor.uniform_(1.0, 16.0).log_()
            if name == "dt_bias":
                # dt log-uniform in [1e-3, 0.1], stored as softplus^-1(dt) (fla, Mamba2)
                dt = torch.exp(torch.rand_like(tensor) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                dt = dt.clamp(min=1e-4)
                return tensor.copy_(dt + torch.log(-torch.expm1(-dt)))
            if name.endswith("norm.weight"):
                return tensor.fill_(1.0)
            fan_in = tensor.shape[-1]  # linear: in_features; depthwise conv: kernel width
            bound = 1.0 / math.sqrt(fan_in)
            return tensor.uniform_(-bound, bound)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Kimi Linear stores A_log as [1, 1, H, 1]; accept any layout of the same elements
        for name in FLATTENABLE:
            key = prefix + name
            param = self._parameters.get(name)
            if key in state_dict and param is not None:
                value = state_dict[key]
                if isinstance(value, torch.Tensor) and value.shape != param.shape and value.numel() == param.numel():
                    state_dict[key] = value.reshape(param.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- forward ----

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, state: LayerState | None = None, *,
                output_final_state: bool = False, cu_seqlens_padded: torch.Tensor | None = None):
        """hidden_states `[1, T_local, hidden]`: this CP rank's T / cp tokens in the CP layout,
        under SP split again into tp contiguous slices of T / (cp * tp) tokens (T_local = T without
        CP and SP); cu_seqlens: the GLOBAL packed-sequence boundaries `[N + 1]` (int32), the same on
        every rank. Returns `[1, T_local, hidden]`, the same tokens.

        state: a LayerState (`linattn.layers.state`) of this TP rank's heads, one row per sequence
        of the whole batch (the same on every CP rank): each sequence starts from its row instead
        of zeros (a continued prefill; under CP on whichever rank the sequence starts).
        output_final_state: return `(y, LayerState)`, every sequence's state after its tokens,
        whole on every CP rank (its gradient must be whole on every CP rank too:
        `linattn.parallel.cp.conv.sequences_ending_here`).

        cu_seqlens_padded: padded THD (Megatron's / Transformer Engine's): the GLOBAL boundaries
        `[N + 1]` of the sequences padded to multiples of 2 * cp_size, each sequence's real tokens
        first; hidden_states then holds this rank's share of the padded tokens (T above is
        cu_seqlens_padded[-1]). No pad reaches a real token (`linattn.parallel.cp.padded_runs`);
        the pads' outputs are of no use. Not with state or output_final_state."""
        if cu_seqlens_padded is not None and (state is not None or output_final_state):
            raise ValueError("cu_seqlens_padded is not taken with state or output_final_state: give the unpadded batch")
        cu_seqlens, cp_context = self._check_inputs(hidden_states, cu_seqlens, cu_seqlens_padded)
        carry = None
        if state is not None or output_final_state:
            num_sequences = cu_seqlens.numel() - 1
            carry = _Carry(None if state is None else check_layer_state(state, self.local_config, num_sequences))
        x = self._enter_tensor_parallel_region(hidden_states)
        if cp_context is None:
            y = self._mix_tokens(x, cu_seqlens, None, carry)
        else:
            # ops run on the contiguous piece; zigzag moves the tokens there once per layer (one
            # all-to-all of the hidden states each way) rather than once per op
            x = cp_context.relayout.to_contiguous(x)
            y = self._mix_tokens(x, cp_context.local_cu_seqlens_on(x.device), cp_context, carry)
            y = cp_context.relayout.from_contiguous(y)
        y = self._exit_tensor_parallel_region(y)
        return (y, carry.final()) if output_final_state else y

    def step(self, hidden_states: torch.Tensor, state: LayerState | None) -> tuple[torch.Tensor, LayerState]:
        """One decode step: hidden_states `[1, N, hidden]`, the next token of each of N sequences
        (the whole decode batch on every rank: no CP, no SP split), state their LayerState (None:
        zeros). The conv and the recurrence run token by token (`kernels.short_conv_step`, the
        delta rule's mode="recurrent": on CUDA fla's fused_recurrent kernels), with no host
        synchronisation, so a CUDA graph can capture the step; on CUDA with gradients to compute
        (fla's fused_recurrent has no backward) it runs the chunked kernels instead.
        Returns (`[1, N, hidden]`, the state after the token)."""
        if not (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3 and hidden_states.shape[0] == 1
                and hidden_states.shape[2] == self.config.hidden_size):
            raise ValueError(f"hidden_states must be one token per sequence, [1, N, {self.config.hidden_size}], "
                             f"got {getattr(hidden_states, 'shape', hidden_states)!r}")
        N = hidden_states.shape[1]
        needs_backward = wants_grad(hidden_states, *self.parameters(), *(state or ()))
        carry = _Carry(None if state is None else check_layer_state(state, self.local_config, N),
                       mode="chunk" if hidden_states.is_cuda and needs_backward else "recurrent")
        cu_seqlens = torch.arange(N + 1, device=hidden_states.device)
        x = copy_to_tensor_parallel_region(hidden_states, self.tp_group)
        y = self._mix_tokens(x, cu_seqlens, None, carry)
        return reduce_from_tensor_parallel_region(y, self.tp_group), carry.final()

    def _check_inputs(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded=None):
        """ValueError naming the rule a bad input breaks, before any collective. Returns
        (the kernels' boundaries as int64 on hidden_states' device, the CP context or None
        without CP)."""
        hidden = self.config.hidden_size
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be a [1, T, hidden] tensor, got {getattr(hidden_states, 'shape', hidden_states)!r}")
        if hidden_states.shape[0] != 1 or hidden_states.shape[2] != hidden:
            raise ValueError(f"hidden_states must be packed as [1, T, {hidden}], got {tuple(hidden_states.shape)}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D tensor of at least 2 boundaries, got {getattr(cu_seqlens, 'shape', cu_seqlens)!r}")
        # unpadded: the two-argument call, which subclasses overriding _packed_batch take
        padded = () if cu_seqlens_padded is None else (cu_seqlens_padded,)
        total, device_cu_seqlens, cp_context = self._packed_batch(cu_seqlens, hidden_states.device, *padded)
        local_tokens = hidden_states.shape[1]
        cp_tokens = total // self.cp_size  # this CP rank's tokens
        if self.sequence_parallel:
            if cp_tokens % self.tp_size != 0:
                what = "the total token count" if self.cp_size == 1 else "each CP rank's token count cu_seqlens[-1] / cp_size"
                raise ValueError(
                    f"sequence parallel needs {what} divisible by the TP size: "
                    f"cu_seqlens[-1]={total}, cp_size={self.cp_size}, tp_size={self.tp_size}"
                )
            if local_tokens * self.tp_size != cp_tokens:
                divisor = "tp_size" if self.cp_size == 1 else "(cp_size * tp_size)"
                raise ValueError(
                    f"hidden_states must hold cu_seqlens[-1] / {divisor} = {cp_tokens // self.tp_size} tokens under "
                    f"sequence parallel, got {local_tokens}"
                )
        elif local_tokens != cp_tokens:
            what = "cu_seqlens[-1]" if self.cp_size == 1 else "cu_seqlens[-1] / cp_size"
            if cu_seqlens_padded is not None:
                what = what.replace("cu_seqlens[", "cu_seqlens_padded[")
            raise ValueError(f"hidden_states must hold {what} = {cp_tokens} tokens, got {local_tokens}")
        return device_cu_seqlens, cp_context

    def _packed_batch(self, cu_seqlens: torch.Tensor, device, cu_seqlens_padded=None):
        """(total tokens, the kernels' boundaries as int64 on device, the CP context or None) of
        validated boundaries. A step passes the same cu_seqlens tensor again and again: while it
        is the same object, unchanged, the same results come back, so nothing is read back from
        the GPU (a sync) and fla's caches keyed on the tensor (chunk indices, sequence ids) hit,
        as they do for its own layers. Padded: the kernels run on the real and pad runs."""
        memo = self.__dict__.get("_packed_batch_memo")
        key = (cu_seqlens._version, device, None if cu_seqlens_padded is None else cu_seqlens_padded._version)
        if memo is not None and memo[0]() is cu_seqlens and memo[1] == key and memo[3]() is cu_seqlens_padded:
            return memo[2]
        if cu_seqlens_padded is None:
            total = int(cu_seqlens[-1])
            validate_cu_seqlens(cu_seqlens, total, "cu_seqlens")
            runs = cu_seqlens
        else:
            _, runs = cp.padded_runs(cu_seqlens, cu_seqlens_padded, self.cp_size)
            total = int(runs[-1])
        cp_context = None
        if self.cp_size > 1:
            cp_context = self._cp_context(cu_seqlens, total, cu_seqlens_padded)
        result = (total, runs.to(device=device, dtype=torch.long), cp_context)
        padded_ref = (lambda: None) if cu_seqlens_padded is None else weakref.ref(cu_seqlens_padded)
        self.__dict__["_packed_batch_memo"] = (weakref.ref(cu_seqlens), key, result, padded_ref)
        return result

    def _cp_context(self, cu_seqlens, total: int, cu_seqlens_padded=None):
        # cp.build_context checks the CP divisibility rules (T by cp, zigzag: T and every
        # sequence length by 2 * cp; padded: every padded length by 2 * cp); it only reads the
        # group's size and rank
        return cp.build_context(cu_seqlens, self.cp_group, self.cp_layout, total_tokens=total,
                                cu_seqlens_padded=cu_seqlens_padded)

    def _enter_tensor_parallel_region(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden_states, self.tp_group)
        return copy_to_tensor_parallel_region(hidden_states, self.tp_group)

    def _exit_tensor_parallel_region(self, partial_output: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial_output, self.tp_group)
        return reduce_from_tensor_parallel_region(partial_output, self.tp_group)

    def _replicated(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight every TP rank holds whole: its gradient is summed over TP in backward."""
        return copy_to_tensor_parallel_region(weight, self.tp_group)

    def _key_head(self, weight: torch.Tensor) -> torch.Tensor:
        """A key-head weight (q or k rows): beyond the key heads its replicas each hold a partial
        gradient, summed over the replicas in backward."""
        return copy_to_key_head_replicas(weight, self.tp_group, self.key_head_replicas)

    def _mix_tokens(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cp_context, carry=None) -> torch.Tensor:
        """Family-specific: `[1, T, hidden]` -> this rank's partial `[1, T, hidden]`, over the tokens
        this rank works on (all of them, or under CP the contiguous piece of `cp_context`);
        cu_seqlens: those tokens' boundaries. Pass them and `carry` (the state in and out, or
        None) on to `_short_conv` and `_delta_rule`."""
        raise NotImplementedError

    # ---- the two kernel call sites (the only places tokens of other CP ranks matter) ----

    def _short_conv(self, xs: list, weights: list, cu_seqlens: torch.Tensor, cp_context=None, carry=None) -> list:
        """Causal depthwise conv + SiLU over packed channel blocks (q, k, v): xs `[1, T, D_i]`,
        weights `[D_i, W]`; returns the blocks' outputs. Without CP one call per block, so each
        output is contiguous (the kernels take it without a copy); under CP one call over the
        concatenated blocks, so one halo exchange serves them (each sequence's W-1 earlier tokens
        come from the ranks that hold them). With a carry, one call over the concatenated blocks
        from its conv state (the state's channels are those blocks'), keeping the final one."""
        if carry is not None:
            state = dict(initial_state=carry.initial_conv, output_final_state=True)
            x, w = torch.cat(xs, dim=-1), torch.cat(weights, dim=0)
            if carry.mode == "recurrent":  # a decode step: one token per sequence
                y, carry.conv = kernels.short_conv_step(x, w, carry.initial_conv)
            elif cp_context is None:
                y, carry.conv = kernels.short_conv(x, w, cu_seqlens=cu_seqlens, activation="silu", **state)
            else:
                y, carry.conv = cp.short_conv(x, w, activation="silu", cp_context=cp_context, **state)
            return list(y.split([x.shape[-1] for x in xs], dim=-1))
        if cp_context is None:
            return [kernels.short_conv(x, w, cu_seqlens=cu_seqlens, activation="silu") for x, w in zip(xs, weights)]
        y = cp.short_conv(torch.cat(xs, dim=-1), torch.cat(weights, dim=0), activation="silu", cp_context=cp_context)
        return list(y.split([x.shape[-1] for x in xs], dim=-1))

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens: torch.Tensor, cp_context=None, carry=None,
                    **gate) -> torch.Tensor:
        """The recurrence on this rank's heads: q, k `[1, T, H, dk]`, v `[1, T, HV, dv]`, g `[1, T, HV]`
        (gdn) or `[1, T, HV, dk]` (kda), beta `[1, T, HV]`; returns o `[1, T, HV, dv]`.
        q and k are L2-normalised inside the kernel, scale = dk ** -0.5 (HF, fla). Under CP the
        state of a sequence crossing a rank boundary is carried over (forward and backward).
        gate: the kernel entries' in-kernel gate and beta arguments (see `_fuses_gate`), without CP.
        carry: the state in and out (its recurrent state and kernel mode), or None.
        Value head j reads the key head `config.head_pairing` names (`config.key_head_of(j)`)."""
        scale = self.config.head_k_dim ** -0.5
        pairing = self.config.head_pairing
        if gate and cp_context is not None:
            raise ValueError("the in-kernel gate runs without CP only: compute g and beta before the CP op")
        if carry is not None:
            state = dict(initial_state=carry.initial_recurrent, output_final_state=True)
            if cp_context is not None:
                o, carry.recurrent = cp.delta_rule(q, k, v, g, beta, op=self.config.op, scale=scale,
                                                   use_qk_l2norm=True, cp_context=cp_context, head_pairing=pairing,
                                                   **state)
            else:
                op = kernels.kda if self.config.op == "kda" else kernels.gated_delta_rule
                o, carry.recurrent = op(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm=True,
                                        mode=carry.mode, head_pairing=pairing, **state, **gate)
            return o
        if cp_context is not None:
            return cp.delta_rule(q, k, v, g, beta, op=self.config.op, scale=scale, use_qk_l2norm=True,
                                 cp_context=cp_context, head_pairing=pairing)
        op = kernels.kda if self.config.op == "kda" else kernels.gated_delta_rule
        return op(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm=True, head_pairing=pairing,
                  **gate)[0]

    def _fuses_gate(self, x: torch.Tensor, cp_context) -> bool:
        """Whether the decay gate and the beta sigmoid run inside the recurrence kernel (fla's
        use_gate_in_kernel / use_beta_sigmoid_in_kernel), as `linattn.selection` picks for CUDA;
        under CP the CP op takes g and beta computed before it."""
        return x.is_cuda and cp_context is None and selection.gate_norm_backend() == "fla"


class _Carry:
    """One call's state: the incoming LayerState (None: zeros), the recurrence's kernel mode, and
    the final conv and recurrent states the two call sites leave here."""

    def __init__(self, initial: LayerState | None, mode: str = "chunk"):
        self.initial_conv = None if initial is None else initial.conv
        self.initial_recurrent = None if initial is None else initial.recurrent
        self.mode = mode
        self.conv = self.recurrent = None

    def final(self) -> LayerState:
        return LayerState(self.conv, self.recurrent)


def _check_group_grid(tp_group, cp_group) -> None:
    """TP and CP groups must be one [.., CP, TP] grid over the world (Megatron order, as
    linattn.parallel.new_groups makes them): sizes that tile the world, crossing in this rank only."""
    tp_size, cp_size = group_size(tp_group), group_size(cp_group)
    for name, group in (("tp_group", tp_group), ("cp_group", cp_group)):
        if group is not None and group_rank(group) < 0:
            raise ValueError(f"{name} must contain this rank (rank {dist.get_rank()})")
    if tp_size == 1 and cp_size == 1:
        return
    world = dist.get_world_size()
    if world % (tp_size * cp_size) != 0:
        raise ValueError(
            f"tp_size * cp_size must tile the world: {tp_size} * {cp_size} = {tp_size * cp_size} "
            f"does not divide world_size {world}"
        )
    if tp_size > 1 and cp_size > 1:
        shared = set(dist.get_process_group_ranks(tp_group)) & set(dist.get_process_group_ranks(cp_group))
        if shared != {dist.get_rank()}:
            raise ValueError(
                f"the TP and CP groups must tile the world as a grid, crossing in this rank only "
                f"(rank {dist.get_rank()}); they share ranks {sorted(shared)}"
            )
