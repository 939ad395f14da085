"""The harness's placements by hand: which tokens each rank holds (`rank_token_index`: contiguous,
linattn's per-sequence zigzag, fla's whole-batch zigzag, sequence parallel slices), the layout name
fla's build_cp_context takes for each (`Placement.fla_layout`), and the placements' names.
"""

import pytest
import torch

from pytest_linattn.harness import Placement, rank_token_index

CU = [0, 3, 10, 11, 16]  # T=16: a sequence crosses the CP edge at 8, one is a single token
CU_ZIGZAG = [0, 8, 16]  # every length divisible by 2 * cp = 4


def _tokens(cu, placement, tp_rank=0, cp_rank=0):
    return rank_token_index(torch.tensor(cu), placement, tp_rank, cp_rank).tolist()


def test_token_layout_matches_the_documented_definition():
    contiguous = Placement(cp=2)
    assert _tokens(CU, contiguous, cp_rank=0) == list(range(0, 8))
    assert _tokens(CU, contiguous, cp_rank=1) == list(range(8, 16))
    # two sequences of 8, cut into 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    zigzag = Placement(cp=2, cp_layout="zigzag")
    assert _tokens(CU_ZIGZAG, zigzag, cp_rank=0) == [0, 1, 6, 7, 8, 9, 14, 15]
    assert _tokens(CU_ZIGZAG, zigzag, cp_rank=1) == [2, 3, 4, 5, 10, 11, 12, 13]
    # cp 4 on one sequence of 16: 8 chunks of 2, rank r holds chunks r and 7 - r
    zigzag4 = Placement(cp=4, cp_layout="zigzag")
    assert [_tokens([0, 16], zigzag4, cp_rank=r) for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # SP: the CP rank's tokens in tp contiguous slices
    sp = Placement(tp=2, cp=2, cp_layout="zigzag", sequence_parallel=True)
    assert _tokens(CU_ZIGZAG, sp, 0, 1) == [2, 3, 4, 5]
    assert _tokens(CU_ZIGZAG, sp, 1, 1) == [10, 11, 12, 13]
    # without SP every TP rank holds its CP rank's tokens
    assert _tokens(CU, Placement(tp=2, cp=2), 1, 1) == list(range(8, 16))
    # fla's zigzag cuts the whole batch, not each sequence: 4 intervals of 4 over [0, 8, 16]
    fla = Placement(cp=2, cp_layout="fla-zigzag")
    assert _tokens(CU_ZIGZAG, fla, cp_rank=0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert _tokens(CU_ZIGZAG, fla, cp_rank=1) == [4, 5, 6, 7, 8, 9, 10, 11]
    # sequences of any length: CU's 3-token and 1-token sequences cross intervals of 2 at cp 4
    assert [_tokens(CU, Placement(cp=4, cp_layout="fla-zigzag"), cp_rank=r) for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # on one sequence fla's zigzag is the per-sequence zigzag
    assert all(_tokens([0, 16], Placement(cp=4, cp_layout="fla-zigzag"), cp_rank=r) ==
               _tokens([0, 16], Placement(cp=4, cp_layout="zigzag"), cp_rank=r) for r in range(4))
    sp = Placement(tp=2, cp=2, cp_layout="fla-zigzag", sequence_parallel=True)
    assert _tokens(CU, sp, 1, 0) == [12, 13, 14, 15]


def test_fla_layout_names_the_build_cp_context_layout():
    assert Placement(cp=2).fla_layout == "contiguous"
    assert Placement(cp=2, cp_layout="fla-zigzag").fla_layout == "zigzag"
    with pytest.raises(ValueError, match=r"Placement.cp_layout 'zigzag' cuts each sequence; fla's build_cp_context "
                                         r"has no such layout .*Placement\(cp_layout='fla-zigzag'\)"):
        Placement(cp=2, cp_layout="zigzag").fla_layout  # noqa: B018


def test_placement_names():
    assert Placement().name == "replicated"
    assert Placement(tp=4).name == "tp4"
    assert Placement(tp=2, cp=2, cp_layout="zigzag", sequence_parallel=True).name == "tp2-sp/cp2-zigzag"
    assert Placement(cp=2, cp_layout="fla-zigzag").name == "cp2-fla-zigzag"
    assert str(Placement(cp=4)) == "cp4-contiguous"
