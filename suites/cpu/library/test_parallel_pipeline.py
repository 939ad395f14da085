"""linattn.parallel's pipeline pieces: the pipeline groups (stages outermost, Megatron order) and the
hand-offs between stages as autograd functions (`linattn.parallel.pipeline`), over gloo."""

import pytest
import torch

from linattn.parallel import new_pipeline_group, parallel_rank_lists, pipeline_rank_lists


def test_pipeline_groups_hold_one_rank_per_stage_with_tp_and_cp_inside_a_stage():
    # 8 ranks, TP 2 x CP 2 x PP 2: stage 0 is ranks 0..3, stage 1 ranks 4..7
    assert pipeline_rank_lists(8, 2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    tp, cp = parallel_rank_lists(8, 2, 2)  # the leftover axis holds the stages: every group inside one
    assert all(max(g) < 4 or min(g) >= 4 for g in tp + cp)
    assert pipeline_rank_lists(4, 1, 1, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match=r"tp_size \* cp_size \* pp_size must tile the world: 2 \* 1 \* 2 = 4 does "
                                         r"not divide world_size 6"):
        pipeline_rank_lists(6, 2, 1, 2)
    with pytest.raises(ValueError, match="pp_size must be a positive int"):
        pipeline_rank_lists(4, 1, 1, 0)


def hand_off_and_back():
    """Stage 0: y = 2x sent on; stage 1: z = 3 * (what it received), loss sum(z * z). Returns
    (stage 0: x's gradient | stage 1: what it received and its gradient, and the message of the
    hand-off a stage has no neighbour for)."""
    from linattn.parallel.pipeline import pipeline_stage, receive_from_previous_stage, send_to_next_stage

    group = new_pipeline_group(1, 1, 2)
    stage = pipeline_stage(group)
    x = torch.arange(6, dtype=torch.float64).reshape(1, 3, 2).requires_grad_()
    try:  # no collective: the stage is checked first
        if stage:
            send_to_next_stage(x, group)
        else:
            receive_from_previous_stage((1, 3, 2), torch.float64, "cpu", group)
        message = ""
    except ValueError as exc:
        message = str(exc)
    if stage == 0:
        send_to_next_stage(2 * x, group).backward()
        return x.grad, message
    received = receive_from_previous_stage((1, 3, 2), torch.float64, "cpu", group)
    z = 3 * received
    (z * z).sum().backward()
    return received.detach(), received.grad, message


def test_hand_offs_carry_activations_forward_and_gradients_back(spawn):
    (dx, first), (received, grad, last) = spawn(hand_off_and_back, 2)
    x = torch.arange(6, dtype=torch.float64).reshape(1, 3, 2)
    assert torch.equal(received, 2 * x)
    assert torch.equal(grad, 18 * received)  # d/dy of sum((3y)^2)
    assert torch.equal(dx, 2 * grad)
    assert first == ("receive_from_previous_stage: stage 0 is the first of 2 stage(s) (pp_group), it has no previous "
                     "stage")
    assert last == "send_to_next_stage: stage 1 is the last of 2 stage(s) (pp_group), it has no next stage"
