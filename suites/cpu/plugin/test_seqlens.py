"""packed_seqlens: seeded, always covers the CP corner cases, refuses impossible requests; the
named fragment tables (fragment_seqlens) hold what their names say."""

import pytest
import torch

from pytest_linattn.harness import Placement, rank_token_index
from pytest_linattn.seqlens import DEFAULT_SEED, FRAGMENTS, describe, fragment_seqlens, packed_seqlens


def _check_basic(cu, total):
    assert cu.dtype == torch.int32 and cu.dim() == 1
    assert int(cu[0]) == 0 and int(cu[-1]) == total
    assert bool((cu[1:] > cu[:-1]).all())  # no empty sequences


def test_seeded_determinism():
    a = packed_seqlens(256, 9, seed=3, cp_size=4)
    assert torch.equal(a, packed_seqlens(256, 9, seed=3, cp_size=4))
    assert not torch.equal(a, packed_seqlens(256, 9, seed=4, cp_size=4))
    assert torch.equal(packed_seqlens(256, cp_size=2), packed_seqlens(256, cp_size=2, seed=DEFAULT_SEED))


@pytest.mark.parametrize("seed", range(6))
def test_cp1_has_length_one(seed):
    cu = packed_seqlens(64, 6, seed=seed)
    _check_basic(cu, 64)
    d = describe(cu)
    assert d["num_seqs"] == 6 and d["has_length_one"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cp, total", [(2, 64), (3, 96), (4, 128), (4, 96), (8, 256)])
def test_contiguous_cp_coverage(cp, total, seed):
    # (Not named cp_size: the plugin owns that parameter and deselects sizes not in --cp.)
    cu = packed_seqlens(total, seed=seed, cp_size=cp)
    _check_basic(cu, total)
    d = describe(cu, cp)
    assert d["has_length_one"] and d["boundary_inside_shard"]
    if cp >= 4:
        assert d["boundary_on_shard_edge"] and d["max_shards_spanned"] >= 3
    else:
        assert d["max_shards_spanned"] == cp


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cp", [2, 3])
def test_small_cp_edge_boundary_instead_of_full_span(cp, seed):
    cu = packed_seqlens(32 * cp, 7, seed=seed, cp_size=cp, edge_boundary=True)
    d = describe(cu, cp)
    assert d["boundary_on_shard_edge"] and d["boundary_inside_shard"] and d["has_length_one"]
    assert d["max_shards_spanned"] == cp - 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_lengths_divisible(cp, seed):
    total = 64 * cp
    cu = packed_seqlens(total, 5, seed=seed, cp_size=cp, layout="zigzag", min_len=3)
    _check_basic(cu, total)
    d = describe(cu, cp, "zigzag")
    assert d["lengths_divisible"] and d["num_seqs"] == 5
    assert d["has_shortest"] == (3 <= 2 * cp)
    assert d["min_len"] >= 2 * cp * -(-3 // (2 * cp))  # min_len rounds up


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cp", [2, 4])
def test_fla_zigzag_crosses_the_intervals(cp, seed):
    # fla's whole-batch zigzag: the contiguous coverage over its 2*cp intervals
    cu = packed_seqlens(16 * cp, 2 * cp + 3, seed=seed, cp_size=cp, layout="fla-zigzag")
    _check_basic(cu, 16 * cp)
    d = describe(cu, cp, "fla-zigzag")
    assert d == describe(cu, 2 * cp) and d["num_seqs"] == 2 * cp + 3
    assert d["boundary_on_shard_edge"] and d["boundary_inside_shard"] and d["has_length_one"]
    assert d["max_shards_spanned"] >= 3


def test_min_len_respected_and_tight_counts():
    cu = packed_seqlens(128, 10, seed=1, cp_size=4, min_len=4)
    assert describe(cu, 4)["min_len"] >= 4
    # 64 tokens, cp 4: the spanning sequence takes >= 18 tokens, so at most 47 sequences.
    assert describe(packed_seqlens(64, 47, cp_size=4), 4)["num_seqs"] == 47
    assert describe(packed_seqlens(64, 3, cp_size=4), 4)["max_shards_spanned"] >= 3


def test_describe_by_hand():
    cu = torch.tensor([0, 1, 8, 20, 32])
    d = describe(cu, cp_size=4)  # shards of 8: edges at 8, 16, 24
    assert d == {"num_seqs": 4, "total_tokens": 32, "min_len": 1, "max_len": 12, "has_length_one": True,
                 "boundary_on_shard_edge": True, "boundary_inside_shard": True, "max_shards_spanned": 2}


@pytest.mark.parametrize("kwargs, param", [
    (dict(total_tokens=30, cp_size=4), "total_tokens"),
    (dict(total_tokens=20, cp_size=4, layout="zigzag"), "total_tokens"),
    (dict(total_tokens=12, cp_size=4, layout="fla-zigzag"), "total_tokens"),
    (dict(total_tokens=0), "total_tokens"),
    (dict(total_tokens=64, num_seqs=0), "num_seqs"),
    (dict(total_tokens=64, num_seqs=17, min_len=4), "num_seqs"),
    (dict(total_tokens=64, num_seqs=48, cp_size=4), "num_seqs"),
    (dict(total_tokens=64, num_seqs=2, cp_size=4), "num_seqs"),
    (dict(total_tokens=64, num_seqs=1), "num_seqs"),
    (dict(total_tokens=64, min_len=-1), "min_len"),
    (dict(total_tokens=64, cp_size=4, min_len=16), "min_len"),
    (dict(total_tokens=64, cp_size=0), "cp_size"),
    (dict(total_tokens=64, layout="ring"), "layout"),
    (dict(total_tokens=64, seed=-1), "seed"),
    (dict(total_tokens=8, cp_size=8), "total_tokens"),
])
def test_invalid_requests_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=f"^{param}"):
        packed_seqlens(**kwargs)


def test_describe_rejects_bad_input():
    with pytest.raises(ValueError, match="^cu_seqlens"):
        describe(torch.tensor([0, 5, 3]))
    with pytest.raises(ValueError, match="^cu_seqlens"):
        describe(torch.tensor([0, 5, 10]), cp_size=4)
    with pytest.raises(ValueError, match="^layout"):
        describe(torch.tensor([0, 4]), layout="x")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_fragment_tables_hold_what_they_name(cp):
    P = 8
    lengths = {name: fragment_seqlens(name, cp, piece_tokens=P).diff().tolist() for name in FRAGMENTS}
    # one whole document per rank: every boundary on a piece edge
    assert lengths["document-per-rank"] == [P] * cp
    # every document but the last crosses the next piece edge, its two pieces of different lengths
    cu = fragment_seqlens("uneven-pieces", cp, piece_tokens=P).tolist()
    for start, end in zip(cu[:-2], cu[1:-1]):
        edge = (start // P + 1) * P
        assert start < edge < end and edge - start != end - edge, (start, end)
    # empty documents first, on the first piece edge and last; the others cross the remaining edges
    cu = fragment_seqlens("empty-document", cp, piece_tokens=P).tolist()
    assert cu[:2] == [0, 0] and cu[-2:] == [cp * P] * 2 and cu.count(P) == 2
    for layout in ("contiguous", "fla-zigzag"):  # fit their placement's rule (T divisible by cp or 2 * cp)
        for name in FRAGMENTS:
            if layout == "fla-zigzag" and name == "uneven-pieces" and cp > 2:
                continue
            cu = fragment_seqlens(name, cp, layout=layout, piece_tokens=P)
            rank_token_index(cu, Placement(cp=cp, cp_layout=layout), cp_rank=cp - 1)
    zz = fragment_seqlens("empty-document", cp, layout="zigzag", piece_tokens=P)
    assert 0 in zz.diff().tolist() and all(n % (2 * cp) == 0 for n in zz.diff().tolist())
    rank_token_index(zz, Placement(cp=cp, cp_layout="zigzag"), cp_rank=cp - 1)


@pytest.mark.parametrize("args, kwargs, param", [
    (("interleaved", 2), {}, "name"),
    (("uneven-pieces", 1), {}, "cp_size"),
    (("uneven-pieces", 4), dict(piece_tokens=3), "piece_tokens"),
    (("empty-document", 2), dict(piece_tokens=2), "piece_tokens"),
    (("document-per-rank", 2), dict(layout="ring"), "layout"),
    (("uneven-pieces", 2), dict(layout="zigzag"), "name"),
    (("document-per-rank", 2), dict(layout="fla-zigzag", piece_tokens=5), "piece_tokens"),
])
def test_fragment_tables_refuse_what_cannot_be_laid_out(args, kwargs, param):
    with pytest.raises(ValueError, match=f"^{param}"):
        fragment_seqlens(*args, **kwargs)
