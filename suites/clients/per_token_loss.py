"""A trainer whose loss step follows megatron-core's per-token-loss contract, for
`assert_training_parity` (the loss step of a `TrainingStep`), written as Megatron-Bridge runs it
under CP (verl #6609).

megatron-core's `forward_step_calc_loss` (pipeline_parallel/schedules.py, 0.19.2) reads the loss
function's output by its length:

    (loss, num_tokens, metrics)  with calculate_per_token_loss: the loss is a token sum; the
                                 schedule leaves it as it is, and finalize_model_grads divides the
                                 gradients by num_tokens summed over the micro-batches and the
                                 DP x CP ranks. Without it: divided by num_tokens and the
                                 micro-batch count at once.
    (loss, metrics)              the legacy shape: the loss as the loss function normalised it,
                                 averaged over the micro-batches. No num_tokens is counted: with
                                 calculate_per_token_loss, finalize_model_grads gets 0 tokens and
                                 divides by clamp(0, min=1) = 1, i.e. not at all.

Megatron-Bridge turns calculate_per_token_loss on under CP. Here `per_token_loss_step` does the
same: per-token where the rank holds part of the micro-batch's tokens (`y` holds fewer than
`tokens`). The per-token division is made in the loss step, not after the reduction: the harness
compares the loss the ranks backward, and its reduction (finalize_grads) is a plain sum over CP.
The step's token count (every rank's num_tokens over the step's micro-batches) is the harness's
`tokens` per micro-batch times the micro-batches.

The loss function is `loss_func(y, dy, per_token)`. `loss_with_token_count` is the contract as
verl's Megatron engine keeps it since verl #6836.
"""

from __future__ import annotations

import functools

from pytest_linattn.harness import TrainingStep

__all__ = ["loss_with_token_count", "per_token_loss_step", "per_token_training_step"]


def per_token_loss_step(loss_func, y, dy, tokens, micro_batches):
    """The trainer's loss step (TrainingStep.loss, with `loss_func` bound): the part this rank
    backwards for one micro-batch, normalised as megatron-core normalises the loss function's
    output (see the module)."""
    per_token = y.shape[1] < tokens  # the rank holds part of the micro-batch: CP, per-token loss
    outputs = loss_func(y, dy, per_token)
    if len(outputs) == 2:  # legacy: normalised by the loss function, averaged over the micro-batches
        loss, _ = outputs
        return loss / micro_batches
    loss, num_tokens, _ = outputs
    if per_token:  # what finalize_model_grads divides by: the step's tokens, every rank's
        return loss / (tokens * micro_batches)
    return loss / num_tokens / micro_batches


def loss_with_token_count(y, dy, per_token):
    """The client's loss function: under per-token loss (token sum, this rank's token count,
    metrics), otherwise (token mean, metrics). The loss is sum(y * dy) over the tokens, the
    harness's own."""
    loss_sum = (y * dy).sum()
    if per_token:
        return loss_sum, y.shape[1], {"loss_sum": loss_sum.detach()}
    loss = loss_sum / y.shape[1]
    return loss, {"loss": loss.detach()}


def per_token_training_step(loss_func=loss_with_token_count, **fields) -> TrainingStep:
    """A TrainingStep whose loss step is `per_token_loss_step` over `loss_func`; fields: the rest."""
    return TrainingStep(loss=functools.partial(per_token_loss_step, loss_func), **fields)
