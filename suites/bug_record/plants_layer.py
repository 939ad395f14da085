"""Planted bugs in linattn's layer and its shard code: subclasses of the project's GatedDeltaNet
(each overrides the one method where the reported mechanism lived), shard functions, trainer
hooks. Module-level: spawn's ranks get them by reference.

A plant that runs only where the layer is sharded (a TP group of 2, a CP group, the shard
function) is seen by sharded-vs-replicated parity; one that changes the replicated layer too
(`DeltaRuleWithoutBoundaries`) is not, and the oracle must see it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from cases.layer_parity import linattn_layer
from clients.per_token_loss import loss_with_token_count
from clients.tp_decoder import TPDecoderStack
from linattn.layers import GatedDeltaNet, build_layer, shard_state_dict
from linattn.parallel import cp
from linattn.parallel.cp import conv as cp_conv


# ---- TP ------------------------------------------------------------------------------------------


class NormGradUnreducedWithoutSP(GatedDeltaNet):
    """Megatron-LM #7452: the TP-replicated norm weight's gradient is summed over TP only when
    sequence parallel is on; without SP each rank keeps its partial sum."""

    def _replicated(self, weight):
        return super()._replicated(weight) if self.sequence_parallel else weight


class DecoderLayersWithoutIsLastLayer(TPDecoderStack):
    """sglang #19411 (fixed by that PR): Qwen3.5's decoder layers did not pass is_last_layer to their
    LayerCommunicator (default False), so at TP >= 2 every layer, the last one too, skipped its MLP
    all-reduce for the next layer's fused all-reduce + residual add + norm; after the last layer no
    such layer runs, and the final norm adds its un-reduced partial sum to the reduced residual."""

    def layer_options(self, index, layers):
        return {}


def shard_fused_in_proj_evenly(config, full, placement, tp_rank):
    """Megatron-LM PR #1989 review: the fused in_proj `[Q_all | K_all | V_all]` split evenly by a
    column-parallel linear, so rank 0 gets Q | K | part of V instead of its heads of each."""
    local = shard_state_dict(full, config, tp_rank, placement.tp)
    local["in_proj_qkv.weight"] = full["in_proj_qkv.weight"].chunk(placement.tp, dim=0)[tp_rank].clone()
    return local


# ---- CP ------------------------------------------------------------------------------------------


class StateNotPassedOverCP(GatedDeltaNet):
    """accelerate #4177: the recurrence runs on each CP rank's piece alone, every piece's first
    sequence restarting from a zero state (the conv halo still crosses)."""

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        return super()._delta_rule(q, k, v, g, beta, cu_seqlens, None, carry, **gate)


class ContextFromWholeBatch(GatedDeltaNet):
    """prime-rl #3002: the CP context built from a made-up `[0, T]` instead of the packed
    boundaries, so state and conv run across documents."""

    def _packed_batch(self, cu_seqlens, device):
        total, cu, ctx = super()._packed_batch(cu_seqlens, device)
        if ctx is None:
            return total, cu, ctx
        whole = torch.tensor([0, total], dtype=cu_seqlens.dtype)
        return total, cu, cp.build_context(whole, self.cp_group, self.cp_layout, total_tokens=total)


class LocalBoundariesDividedByCP(GatedDeltaNet):
    """Megatron-LM dev 098d7d97 (wrong THD partition in contiguous CP): each rank's local
    boundaries taken as `cu_seqlens // cp` (the partition ISEEKYAN/Megatron-LM #111 fixed)."""

    def _packed_batch(self, cu_seqlens, device):
        total, cu, ctx = super()._packed_batch(cu_seqlens, device)
        if ctx is None:
            return total, cu, ctx
        local = torch.unique_consecutive(ctx.cu_seqlens // ctx.cp_size)
        return total, cu, dataclasses.replace(ctx, local_cu_seqlens=local, _on_device={})


# the CPU stand-in for Megatron's 4096: shorter than a CP piece of the record's packings
HARD_CODED_CONV_TOKENS = 12


class ConvPaddedToFixedLength(GatedDeltaNet):
    """Megatron-LM dev d749b6c7 (a hard-coded 4096-token conv pad): the CP conv's buffer has a
    fixed length, so the tokens of a longer piece past it are convolved from zeros."""

    def _short_conv(self, xs, weights, cu_seqlens, cp_context=None, carry=None):
        if cp_context is not None:
            keep = torch.arange(xs[0].shape[1], device=xs[0].device) < HARD_CODED_CONV_TOKENS
            xs = [x * keep.view(1, -1, 1).to(x.dtype) for x in xs]
        return super()._short_conv(xs, weights, cu_seqlens, cp_context, carry)


class _MaskedForwardOnly(torch.autograd.Function):
    """`window * mask` forward; the window's whole gradient backward (the mask not applied)."""

    @staticmethod
    def forward(ctx, window, mask):
        return window * mask

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def halo_gradient_unmasked(x, ctx, W):
    """fla #774 (fla's `_correct_dx_for_cp` before 7cbe461b), in linattn's halo exchange: the piece's
    first sequence gets an initial state of the W-1 positions before the piece, its tokens in the
    last min(W-1, first_seq_offset) of them and zeros before (the forward masks: outputs right);
    the backward sends every position's gradient back to the token there, the masked ones too, so
    where the sequence started fewer than W-1 tokens before the piece, the gradient of the zeros
    lands on the tokens of the sequence before it (on this or an earlier rank)."""
    local = ctx.local_tokens
    n_tail = min(W - 1, local)
    tails = cp_conv.all_gather_from_cp_ranks(x[0, local - n_tail:], ctx.group)  # [cp, n_tail, ...]
    window = min(W - 1, ctx.start)  # the positions before the piece (none before the batch's first token)
    pos = torch.arange(ctx.start - window, ctx.start)
    src = pos // local
    tokens = tails[src, pos - (src * local + local - n_tail)]
    halo_len = min(W - 1, ctx.first_seq_offset[ctx.cp_rank])  # the positions the sequence's own tokens fill
    mask = (torch.arange(window, device=x.device) >= window - halo_len).to(x.dtype).unsqueeze(-1)
    return _MaskedForwardOnly.apply(tokens, mask)


@contextlib.contextmanager
def _swapped(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


class HaloGradientUnmasked(GatedDeltaNet):
    """The layer whose CP conv's halo gradient is not masked (`halo_gradient_unmasked`, swapped in
    for its own calls only: the rank processes are shared by other tests)."""

    def _short_conv(self, xs, weights, cu_seqlens, cp_context=None, carry=None):
        with _swapped(cp_conv, "_halo", halo_gradient_unmasked):
            return super()._short_conv(xs, weights, cu_seqlens, cp_context, carry)


# ---- the replicated layer too: invisible to parity -----------------------------------------------


class DeltaRuleWithoutBoundaries(GatedDeltaNet):
    """slime #1686: cu_seqlens reaches the short conv but not the delta rule, so the recurrence
    runs through the packed batch as one sequence (every placement alike)."""

    def _delta_rule(self, q, k, v, g, beta, cu_seqlens, cp_context=None, carry=None, **gate):
        whole = cu_seqlens[[0, -1]]
        return super()._delta_rule(q, k, v, g, beta, whole, cp_context, carry, **gate)


# ---- training step -------------------------------------------------------------------------------


class MetadataCachedByTokenCount(GatedDeltaNet):
    """miles #2213's class: the packing metadata kept on the module keyed by the total token
    count, so a later micro-batch of the same length but another packing reuses stale
    boundaries."""

    def _packed_batch(self, cu_seqlens, device):
        cache = self.__dict__.setdefault("_by_token_count", {})
        total = int(cu_seqlens[-1])
        if total not in cache:
            cache[total] = super()._packed_batch(cu_seqlens, device)
        return cache[total]


def all_reduce_replicated_grads(module, placement):
    """transformers' `replicated_with_grad_allreduce`: a hook all-reduces the replicated weights'
    accumulated .grad after every backward, so under accumulation earlier micro-batches are
    summed again (tp times) on every later one."""
    if placement.tp > 1:
        dist.all_reduce(module.norm.weight.grad, group=module.tp_group)


def loss_without_token_count(y, dy, per_token):
    """verl #6609: the loss function returns the legacy 2-tuple (loss, metrics) also under per-token
    loss, where megatron-core expects (loss, num_tokens, metrics): the per-token loss, a token sum,
    reaches a trainer that takes a 2-tuple's loss as normalised, and no count reaches the division
    (finalize_model_grads gets 0 tokens: no division). verl's own policy loss it normalised itself;
    the sums left to Megatron were the MoE aux / z-losses. The layer has none: the sum left
    un-normalised here is the main loss's (suites/clients/per_token_loss.py's trainer)."""
    outputs = loss_with_token_count(y, dy, per_token)
    return outputs[0], outputs[-1]  # (loss, metrics) whatever the mode: verl #6836's 3-tuple undone


# ---- the clients ---------------------------------------------------------------------------------


def build_planted(cls, config, placement, groups, dtype, device):
    tp_group, cp_group = groups
    # the padded layout is linattn's zigzag, given cu_seqlens_padded with each forward
    layout = "zigzag" if placement.padded else placement.cp_layout
    return cls(config, tp_group=tp_group, cp_group=cp_group, cp_layout=layout,
               sequence_parallel=placement.sequence_parallel, dtype=dtype, device=device)


def planted_layer(config, cls=None, **fields):
    """linattn's ShardedLayer for `config` with its build making `cls` (a plant above) and other
    fields replaced (a planted shard or after_backward)."""
    layer = linattn_layer(config)
    if cls is not None:
        fields["build"] = functools.partial(build_planted, cls, config)
    return dataclasses.replace(layer, **fields)


def shard_gate_unsliced_beyond_key_heads(config, full, placement, tp_rank):
    """miles #972 / vLLM #13660's class: with TP > key heads each key head is replicated over
    tp / H ranks, which split its value heads; the output gate (in_proj_z) is sliced by key head
    only, so every replica gets the first replica's gate rows instead of its own value heads'."""
    shard = shard_state_dict(full, config, tp_rank, placement.tp)
    first = tp_rank - tp_rank % config.key_head_replicas(placement.tp)
    shard["in_proj_z.weight"] = shard_state_dict(full, config, first, placement.tp)["in_proj_z.weight"]
    return shard


# ---- classes without a check: the closest check runs, and cannot see them ------------------------


class UnpaddedOffsets(GatedDeltaNet):
    """Megatron-LM #4495's class: under THD + CP the padded chunks are indexed with the unpadded
    offsets (cu_seqlens where the tokens lie at cu_seqlens_padded): the ops' runs start at
    cu_seqlens' boundaries inside the padded tokens, so each sequence's run begins in the one
    before it."""

    def _cp_context(self, cu_seqlens, total, cu_seqlens_padded=None):
        right = super()._cp_context(cu_seqlens, total, cu_seqlens_padded)
        wrong = torch.cat([cu_seqlens.cpu().long(), right.cu_seqlens[-1:]])
        return dataclasses.replace(cp.build_context(wrong, self.cp_group), relayout=right.relayout)


# ---- kernel-level plants: the record's kernel tests apply them to fla's kernels -----------------


class GradReadAsContiguous(torch.autograd.Function):
    """fla #871 / #1138: identity forward; backward reads the incoming gradient's storage with
    contiguous strides (dy's strides hard-coded), wrong only when it arrives as a strided view (a
    split of a fused gradient). A kernel-level plant: the record's kernel tests apply it to fla's
    conv output (suites/fla-interpret/test_conv_backward_record.py, suites/gpu-1/test_bug_record_gpu1.py);
    the layers hand the conv contiguous gradients, so a layer carrying it would change nothing."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        if dy.is_contiguous():
            return dy
        strides = torch.empty(dy.shape, device="meta").stride()
        return torch.as_strided(dy, dy.shape, strides, dy.storage_offset())


# ---- activation recompute (class H): bugs only the checkpoint's replay exposes -------------------


def forward_with_warm_up(module, x, cu_seqlens, placement):
    """The layer's forward; its first call also all-gathers every rank's token count (a warm-up
    whose result is cached on the module): the replay skips it."""
    if not hasattr(module, "token_counts"):
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, torch.tensor([x.shape[1]]))
        module.token_counts = counts
    return module(x, cu_seqlens)


def build_with_balance_bias(config, placement, groups, dtype, device):
    module = build_layer(config, tp_group=groups[0], cp_group=groups[1], dtype=dtype, device=device)
    module.register_buffer("balance_bias", torch.zeros(config.hidden_size, dtype=dtype, device=device))
    return module


def forward_updating_balance_bias(module, x, cu_seqlens, placement):
    """The layer on x + balance_bias; the bias then moves against the tokens' mean (as a router's
    load-balancing bias moves against the load it saw): state the replay reads changed."""
    y = module(x + module.balance_bias, cu_seqlens)
    with torch.no_grad():
        module.balance_bias.sub_(0.1 * x.mean(dim=(0, 1)).sign())
    return y


def warm_up_layer(config):
    """VeOmni #1085's class: collectives the first forward issues and the replay does not."""
    return dataclasses.replace(linattn_layer(config), forward=forward_with_warm_up)


def balance_bias_layer(config):
    """NVIDIA-NeMo/Automodel #3247's class: state the forward mutates, which the replay reads."""
    return dataclasses.replace(linattn_layer(config), build=functools.partial(build_with_balance_bias, config),
                               forward=forward_updating_balance_bias)


class ContextOfTheFlattenedStream(GatedDeltaNet):
    """Megatron-LM #3282 (the layout mismatch it fixed): the framework hands each CP rank its chunks
    of every packed sequence (per-sequence zigzag), while the CP context is built as fla's
    `build_cp_context` assumes, rank r owning [r * T/cp, (r+1) * T/cp) of the flattened stream: the
    two agree for one sequence split contiguously only."""

    def _cp_context(self, cu_seqlens, total, cu_seqlens_padded=None):
        return cp.build_context(cu_seqlens, self.cp_group, "contiguous", total_tokens=total)


class DecayRateDrawnFromZero(GatedDeltaNet):
    """transformers #47842 (issue #47831): Qwen3-Next / Qwen3.5's GDN init draws A = uniform_(0, 16)
    in the parameter's dtype and stores log(A); in bf16 the draws are multiples of 1/16, so about
    1 in 256 is exactly 0 and its A_log -inf: a head that never decays and gets no gradient."""

    def _initial_value(self, name, tensor):
        if name == "A_log":
            with torch.no_grad():
                return tensor.uniform_(0.0, 16.0).log_()
        return super()._initial_value(name, tensor)
