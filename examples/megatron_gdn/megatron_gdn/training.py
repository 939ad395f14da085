"""megatron-core's training step around its GatedDeltaNet, for pytest-linattn's assert_training_parity.

What a Megatron trainer runs, each piece Megatron's own where it runs on a CPU:

    zero_grads       at a step's start, DDP's zero_grad_buffer and the optimizer's zero_grad
    the layer        wrapped in megatron.core's DistributedDataParallel (`build`): its grad
                     buffers and backward hooks accumulate every micro-batch into main_grad
    finalize_grads   megatron.core's finalize_model_grads on the DDP chunk: DDP's DP x CP
                     all-reduce of the grad buffer, then the TP all-reduce of the gradients of
                     SP-tagged (and q/k-layernorm, average_gradients_across_tp_domain) parameters;
                     then what FP32Optimizer.prepare_grads does (param.grad = param.main_grad)
    grad_norm        megatron.core.optimizer's FP32Optimizer.get_grad_norm: the gradients its
                     _filter_grads_for_norm keeps (param_is_not_shared,
                     param_is_not_tensor_parallel_duplicate, param_is_not_gtp_duplicate) through
                     clip_grads.get_grad_norm_fp32 over the model-parallel group
    clip             clip_grads.clip_grad_by_total_norm_fp32's arithmetic (its type assert cannot
                     pass on a CPU: see `clip`)

The optimizer is the harness's default AdamW, the class megatron.core.optimizer itself falls back
to without Transformer Engine or Apex (torch.optim.AdamW).

`megatron_gdn_training(packed, family)` is the ShardedLayer, `megatron_training_step(max_norm,
steps)` the TrainingStep. Every callable is module-level (the harness pickles them by reference).
"""

from __future__ import annotations

import functools

import torch

from . import client, cpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer.optimizer import FP32Optimizer
from pytest_linattn import ShardedLayer, TrainingStep

__all__ = ["PREFIX", "build", "clip", "finalize_grads", "grad_norm", "megatron_gdn_training",
           "megatron_training_step", "shard", "unshard", "zero_grads"]

# DistributedDataParallel's parameter names: the wrapped layer's, under "module."
PREFIX = "module."


def build(placement, groups, dtype, device):
    """Megatron's GDN for the placement inside Megatron's DistributedDataParallel (no bucketing,
    no overlap: DistributedDataParallelConfig's defaults)."""
    layer = client.build(placement, groups, dtype, device)
    # DDP scales each gradient by 1 / (dp x cp) before its sum over DP x CP, because Megatron's
    # schedule multiplies every CP rank's loss by cp (forward_step_calc_loss) or divides it by
    # the rank's own token count. The harness's loss instead gives every rank its part of the
    # whole micro-batch's token mean (the parts add up to the reference's loss, which the
    # harness checks), so the DP x CP reduction it needs is a plain sum: DDP's scaling factor
    # 1, which is what calculate_per_token_loss=True gives (its num_tokens division is not
    # used: finalize_grads passes num_tokens=None). cp x then / cp: exact in binary floats.
    layer.config.calculate_per_token_loss = True
    return DistributedDataParallel(layer.config, DistributedDataParallelConfig(), layer)


def shard(full, placement, tp_rank, family="qwen3_5"):
    return {PREFIX + n: t for n, t in client.shard(full, placement, tp_rank, family).items()}


def unshard(local, placement, family="qwen3_5"):
    return client.unshard([{n.removeprefix(PREFIX): t for n, t in d.items()} for d in local], placement, family)


def finalize_grads(ddp, placement, groups):
    """Megatron's finalize_model_grads([ddp]), then the gradients the optimizer steps with."""
    finalize_model_grads([ddp])
    for q in ddp.parameters():
        if q.requires_grad:
            # FP32Optimizer.prepare_grads sets param.grad = param.main_grad (a view of DDP's
            # buffer); a copy here, because the buffer is zeroed next
            q.grad = q.main_grad.clone()


def zero_grads(ddp, optimizer):
    """What Megatron's train_step does before a step's micro-batches: DDP's grad buffers (the
    main_grads its hooks accumulate into) zeroed, then the optimizer's gradients."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)


def grad_norm(ddp, placement, groups):
    """Megatron's optimizer's gradient norm (FP32Optimizer.get_grad_norm) over the layer's
    parameters: the same number on every rank. Summed in float32 by get_grad_norm_fp32, as on
    a GPU (1e-8 to 3e-8 off the float64 reference's here)."""
    params = [q for q in ddp.parameters() if q.requires_grad]
    with cpu.cuda_tensors_on_cpu():
        # a throwaway SGD only carries the param_groups Megatron reads; it never steps
        optimizer = FP32Optimizer(torch.optim.SGD(params, lr=0.0), OptimizerConfig(), init_state_fn=None)
        norm = optimizer.get_grad_norm()
    return torch.tensor(float(norm), dtype=torch.float64)


def clip(params, max_norm, total_norm):
    """clip_grad_by_total_norm_fp32's body past its first line, with Megatron's own scaling op.

    Its first line, `assert param.grad.type() == 'torch.cuda.FloatTensor'` for every parameter,
    cannot pass on a CPU (a CPU gradient's type is torch.FloatTensor or torch.DoubleTensor; it
    would not pass for these float64 gradients on a GPU either: Megatron clips fp32 main grads
    only). The rest, copied from megatron-core 0.19.2: the coefficient max_norm / (norm + 1e-6),
    applied when under 1 by clip_grads' multi_tensor_scale (its local fallback without TE / Apex).
    """
    grads = [q.grad.detach() for q in params if q.grad is not None]
    clip_coeff = max_norm / (float(total_norm) + 1.0e-6)
    if clip_coeff < 1.0:
        dummy_overflow_buf = torch.zeros(1, dtype=torch.int)
        clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads],
                                        clip_coeff)


def megatron_gdn_training(packed: bool, family: str = "qwen3_5") -> ShardedLayer:
    """The DDP-wrapped GDN for assert_training_parity (no after_backward: DDP's hooks accumulate,
    finalize_grads reduces once per step)."""
    return ShardedLayer(build=build, process_groups=client.process_groups,
                        shard=functools.partial(shard, family=family),
                        unshard=functools.partial(unshard, family=family),
                        replicated=frozenset(PREFIX + n for n in client.REPLICATED),
                        forward=client.forward_packed if packed else client.forward_unpacked)


def megatron_training_step(max_norm: float, steps: int = 2, zero=zero_grads) -> TrainingStep:
    """Megatron's zeroing, finalize, gradient norm and clipping around the harness's AdamW."""
    return TrainingStep(steps=steps, max_norm=max_norm, finalize_grads=finalize_grads, grad_norm=grad_norm,
                        clip=clip, zero_grads=zero)
