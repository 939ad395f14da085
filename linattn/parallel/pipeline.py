"""Point-to-point hand-offs between pipeline stages, as autograd functions (Megatron's p2p).

A stage's activations go to the next stage forward and their gradient comes back backward:

    send_to_next_stage           fwd send x to the next stage       bwd receive x's gradient from it
    receive_from_previous_stage  fwd receive the previous stage's   bwd send the gradient back to it
                                 activations

`pp_group` is a pipeline group (`linattn.parallel.new_pipeline_group`): one rank per stage, in stage
order; this rank's index in it is its stage. A group of None (no pipeline) makes a hand-off an error:
there is no other stage. The two ends of a hand-off must agree on its shape and dtype (the receiver
allocates it), as Megatron's tensor_shape does.

One stage's step:

    x = receive_from_previous_stage(shape, dtype, device, pp_group)   # the first stage: its input
    y = stage(x)
    if last stage:  loss(y).backward()                                # x's gradient goes back
    else:           send_to_next_stage(y, pp_group).backward()        # waits for y's gradient

Without grad (a decode step) both are plain sends and receives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import group_rank, group_size

__all__ = ["is_first_stage", "is_last_stage", "pipeline_stage", "receive_from_previous_stage", "send_to_next_stage"]


def pipeline_stage(pp_group) -> int:
    """This rank's stage: its index in `pp_group` (0 for None)."""
    return group_rank(pp_group)


def is_first_stage(pp_group) -> bool:
    return pipeline_stage(pp_group) == 0


def is_last_stage(pp_group) -> bool:
    return pipeline_stage(pp_group) == group_size(pp_group) - 1


def _neighbour(pp_group, step: int, what: str) -> int:
    """The global rank of the stage `step` away (+1 next, -1 previous); ValueError where none is."""
    stage, size = pipeline_stage(pp_group), group_size(pp_group)
    if not 0 <= stage + step < size:
        where = "the last" if step > 0 else "the first"
        raise ValueError(f"{what}: stage {stage} is {where} of {size} stage(s) (pp_group), it has no "
                         f"{'next' if step > 0 else 'previous'} stage")
    return dist.get_global_rank(pp_group, stage + step)


class _SendToNextStage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pp_group):
        ctx.pp_group, ctx.shape, ctx.dtype, ctx.device = pp_group, x.shape, x.dtype, x.device
        dist.send(x.detach().contiguous(), dst=_neighbour(pp_group, 1, "send_to_next_stage"))
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        dist.recv(grad, src=_neighbour(ctx.pp_group, 1, "send_to_next_stage (backward)"))
        return grad, None


def send_to_next_stage(x: torch.Tensor, pp_group) -> torch.Tensor:
    """Send `x` to the next stage. Returns a 0-dim zero joined to x's graph (where x has one):
    its `.backward()` receives x's gradient from the next stage and runs this stage's backward
    from it."""
    if not x.requires_grad or not torch.is_grad_enabled():
        dist.send(x.detach().contiguous(), dst=_neighbour(pp_group, 1, "send_to_next_stage"))
        return x.new_zeros(())
    return _SendToNextStage.apply(x, pp_group)


def receive_from_previous_stage(shape, dtype: torch.dtype, device, pp_group) -> torch.Tensor:
    """The previous stage's activations, `shape` and `dtype` as it sent them. Under grad a leaf
    that requires grad: when backward reaches it, its gradient is sent back to the previous stage
    (which waits for it in the backward of its `send_to_next_stage`)."""
    x = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(x, src=_neighbour(pp_group, -1, "receive_from_previous_stage"))
    if torch.is_grad_enabled():
        previous = _neighbour(pp_group, -1, "receive_from_previous_stage (backward)")
        x.requires_grad_()
        x.register_hook(lambda grad: dist.send(grad.contiguous(), dst=previous))
    return x
