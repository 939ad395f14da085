"""The continuation check (`pytest_linattn.assert_continuation_parity`) from a client's side:
what a stateful client may declare (no `unshard`, plans without `conv_width`, a decode laid out
`[N, 1, hidden]`, a state field the full forward never reads), and what a report says when the
client is wrong (every failing placement; a gradient located by the call whose backward goes
wrong; the CP gradient rule when only the gradients fail under CP) or when the case cannot see
its state (a warning).

The client is linattn's layer (`cases.layer_parity.linattn_state_path`) through wrappers defined here
(module-level: the ranks get them by reference), on a small packing so each check takes seconds.
"""

import dataclasses
import functools
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from cases.layer_parity import linattn_layer, linattn_state_path, make_config, random_state_dict
from linattn.layers import LayerState, build_layer
from linattn.parallel.cp.comm import all_gather_from_cp_ranks
from pytest_linattn.harness import (ParityCase, Placement, SequencePlan, ShardedLayer, StateInvisibleWarning,
                                    StatePath, assert_continuation_parity)
from pytest_linattn.parity import capture_records

SEQLENS = (10, 7, 5)  # default plans (W 4, chunk 4): 1+3+4, 4+1, 3, each then 2 decode steps
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
RTOL = 1e-10
CONFIG = make_config("qwen3_5", 1)


def reference(config=CONFIG, seed=3, **weights):
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict({**random_state_dict(config, seed), **weights})
    return layer


def check(spawn, path, placements, ref=None, **options):
    options = {"conv_width": CONFIG.conv_size, "chunk_size": 4, **options}
    with capture_records():
        assert_continuation_parity(spawn, path, ref if ref is not None else reference(), placements, CU,
                                   hidden_size=CONFIG.hidden_size, seed=7, rtol=RTOL, **options)


# ---- a state field the full forward never reads --------------------------------------------------


class StateWithLastInput(NamedTuple):
    """linattn's state plus each sequence's last input token: written by every call, never read."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    last_input: torch.Tensor


def forward_keeping_the_last_input(module, x, cu_seqlens, state):
    inner = None if state is None else LayerState(state.conv, state.recurrent)
    y, new = module(x, cu_seqlens, inner, output_final_state=True)
    return y, StateWithLastInput(new.conv, new.recurrent, x[0, cu_seqlens[1:].long() - 1])


def prefill_keeping_the_last_input(module, x, cu_seqlens, state, placement):
    return forward_keeping_the_last_input(module, x, cu_seqlens, state)


def decode_keeping_the_last_input(module, x, state, placement):
    y, new = module.step(x, LayerState(state.conv, state.recurrent))
    return y, StateWithLastInput(new.conv, new.recurrent, x[0])


def test_state_field_without_a_gradient_in_the_full_forward_gets_a_zero_one(spawn):
    path = StatePath(linattn_layer(CONFIG), prefill=prefill_keeping_the_last_input,
                     decode=decode_keeping_the_last_input)
    with warnings.catch_warnings():  # a field the forward never reads carries nothing to restart: no warning
        warnings.simplefilter("error", StateInvisibleWarning)
        check(spawn, path, [Placement()], reference_forward=forward_keeping_the_last_input)


# ---- a ShardedLayer without unshard --------------------------------------------------------------


def test_continuation_check_needs_no_unshard_and_the_parity_harness_names_it(spawn):
    layer = dataclasses.replace(linattn_layer(CONFIG), unshard=None)
    check(spawn, dataclasses.replace(linattn_state_path(CONFIG), layer=layer), [Placement(tp=2)])
    x = torch.randn(1, int(CU[-1]), CONFIG.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"ShardedLayer.unshard is required by the parity harness"):
        ParityCase(layer, Placement(tp=2), reference(), CU, x, x.clone(), RTOL)
    with pytest.raises(ValueError, match=r"ShardedLayer.shard is required"):
        ShardedLayer(linattn_layer(CONFIG).build)


# ---- plans without conv_width; a decode laid out [N, 1, hidden] ----------------------------------


def test_own_plans_need_no_conv_width_and_the_default_plans_name_it(spawn):
    plans = [SequencePlan((2, 7), 1), SequencePlan((7,), 0), SequencePlan((1, 1, 2), 1)]
    with capture_records():
        assert_continuation_parity(spawn, linattn_state_path(CONFIG), reference(), [Placement()], CU,
                                   hidden_size=CONFIG.hidden_size, seed=7, rtol=RTOL, plans=plans)
    with pytest.raises(ValueError, match="conv_width is required unless plans= gives the cuts"):
        assert_continuation_parity(spawn, linattn_state_path(CONFIG), reference(), [Placement()], CU,
                                   hidden_size=CONFIG.hidden_size, seed=7, rtol=RTOL)


def decode_one_row_per_sequence(module, x, state, placement):
    """A decode taking `[N, 1, hidden]` (fla's and transformers' layout) over linattn's step."""
    if x.shape[1] != 1:
        raise ValueError(f"decode takes [N, 1, hidden], got {tuple(x.shape)}")
    y, new = module.step(x.transpose(0, 1), state)
    return y.transpose(0, 1), new


def test_decode_laid_out_one_row_per_sequence_is_accepted_when_declared(spawn):
    check(spawn, linattn_state_path(CONFIG, decode=decode_one_row_per_sequence, decode_layout="batched"),
          [Placement(tp=2)])
    with pytest.raises(ValueError, match=r"StatePath.decode_layout must be one of \['batched', 'packed'\]"):
        linattn_state_path(CONFIG, decode_layout="N1")


# ---- every failing placement reported ------------------------------------------------------------


def prefill_restarting_multi_token_chunks(module, x, cu_seqlens, state, placement):
    """transformers <= 5.6.0 (#45513): a multi-token chunk restarts from zero."""
    multi = (cu_seqlens.diff() > 1).to(x.device).view(-1, 1, 1, 1)
    recurrent = torch.where(multi, torch.zeros_like(state.recurrent), state.recurrent)
    return module(x, cu_seqlens, LayerState(state.conv, recurrent), output_final_state=True)


def test_every_failing_placement_is_reported(spawn):
    path = linattn_state_path(CONFIG, prefill=prefill_restarting_multi_token_chunks)
    with pytest.raises(AssertionError) as info:
        check(spawn, path, [Placement(), Placement(tp=2)])
    report = str(info.value)
    assert report.startswith("continuation parity failed at 2 of 2 placement(s): replicated, tp2"), report
    for label in ("replicated/seed7", "tp2/seed7"):
        assert f"continuation parity failed for {label}" in report, report


# ---- gradients located by the backward -----------------------------------------------------------


def decode_halving_the_state_gradient(module, x, state, placement):
    """The decode's new state is right, its gradient reaches the step halved."""
    y, new = module.step(x, state)
    return y, LayerState(*(0.5 * s + 0.5 * s.detach() for s in new))


def test_wrong_decode_gradient_is_located_at_the_decode_step(spawn):
    with pytest.raises(AssertionError) as info:
        check(spawn, linattn_state_path(CONFIG, decode=decode_halving_the_state_gradient), [Placement()])
    report = str(info.value)
    assert "output" not in report.split("failing check(s)")[1].split("parity failed for")[1], report  # outputs pass
    assert ("first call whose backward is wrong (the backward runs the last call first; every earlier token inherits "
            "its error): sequence 0 (chunks 1+3+4, then 2 decode steps), decode step 2 of 2 (token 9)") in report, report


def decode_from_half_the_recurrent_state(module, x, state, placement):
    """The decode step reads its recurrent state halved; the prefill calls are right."""
    return module.step(x, LayerState(state.conv, 0.5 * state.recurrent))


def test_a_bug_of_the_decode_step_alone_is_told_so(spawn):
    # every wrong token is in a decode step: the report says every prefill chunk is right (the first wrong
    # token is the first decoded one of the shortest prefill, sequence 2's token 3)
    with pytest.raises(AssertionError) as info:
        check(spawn, linattn_state_path(CONFIG, decode=decode_from_half_the_recurrent_state), [Placement()])
    report = str(info.value)
    assert ("first wrong token: sequence 2 (chunks 3, then 2 decode steps), decode step 1 of 2 (token 3), "
            "error ") in report, report
    assert ("of the tokens' RMS norm; sequences with a wrong token: [0, 1, 2]; only decode steps hold a wrong token: "
            "every prefill chunk is right\n") in report, report
    # a prefill bug's wrong tokens start in a prefill chunk: no such words
    with pytest.raises(AssertionError) as info:
        check(spawn, linattn_state_path(CONFIG, prefill=prefill_restarting_the_recurrent_state), [Placement()])
    assert "first wrong token: " in str(info.value) and "only decode steps" not in str(info.value), str(info.value)


# ---- the CP gradient rule --------------------------------------------------------------------------


def build_redundant_over_cp(config, placement, groups, dtype, device):
    """linattn's layer without CP; its prefill below runs every CP rank's tokens on every rank."""
    tp_group, cp_group = groups
    module = build_layer(config, tp_group=tp_group, dtype=dtype, device=device)
    module.gather_group = cp_group
    return module


def prefill_redundant_over_cp(module, x, cu_seqlens, state, placement):
    """Every CP rank gathers the call's tokens and computes the whole call, final states included:
    their gradient, handed whole to every rank, is counted cp times."""
    pieces = all_gather_from_cp_ranks(x[0], module.gather_group)
    y, new = module(pieces.reshape(1, -1, x.shape[-1]), cu_seqlens, state, output_final_state=True)
    rank, n = dist.get_rank(module.gather_group), x.shape[1]
    return y[:, rank * n:(rank + 1) * n], new


def test_cp_client_with_redundant_final_states_is_told_the_gradient_rule(spawn):
    layer = dataclasses.replace(linattn_layer(CONFIG), build=functools.partial(build_redundant_over_cp, CONFIG))
    path = dataclasses.replace(linattn_state_path(CONFIG), layer=layer, prefill=prefill_redundant_over_cp)
    with pytest.raises(AssertionError) as info:
        check(spawn, path, [Placement(), Placement(cp=2)])
    report = str(info.value)
    assert report.startswith("continuation parity failed at 1 of 2 placement(s): cp2-contiguous "
                             "(passed: replicated)"), report
    assert ("under CP the outputs and final states match and only the gradients (dh0, dx) are off: check the CP "
            "gradient rule: a prefill call's final states take a gradient that is whole on every CP rank") in report
    assert "computes the final states redundantly on every CP rank" in report, report


# ---- a case that cannot see its state --------------------------------------------------------------


def prefill_restarting_the_recurrent_state(module, x, cu_seqlens, state, placement):
    return module(x, cu_seqlens, LayerState(state.conv, torch.zeros_like(state.recurrent)), output_final_state=True)


def test_state_decaying_within_a_token_is_warned_about(spawn):
    # A = 4e4: the recurrent state is gone after one token, so the restart below passes unseen
    fast = reference(A_log=torch.full((CONFIG.num_v_heads,), 4e4, dtype=torch.float64).log())
    restart = linattn_state_path(CONFIG, prefill=prefill_restarting_the_recurrent_state)
    with pytest.warns(StateInvisibleWarning, match=r"the outputs barely see the initial state's field 'recurrent': "
                                                   r"negating it moves them by .* \(rtol 1e-10\)"):
        check(spawn, restart, [Placement()], ref=fast)
    with warnings.catch_warnings():  # the project's decay: the state is seen, and the restart caught
        warnings.simplefilter("error", StateInvisibleWarning)
        with pytest.raises(AssertionError, match="first wrong token"):
            check(spawn, restart, [Placement()])
