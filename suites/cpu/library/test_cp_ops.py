"""CP ops (linattn.parallel.cp) against the single-process float64 reference on the full batch.

Every case shards one packed batch over the CP ranks, runs the CP op and its backward on every
rank, puts outputs and input gradients back together (weight gradients summed over ranks) and
compares with the reference run on the whole batch: <= 1e-10 relative in float64. Sharding and
unsharding use the documented layout (cases.cp_ops.shard / unshard, the harness's
rank_token_index), not cp_shard / cp_unshard, which are themselves checked against hand-written
index lists. Several cases share one spawn call to keep the suite quick.

Coverage: packings by name (CONTIGUOUS, ZIGZAG); a piece is one rank's T / cp tokens (zigzag:
after the relayout into the contiguous layout); the conv halo is W-1 = 3 tokens.

    feature                                    cp 2                         cp 4
    length-1 sequence                          edge+len1, inside            span3+edge+len1, span4
    boundary inside a piece                    edge+len1, inside            span3+edge+len1, span4
    boundary exactly on a piece edge           edge+len1, zz-chunk1         span3+edge+len1, zz
    sequence crossing a piece edge             inside, zz, pieces < W-1     span3+edge+len1, span4, zz
    sequence over >= 3 pieces (state relayed)  - (2 pieces)                 span3+edge+len1 (3), span4 (4)
    pieces < W-1, halo from the previous rank  tiny-pieces (its 2 tokens),  -
                                               one-token-pieces (1 token)
    pieces < W-1, halo from 2 or 3 ranks back  - (needs cp >= 3)            tiny-pieces (2), one-token-pieces (3)
    zigzag, one token per chunk                zz-chunk1                    zz-chunk1
    seeded random packing (packed_seqlens)     contiguous, zigzag           contiguous, zigzag
"""

import pytest
import torch

from cases.cp_ops import check_cases, make_case, run_cases_on_rank
from linattn.parallel import cp
from pytest_linattn.seqlens import packed_seqlens
from pytest_linattn.harness import Placement, rank_token_index

RTOL = 1e-10
W = 4  # conv width: a halo of 3 tokens, longer than some pieces below
D = 3
H, HV, K, V = 1, 2, 3, 2  # GVA: two value heads per key head

# (name, sequence lengths) per cp size (what each covers: the module docstring)
CONTIGUOUS = {
    2: [
        ("edge+len1", [1, 11, 5, 7]),  # T=24, shard edge at 12
        ("inside", [7, 10, 1, 6]),
        ("tiny-pieces", [4]),  # 2 tokens per rank < W-1: rank 1's halo is all of rank 0
        ("one-token-pieces", [2]),  # rank 1's halo is rank 0's one token
    ],
    4: [
        ("span3+edge+len1", [1, 3, 20, 4, 4]),  # T=32: 4..24 spans ranks 0-2, edge at 24
        ("span4", [5, 26, 1]),
        ("tiny-pieces", [1, 7]),  # 2 tokens per rank: halo from 2 ranks
        ("one-token-pieces", [4]),  # rank 3's halo from ranks 0, 1 and 2
    ],
}
# zigzag: every length divisible by 2*cp
ZIGZAG = {
    2: [("zz", [4, 12, 8]), ("zz-chunk1", [4, 4])],
    4: [("zz", [8, 16, 8]), ("zz-chunk1", [8, 8])],
}


def _cu(lengths):
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def _cases(cp_size):
    gen = torch.Generator().manual_seed(1234 + cp_size)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cases = []
    for layout, table in (("contiguous", CONTIGUOUS), ("zigzag", ZIGZAG)):
        # plus one seeded random packing per layout from the plugin's generator
        random_cu = packed_seqlens(8 * cp_size, cp_size=cp_size, layout=layout, seed=cp_size)
        named = [(name, _cu(lengths)) for name, lengths in table[cp_size]] + [("random", random_cu)]
        for i, (name, cu) in enumerate(named):
            cases.append(make_case(f"{layout}/{name}", layout, cu, randn, (H, HV, K, V), conv_dim=D, conv_width=W,
                                   l2norm=i % 2 == 0))
    return cases


@pytest.mark.cp_sizes(*CONTIGUOUS)  # the packings are written per size; other sizes are deselected
def test_cp_ops_match_reference(spawn, cp_size):
    cases = _cases(cp_size)
    check_cases(cases, spawn(run_cases_on_rank, cp_size, cases), cp_size, RTOL)


# The documented layouts (linattn/parallel/cp/layout.py's docstring) written out by hand: (layout, lengths, cp, the
# global tokens of each rank in its local order). Zigzag cuts each sequence into 2*cp chunks and
# rank r holds chunks r and 2*cp-1-r of every sequence.
HAND_WRITTEN_LAYOUTS = [
    ("contiguous", [1, 5], 2, [[0, 1, 2], [3, 4, 5]]),
    ("contiguous", [3, 1, 4], 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    # chunks of 1 (tokens 0-3) and 2 (tokens 4-11)
    ("zigzag", [4, 8], 2, [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]),
    # chunks of 1 (tokens 0-7) and 2 (tokens 8-23)
    ("zigzag", [8, 16], 4, [[0, 7, 8, 9, 22, 23], [1, 6, 10, 11, 20, 21], [2, 5, 12, 13, 18, 19],
                            [3, 4, 14, 15, 16, 17]]),
]


@pytest.mark.parametrize("layout, lengths, cp_size, held", HAND_WRITTEN_LAYOUTS)
def test_shard_unshard_follow_the_documented_layout(layout, lengths, cp_size, held):
    cu = _cu(lengths)
    tokens = torch.arange(int(cu[-1])).view(1, -1)
    for r in range(cp_size):
        assert cp.cp_token_index(cu, r, cp_size, layout).tolist() == held[r], f"rank {r}"
        assert cp.cp_shard(tokens, cu, r, cp_size, layout).tolist() == [held[r]], f"rank {r}"
    shards = [torch.tensor([h]) for h in held]
    assert torch.equal(cp.cp_unshard(shards, cu, cp_size, layout), tokens)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("cp_size", [2, 4])
def test_shard_unshard_agree_with_the_harness_layout(cp_size, layout):
    # every packing of the op tests: cp_shard gives the tokens the tests shard with, cp_unshard inverts it
    table = CONTIGUOUS if layout == "contiguous" else ZIGZAG
    for _, lengths in table[cp_size]:
        cu = _cu(lengths)
        tokens = torch.arange(int(cu[-1])).view(1, -1)
        shards = [cp.cp_shard(tokens, cu, r, cp_size, layout) for r in range(cp_size)]
        for r, s in enumerate(shards):
            index = rank_token_index(cu, Placement(cp=cp_size, cp_layout=layout), cp_rank=r)
            assert s.tolist() == [index.tolist()], f"{lengths} rank {r}"
        assert torch.equal(cp.cp_unshard(shards, cu, cp_size, layout), tokens)


def test_context_metadata():
    cu = _cu([1, 3, 20, 4, 4])  # T=32, cp=4, 8 tokens per rank
    ctxs = [cp.build_context(cu, None, "contiguous", total_tokens=32, cp_rank=r, cp_size=4) for r in range(4)]
    assert ctxs[0].first_seq_offset == (0, 4, 12, 0)
    assert [c.local_cu_seqlens.tolist() for c in ctxs] == [[0, 1, 4, 8], [0, 8], [0, 8], [0, 4, 8]]
    assert [c.first_seq_continues for c in ctxs] == [False, True, True, False]
    assert [c.last_seq_continues for c in ctxs] == [True, True, False, False]


@pytest.mark.parametrize(
    "lengths, cp_size, layout, match",
    [
        ([5, 4], 2, "contiguous", "divisible by cp_size"),
        ([6, 6], 2, "zigzag", "divisible by 2\\*cp_size"),
        ([2, 6], 2, "zigzag", "every sequence length divisible by 2\\*cp_size"),
        ([4, 4], 2, "diagonal", "layout must be one of"),
    ],
)
def test_bad_partition_raises(lengths, cp_size, layout, match):
    cu = _cu(lengths)
    with pytest.raises(ValueError, match=match):
        cp.build_context(cu, None, layout, total_tokens=int(cu[-1]), cp_rank=0, cp_size=cp_size)
    with pytest.raises(ValueError, match=match):
        cp.cp_shard(torch.zeros(1, int(cu[-1])), cu, 0, cp_size, layout)


@pytest.mark.parametrize(
    "cu, total, match",
    [
        ([1, 4, 8], 8, "must start at 0"),
        ([0, 6, 4, 8], 8, "non-decreasing"),
        ([0, 4, 8], 12, "must end at"),
        ([[0, 8]], 8, "1-D"),
    ],
)
def test_inconsistent_cu_seqlens_raises(cu, total, match):
    with pytest.raises(ValueError, match=match):
        cp.build_context(torch.tensor(cu), None, "contiguous", total_tokens=total, cp_rank=0, cp_size=2)


def test_bad_inputs_raise():
    ctx = cp.build_context(_cu([8]), None, "contiguous", total_tokens=8, cp_rank=0, cp_size=2)
    q = torch.zeros(1, 4, H, K)
    with pytest.raises(ValueError, match="op must be one of"):
        cp.delta_rule(q, q, q, q[..., 0], q[..., 0], op="mamba", cp_context=ctx)
    with pytest.raises(ValueError, match=r"backend must be None or one of \('exchange', 'fla'\)"):
        cp.delta_rule(q, q, q, q[..., 0], q[..., 0], op="kda", backend="nccl", cp_context=ctx)
    with pytest.raises(ValueError, match=r"backend must be None or one of \('exchange', 'fla'\)"):
        cp.short_conv(q[..., 0], q[0, 0], backend="nccl", cp_context=ctx)
    with pytest.raises(ValueError, match="cp_context has no process group"):  # None: no CP, so metadata only
        cp.delta_rule(q, q, q, q[..., 0], q[..., 0], op="gated_delta_rule", cp_context=ctx)
    with pytest.raises(ValueError, match="T_local=4"):
        ctx.relayout.to_contiguous(torch.zeros(1, 5, 2))
    with pytest.raises(ValueError, match="one shard per rank"):
        cp.cp_unshard([q], _cu([8]), 2)


def test_fla_context_gets_the_context_group(tmp_path, monkeypatch):
    # fla's build_cp_context needs the group itself. fla is replaced: importing it is slow on a CPU.
    import sys
    import types

    import torch.distributed as dist

    from linattn.parallel.cp import fla as cp_fla

    seen = {}

    def build_cp_context(cu_seqlens, group=None, **kwargs):
        seen.update(group=group, **kwargs)
        return "fla-context"

    fake = types.ModuleType("fla.ops.cp")
    fake.build_cp_context = build_cp_context
    monkeypatch.setitem(sys.modules, "fla.ops.cp", fake)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ctx = cp.build_context(torch.tensor([0, 3, 8]), dist.group.WORLD, "contiguous", total_tokens=8)
        assert cp_fla.fla_context(ctx, conv1d_kernel_size=4) == "fla-context"
        assert seen["group"] is dist.group.WORLD and seen["conv1d_kernel_size"] == 4
    finally:
        dist.destroy_process_group()
