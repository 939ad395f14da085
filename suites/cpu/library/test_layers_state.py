"""The state path of the project's layers: chunked prefill and decode against one full forward.

Every family's layer, its packed sequences cut into chunks (a 1-token first chunk, W-1, W, the
reference kernel's chunk size 64 and its neighbours, a 1-token chunk mid-sequence, random cuts)
and then decoded token by token, each call from the state the previous one left, at TP 2/4
(heads and their state sharded as engines shard them) and CP 2/4 (a continued prefill across the
ranks), in float64 (<= 1e-10): every token's output, the final conv and recurrent states, the
input gradients and the initial states' gradients against one full forward of the replicated
layer from the same random initial states (`pytest_linattn.assert_continuation_parity`).

Planted bugs (wrappers around the layer, defined here) must fail the same check, each with a
report naming the sequence, its cuts and the token where it goes wrong.
"""

import functools

import pytest
import torch

from cases.layer_parity import FAMILIES, linattn_state_path, make_config, random_state_dict
from linattn.layers import LayerState, build_layer
from linattn.layers import shard_layer_state as _layer_state_shard
from linattn.layers import unshard_layer_state as _layer_state_unshard
from linattn.reference.delta_rule import CHUNK_SIZE
from pytest_linattn.harness import Placement, assert_continuation_parity
from pytest_linattn.parity import capture_records

# plan_cuts' recipes by sequence: 1+3+65+1 (then 2 decode steps), 4+63+1, 38, 3+r+r
SEQLENS = (72, 70, 40, 9)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
RTOL = 1e-10


@functools.lru_cache(maxsize=8)
def replicated(config, seed):
    layer = build_layer(config, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(config, seed))
    return layer


def check(spawn, config, placement, seed, path=None, dtype=torch.float64, rtol=RTOL):
    assert_continuation_parity(spawn, path or linattn_state_path(config), replicated(config, seed), [placement], CU,
                               hidden_size=config.hidden_size, seed=seed, rtol=rtol, conv_width=config.conv_size,
                               chunk_size=CHUNK_SIZE, dtype=dtype, name=config.family)


@pytest.mark.tp_sizes(2, 4)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_continuation_matches_full_forward(spawn, tp_size, family):
    check(spawn, make_config(family, 2), Placement(tp=tp_size), seed=10 + FAMILIES.index(family))


@pytest.mark.cp_sizes(2, 4)
@pytest.mark.parametrize("family", FAMILIES)
def test_cp_continued_prefill_matches_full_forward(spawn, cp_size, family):
    check(spawn, make_config(family, 1), Placement(cp=cp_size), seed=20 + FAMILIES.index(family))


@pytest.mark.parametrize("placement", [Placement(tp=2), Placement(cp=2)], ids=["tp2", "cp2"])
def test_float32_continuation_matches_float64_full_forward(spawn, placement):
    # the ranks' layer in float32 from the check's float64 inputs, states and weights (the GPU
    # suite runs the same in bf16): each cast a leaf of its own
    check(spawn, make_config("kda", 2), placement, seed=40, dtype=torch.float32, rtol=1e-5)


# ---- planted bugs: wrappers around the layer's calls (module-level: the ranks get them by reference) ----


def _rows_where(mask, rows, other):
    """`rows` `[N, ...]` with the rows where `mask` `[N]` holds replaced by `other`'s."""
    return torch.where(mask.view(-1, *[1] * (rows.dim() - 1)), other, rows)


def prefill_restarting_multi_token_chunks(module, x, cu_seqlens, state, placement):
    """transformers <= 5.6.0 (#45513): a multi-token chunk with a populated cache restarts from zero."""
    multi = (cu_seqlens.diff() > 1).to(x.device)
    state = LayerState(*(_rows_where(multi, s, torch.zeros_like(s)) for s in state))
    return module(x, cu_seqlens, state, output_final_state=True)


def prefill_dropping_the_oldest_conv_column(module, x, cu_seqlens, state, placement):
    """A conv cache one column short: the oldest of its W-1 inputs is not kept (zero)."""
    y, new = module(x, cu_seqlens, state, output_final_state=True)
    conv = torch.cat([torch.zeros_like(new.conv[..., :1]), new.conv[..., 1:]], dim=-1)
    return y, LayerState(conv, new.recurrent)


def prefill_reading_a_stale_state_for_1_token_chunks(module, x, cu_seqlens, state, placement):
    """vLLM #51483: a 1-token chunk taken for a decode reads a state slot that is not its own
    (here the previous sequence's of the call, a stale one)."""
    single = (cu_seqlens.diff() == 1).to(x.device)
    state = LayerState(*(_rows_where(single, s, s.roll(1, dims=0)) for s in state))
    return module(x, cu_seqlens, state, output_final_state=True)


def shard_state_in_reversed_rank_order(config, state, placement, tp_rank):
    """TP rank t gets the state of rank tp-1-t's heads (and gives it back there): a state laid out
    in another head order than the weights."""
    return _layer_state_shard(state, config, placement.tp - 1 - tp_rank, placement.tp)


def unshard_state_in_reversed_rank_order(config, states, placement):
    return _layer_state_unshard(list(reversed(states)), config)


def planted(config, bug):
    if bug == "reversed-tp-state":
        return linattn_state_path(config, shard_state=functools.partial(shard_state_in_reversed_rank_order, config),
                                  unshard_state=functools.partial(unshard_state_in_reversed_rank_order, config))
    prefill = {"restart": prefill_restarting_multi_token_chunks, "conv-short": prefill_dropping_the_oldest_conv_column,
               "stale-1-token": prefill_reading_a_stale_state_for_1_token_chunks}[bug]
    return linattn_state_path(config, prefill=prefill)


SEQ0 = "sequence 0 (chunks 1+3+65+1, then 2 decode steps)"
SEQ1 = "sequence 1 (chunks 4+63+1, then 2 decode steps)"
PLANTS = {
    # every multi-token chunk restarts: the first is sequence 1's first chunk, from its initial state
    "restart": f"first wrong token: {SEQ1}, chunk 1 of 3 (tokens 0..3, a 4-token chunk from the initial state), "
               "token 0",
    # the 1-token first chunk is right (its state comes from the check); the chunk after it reads
    # the column that was dropped
    "conv-short": f"first wrong token: {SEQ0}, chunk 2 of 4 (tokens 1..3, a 3-token chunk from the state after "
                  "token 0), token 1",
    "stale-1-token": f"first wrong token: {SEQ0}, chunk 1 of 4 (tokens 0..0, a 1-token chunk from the initial "
                     "state), token 0",
    "reversed-tp-state": f"first wrong token: {SEQ0}, chunk 1 of 4 (tokens 0..0, a 1-token chunk from the initial "
                         "state), token 0",
}


@pytest.mark.tp_sizes(2)
@pytest.mark.parametrize("bug", PLANTS)
def test_planted_state_bug_is_caught(spawn, tp_size, bug):
    config = make_config("qwen3_5", 2)
    with capture_records(), pytest.raises(AssertionError) as info:
        check(spawn, config, Placement(tp=tp_size), seed=30, path=planted(config, bug))
    assert PLANTS[bug] in str(info.value), str(info.value)


# ---- single-process rules ----------------------------------------------------------------------


def test_no_state_passed_changes_nothing_and_a_split_conv_equals_one():
    from linattn import kernels, reference

    config = make_config("kda", 2)
    layer = replicated(config, 5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, int(CU[-1]), config.hidden_size, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(layer(x, CU), layer(x, CU, None, output_final_state=True)[0])
    # the reference conv from a state equals one conv over (state, tokens); the kernel entry's
    # recurrent mode equals its chunked one
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    seq = torch.randn(1, 11, 6, generator=gen, dtype=torch.float64)
    y_full, s_full = reference.short_conv(seq, w, output_final_state=True)
    y1, s1 = reference.short_conv(seq[:, :2], w, output_final_state=True)
    y2, s2 = reference.short_conv(seq[:, 2:], w, initial_state=s1, output_final_state=True)
    assert torch.allclose(torch.cat([y1, y2], 1), y_full, rtol=0, atol=1e-14) and torch.equal(s2, s_full)
    q, k = (torch.randn(1, 9, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    v, beta = torch.randn(1, 9, 2, 3, generator=gen, dtype=torch.float64), torch.rand(1, 9, 2, dtype=torch.float64)
    g = -torch.rand(1, 9, 2, dtype=torch.float64)
    h0 = torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64)
    chunk = kernels.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    step = kernels.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, mode="recurrent")
    for a, b in zip(chunk, step):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_bad_states_are_refused_naming_the_rule():
    from linattn.parallel import cp

    config = make_config("qwen3_5", 1)
    layer = replicated(config, 5)
    x = torch.zeros(1, int(CU[-1]), config.hidden_size, dtype=torch.float64)
    good = LayerState(torch.zeros(4, config.conv_dim, 3, dtype=torch.float64),
                      torch.zeros(4, config.num_v_heads, config.head_k_dim, config.head_v_dim, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"state.conv must be a floating-point tensor of shape \(4, 88, 3\)"):
        layer(x, CU, LayerState(good.conv[..., :2], good.recurrent))
    with pytest.raises(ValueError, match=r"state.recurrent must be .* \(one row per sequence\)"):
        layer(x, CU, LayerState(good.conv, good.recurrent[:3]))
    ctx = cp.build_context(CU, None, cp_rank=0, cp_size=1)
    with pytest.raises(ValueError, match="backend 'fla' takes no initial state"):
        cp.delta_rule(*(torch.zeros(1, int(CU[-1]), 1, 2) for _ in range(3)), torch.zeros(1, int(CU[-1]), 1),
                      torch.zeros(1, int(CU[-1]), 1), op="gated_delta_rule", backend="fla", cp_context=ctx,
                      output_final_state=True)
    with pytest.raises(ValueError, match="mode must be one of"):
        from linattn import kernels
        kernels.kda(*(torch.zeros(1, 2, 1, 2) for _ in range(4)), torch.zeros(1, 2, 1), mode="fused")


def test_continuation_check_refuses_plans_that_do_not_cover_the_sequences(spawn):
    from pytest_linattn.harness import SequencePlan

    config = make_config("qwen3_5", 1)
    with pytest.raises(ValueError, match=r"plans\[1\] covers 5 tokens"):
        assert_continuation_parity(spawn, linattn_state_path(config), replicated(config, 5), [Placement()], CU,
                                   hidden_size=config.hidden_size, seed=0, rtol=RTOL, conv_width=4,
                                   plans=[SequencePlan((70,), 2), SequencePlan((3,), 2), SequencePlan((38,), 2),
                                          SequencePlan((7,), 2)])
    with pytest.raises(ValueError, match="contiguous CP without sequence parallel"):
        check(spawn, config, Placement(cp=2, cp_layout="zigzag"), seed=0)
