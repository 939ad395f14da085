"""Context-parallel layers (gloo, CPU) against the replicated layer on the same weights.

Each family, in one spawn call per (family, cp_size): CP = cp_size in the contiguous and the
zigzag layout, in float64 (<= 1e-10) plus one float32 case (<= 1e-5); and TP x CP = 2 x 2 on four
ranks, sequence parallel on and off. Compared, by the public harness (pytest_linattn.harness,
which lays the tokens out itself): the output and the input gradient, and every parameter gradient
(summed over the CP group: the layer leaves them per-rank partial sums, for the training loop's
data x context all-reduce).

Coverage: packings by name (CP_PACKINGS, TP_CP_PACKINGS); a piece is one rank's T / cp tokens
(zigzag: after the relayout into the contiguous layout); the conv halo is W-1 = 3 tokens.

    feature                                    cp 2                           cp 4
    length-1 sequence                          edge+len1, cross+inside        span3+edge+len1
    boundary inside a piece                    edge+len1, cross+inside        span3+edge+len1
    boundary exactly on a piece edge           edge+len1, zz-edge             span3+edge+len1, zz
    sequence crossing a piece edge             cross+inside, tiny-pieces, zz  span3+edge+len1, tiny-pieces, zz
    sequence over >= 3 pieces (state relayed)  - (2 pieces)                   span3+edge+len1 (3), tiny-pieces (4)
    pieces < W-1, halo from the previous rank  tiny-pieces (T=4: 2-token      tiny-pieces (rank 1)
                                               pieces, a 1-token halo)
    pieces < W-1, halo from 2 ranks back       - (needs cp >= 3)              tiny-pieces (ranks 2 and 3)
    float32                                    cross+inside                   span3+edge+len1
    seeded random packing (packed_seqlens)     contiguous, zigzag             contiguous, zigzag
    fragment tables (fragment_seqlens):        uneven-pieces, empty-document, document-per-rank
      every family, contiguous; empty          (contiguous), empty-document (zigzag)
      documents in zigzag too
    TP x CP (tp 2): SP off / on                edge+len1, cross+len1, zz /    - (8 ranks)
                                               cross+len1, zz, float32
    gradients by autograd.grad, inputs=        contiguous, zigzag             contiguous, zigzag

The CP op tests (test_cp_ops.py) add 1-token pieces (cp 2: T=2; cp 4: a halo from 3 ranks back)
and, at cp 2, a halo that is the previous rank's whole 2-token piece (T=4).

    variant (make_config ratio)                cp 2                  cp 4                 TP x CP
    GVA 1 (KDA: bounded gate, low-rank         float32, zz-edge      float32, zz          edge+len1, zz SP
           output gate)
    GVA 2 (KDA: bounded gate, full-rank)       edge+len1, tiny,      span3, random        cross SP, zz
                                               random contiguous     contiguous
    GVA 3 (KDA: unbounded gate, low-rank)      cross+inside, zz,     tiny, random zigzag  cross, float32 SP
                                               random zigzag
"""

import pytest
import torch
import torch.distributed as dist

from cases.layer_parity import FAMILIES, assert_rules, error_of, make_case, make_config, random_state_dict
from linattn.layers import LayerState, build_layer
from linattn.parallel import new_groups
from pytest_linattn.harness import Placement, assert_parity_cases, rank_token_index
from pytest_linattn.seqlens import FRAGMENTS

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}

# (layout, name, lengths, head ratio, dtype) per cp size
CP_PACKINGS = {
    2: [
        ("contiguous", "edge+len1", [1, 7, 5, 3], 2, torch.float64),  # T=16, shard edge at 8
        ("contiguous", "cross+inside", [3, 10, 1, 2], 3, torch.float64),  # 3..13 crosses the edge
        ("contiguous", "tiny-pieces", [1, 3], 2, torch.float64),  # 2 tokens per rank < W-1
        ("contiguous", "cross+inside", [3, 10, 1, 2], 1, torch.float32),
        ("zigzag", "zz", [4, 12, 8], 3, torch.float64),  # 4..16 crosses the piece edge at 12
        ("zigzag", "zz-edge", [4, 8, 4, 8], 1, torch.float64),  # a boundary on the piece edge at 12
    ],
    4: [
        ("contiguous", "span3+edge+len1", [1, 3, 20, 4, 4], 2, torch.float64),  # 4..24 over ranks 0-2, edge at 24
        ("contiguous", "tiny-pieces", [1, 7], 3, torch.float64),  # 2 tokens per rank: halo from 2 ranks
        ("contiguous", "span3+edge+len1", [1, 3, 20, 4, 4], 1, torch.float32),
        ("zigzag", "zz", [8, 16, 8], 1, torch.float64),  # pieces of 8: edges at 8 and 24, 8..24 crosses 16
    ],
}

# TP x CP = 2 x 2: (layout, name, lengths, head ratio, sp, dtype); T / cp divisible by tp for SP
TP_CP_PACKINGS = [
    ("contiguous", "edge+len1", [1, 4, 7, 9, 3], 1, False, torch.float64),  # T=24, CP shard edge at 12
    ("contiguous", "cross+len1", [5, 14, 1, 4], 2, True, torch.float64),  # 5..19 crosses the CP edge
    ("contiguous", "cross+len1", [5, 14, 1, 4], 3, False, torch.float64),
    ("zigzag", "zz", [4, 12, 8], 1, True, torch.float64),
    ("zigzag", "zz", [4, 12, 8], 2, False, torch.float64),
    ("contiguous", "cross+len1", [5, 14, 1, 4], 3, True, torch.float32),
]


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _seed(family, *rest):
    return 1000 * (FAMILIES.index(family) + 1) + sum(10 ** i * r for i, r in enumerate(rest))


@pytest.mark.cp_sizes(*CP_PACKINGS)  # the packings are written per size; other sizes are deselected
@pytest.mark.parametrize("family", FAMILIES)
def test_cp_layer_matches_replicated(spawn, cp_size, packed_seqlens, family):
    cases = []
    for i, (layout, name, lengths, ratio, dtype) in enumerate(CP_PACKINGS[cp_size]):
        cases.append(make_case(make_config(family, ratio), _cu(lengths), seed=_seed(family, i, cp_size),
                               cp=cp_size, layout=layout, dtype=dtype, name=name, rtol=RTOL))
    for j, layout in enumerate(("contiguous", "zigzag")):  # one seeded random packing per layout
        cu = packed_seqlens(8 * cp_size, cp_size=cp_size, layout=layout, seed=cp_size + j)
        cases.append(make_case(make_config(family, 2 + j), cu, seed=_seed(family, 7 + j, cp_size),
                               cp=cp_size, layout=layout, name="random", rtol=RTOL))
    assert_parity_cases(spawn, cases, world_size=cp_size)


@pytest.mark.cp_sizes(2, 4)
def test_cp_layer_on_the_fragment_tables(spawn, cp_size, fragment_seqlens):
    # the named tables (pytest_linattn.seqlens.FRAGMENTS): documents whose pieces on two ranks differ
    # in length, zero-length documents (repeated boundaries: at the start, on a piece edge, at the
    # end), one whole document per rank (nothing crosses); every family, one spawn call
    cases = []
    for i, family in enumerate(FAMILIES):
        for j, name in enumerate(FRAGMENTS):
            cases.append(make_case(make_config(family, 2), fragment_seqlens(name, cp_size), cp=cp_size, rtol=RTOL,
                                   seed=_seed(family, j, cp_size, 6), name=name))
    cases.append(make_case(make_config("qwen3_5", 3), fragment_seqlens("empty-document", cp_size, layout="zigzag"),
                           cp=cp_size, layout="zigzag", rtol=RTOL, seed=_seed("qwen3_5", 9, cp_size, 6),
                           name="empty-document"))
    assert_parity_cases(spawn, cases, world_size=cp_size)


def test_an_empty_document_keeps_its_state_and_changes_no_other():
    # zero-length documents are allowed in cu_seqlens (fla's kernels take them too: fla pads cu_seqlens
    # with zero-length tail sequences for graph capture): each one's final state is its initial state,
    # and every other document's output and state are those of the batch without it
    for family in FAMILIES:
        config = make_config(family, 2)
        layer = build_layer(config, dtype=torch.float64)
        layer.load_state_dict(random_state_dict(config, 9))
        cu = torch.tensor([0, 0, 5, 8, 8, 11, 16, 16], dtype=torch.int32)
        gen = torch.Generator().manual_seed(10)
        h0 = LayerState(torch.randn(7, config.conv_dim, config.conv_size - 1, generator=gen, dtype=torch.float64),
                        torch.randn(7, config.num_v_heads, config.head_k_dim, config.head_v_dim, generator=gen,
                                    dtype=torch.float64))
        x = torch.randn(1, 16, config.hidden_size, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            y, ht = layer(x, cu, h0, output_final_state=True)
            kept = [1, 2, 4, 5]
            y_without, ht_without = layer(x, torch.tensor([0, 5, 8, 11, 16], dtype=torch.int32),
                                          LayerState(h0.conv[kept], h0.recurrent[kept]), output_final_state=True)
        for empty in (0, 3, 6):
            assert torch.equal(ht.conv[empty], h0.conv[empty]) and torch.equal(ht.recurrent[empty], h0.recurrent[empty])
        assert torch.equal(y, y_without), family
        assert torch.equal(ht.recurrent[kept], ht_without.recurrent) and torch.equal(ht.conv[kept], ht_without.conv)


@pytest.mark.tp_sizes(2)
@pytest.mark.cp_sizes(2)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_cp_layer_matches_replicated(spawn, tp_size, cp_size, family):
    cases = []
    for i, (layout, name, lengths, ratio, sp, dtype) in enumerate(TP_CP_PACKINGS):
        cases.append(make_case(make_config(family, ratio), _cu(lengths), seed=_seed(family, i, 5),
                               tp=tp_size, cp=cp_size, layout=layout, sp=sp, dtype=dtype, name=name, rtol=RTOL))
    assert_parity_cases(spawn, cases, world_size=tp_size * cp_size)


# ---- the ways to ask for gradients -------------------------------------------------------------

GRAD_CALLS = ("backward", "autograd.grad", "backward(inputs=...)")


def run_grad_calls(config, state_dict, x, dy, cu_seqlens, layout):
    """On every rank: this rank's input and parameter gradients, asked for three ways (a plain
    backward; torch.autograd.grad and backward(inputs=...), as pipeline schedules take input
    gradients, which only run the graph between the loss and the inputs asked for)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    layer = build_layer(config, cp_group=dist.group.WORLD, cp_layout=layout, dtype=torch.float64)
    layer.load_state_dict(state_dict)
    params = list(layer.parameters())
    index = rank_token_index(cu_seqlens, Placement(cp=size, cp_layout=layout), cp_rank=rank)
    grads = {}
    for how in GRAD_CALLS:
        layer.zero_grad(set_to_none=True)
        x_local = x[:, index].clone().requires_grad_()
        loss = (layer(x_local, cu_seqlens) * dy[:, index]).sum()
        if how == "autograd.grad":
            grads[how] = torch.autograd.grad(loss, [x_local, *params])
            continue
        loss.backward(**({"inputs": [x_local, *params]} if how != "backward" else {}))
        grads[how] = (x_local.grad, *(p.grad for p in params))
    return grads


@pytest.mark.cp_sizes(2, 4)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_cp_gradients_the_same_however_asked_for(spawn, cp_size, layout):
    """Every rank's gradients from autograd.grad and backward(inputs=...) equal a plain
    backward's, bitwise: no rank waits for a state gradient that a pruned node never sends."""
    config = make_config("qwen3_5", 2)
    # contiguous: the first sequence crosses every CP boundary; zigzag spreads each over all ranks
    cu = _cu([8 * cp_size - 3, 3] if layout == "contiguous" else [6 * cp_size, 2 * cp_size])
    gen = torch.Generator().manual_seed(cp_size)
    x, dy = (torch.randn(1, int(cu[-1]), config.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    per_rank = spawn(run_grad_calls, cp_size, config, random_state_dict(config, 3), x, dy, cu, layout)
    for rank, grads in enumerate(per_rank):
        for how in GRAD_CALLS[1:]:
            for i, (got, want) in enumerate(zip(grads[how], grads["backward"])):
                assert torch.equal(got, want), f"rank {rank}: {how} gradient {i} differs from backward()'s"


# ---- rules ------------------------------------------------------------------------------------



def run_cp_rules():
    """On 4 ranks: every rule a CP layer enforces, each before any collective."""
    rank = dist.get_rank()
    config = make_config("qwen3_5", 2)
    hidden = config.hidden_size
    errors = {}

    def forward(layer, local_tokens, lengths):
        x = torch.randn(1, local_tokens, hidden, dtype=torch.float64)
        return lambda: layer(x, _cu(lengths))

    _, cp_group = new_groups(1, 2)
    contiguous = build_layer(config, cp_group=cp_group, dtype=torch.float64)
    zigzag = build_layer(config, cp_group=cp_group, cp_layout="zigzag", dtype=torch.float64)
    errors["cp_divisible"] = error_of(forward(contiguous, 2, [2, 3]))
    errors["zigzag_divisible"] = error_of(forward(zigzag, 3, [4, 2]))
    errors["zigzag_lengths"] = error_of(forward(zigzag, 4, [2, 6]))
    errors["cp_tokens"] = error_of(forward(contiguous, 3, [4, 4]))
    errors["layout"] = error_of(lambda: build_layer(config, cp_group=cp_group, cp_layout="ring"))

    tp_group, cp_group = new_groups(2, 2)
    sp = build_layer(config, tp_group=tp_group, cp_group=cp_group, sequence_parallel=True, dtype=torch.float64)
    errors["sp_divisible"] = error_of(forward(sp, 2, [3, 3]))  # 3 tokens per CP rank, tp 2
    errors["sp_tokens"] = error_of(forward(sp, 3, [8, 8]))
    # the same ranks for TP and CP: not a grid
    errors["grid"] = error_of(lambda: build_layer(config, tp_group=tp_group, cp_group=tp_group))
    # a CP group of 3 ranks in a world of 4
    three = dist.new_group([0, 1, 2])
    errors["tile"] = error_of(lambda: build_layer(config, cp_group=three)) if rank < 3 else "skipped"
    return errors


def test_cp_rules(spawn):
    per_rank = spawn(run_cp_rules, 4)
    rules = {
        "cp_divisible": "contiguous CP needs total tokens divisible by cp_size: 5 % 2 != 0",
        "zigzag_divisible": "zigzag CP needs total tokens divisible by 2\\*cp_size: 6 % 4 != 0",
        "zigzag_lengths": "zigzag CP needs every sequence length divisible by 2\\*cp_size=4",
        "cp_tokens": "hidden_states must hold cu_seqlens\\[-1\\] / cp_size = 4 tokens, got 3",
        "layout": "cp_layout must be one of",
        "sp_divisible": "sequence parallel needs each CP rank's token count .* divisible by the TP size",
        "sp_tokens": "hidden_states must hold cu_seqlens\\[-1\\] / \\(cp_size \\* tp_size\\) = 4 tokens under sequence parallel, got 3",
        "grid": "TP and CP groups must tile the world as a grid",
        "tile": "tp_size \\* cp_size must tile the world|skipped",
    }
    assert_rules(per_rank, rules)
