"""The bug record's kernel rows (suites/bug_record/registry.py: fla-955, fla-871-1138) on fla's
compiled short-conv kernels in bf16 on one GPU, against the float64 reference: the checks of
suites/fla-interpret/test_conv_backward_record.py (the same kernels under Triton's interpreter,
float32, on a CPU), where the record's rows are generated from. suites/cases/conv_backward.py
says what each bug is and where in fla 0.6.0's ``fla/modules/causal_conv1d/ops.py`` it lives.

- fla-955 (fla PR #955, open): live in fla 0.6.0, no plant: fla's own ``causal_conv1d`` with
  cu_seqlens and a batch of 2 rows, the trigger the PR describes. y and dx right, dweight summed
  over weight-gradient rows no program wrote (NaN: the backward runs with PyTorch's fill of
  uninitialized memory). A strict xfail for that reason only; the same check passes on the same
  tokens packed as one row and on two rows without cu_seqlens.
- fla-871-1138 (fla #871, #1138): fixed in fla 0.6.0. Its check gives fla's backward a strided dy
  (the conv's slice of a fused ``[1, T, 3D]`` gradient) with cu_seqlens and an initial state, so
  the dh0 kernel (#1138) runs too: fla's kernels must be right. The bug itself is a plant applied
  here, in the test (`bug_record.plants_layer.GradReadAsContiguous` on fla's output reads dy as
  contiguous), which the check must catch, dx and dh0 named.
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from bug_record.plants_layer import GradReadAsContiguous  # noqa: E402
from cases.conv_backward import (DweightFromUnwrittenRows, assert_conv_grads, assert_varlen_batch, draw,  # noqa: E402
                                 fla_conv, flat_cu_seqlens, reference_grads)
from pytest_linattn.parity import assert_parity, capture_records  # noqa: E402

pytestmark = pytest.mark.gpus(1)

ROW_CUS = [[0, 100, 300], [0, 37, 300]]  # 2 rows of 300 tokens, 2 sequences each: 12 chunks of 64
CU = flat_cu_seqlens(ROW_CUS)  # [0, 100, 300, 337, 600]: over the 600 flattened tokens
D, SEED = 192, 955
BF16 = torch.bfloat16


@pytest.mark.xfail(strict=True, raises=DweightFromUnwrittenRows, reason=(
    "fla PR #955 (open), live in fla 0.6.0: causal_conv1d with cu_seqlens and B > 1 returns a wrong dweight "
    "(y and dx right): the backward sizes its weight-gradient buffer B*NT rows, its varlen branch writes NT "
    "of them and dweight sums all B*NT"))
def test_varlen_batch_of_two_rows_dweight():
    values = draw(SEED, len(ROW_CUS), ROW_CUS[0][-1], D, dtype=BF16)
    results, _ = fla_conv(values, cu_seqlens=CU, rows=len(ROW_CUS), device="cuda", dtype=BF16)
    assert_varlen_batch(results, reference_grads(values, ROW_CUS), rtol=RTOL, cu_seqlens=CU,
                        name="causal_conv1d B=2 cu_seqlens")


@pytest.mark.parametrize("rows, cu_seqlens", [(1, CU), (2, None)], ids=["one_packed_row", "two_rows_no_cu_seqlens"])
def test_conv_backward_right_paths(rows, cu_seqlens):
    # the check above is sound: the same tokens as one packed row, and two rows without cu_seqlens
    values = draw(SEED, len(ROW_CUS), ROW_CUS[0][-1], D, dtype=BF16)
    row_cus = ROW_CUS if cu_seqlens is not None else [[0, ROW_CUS[0][-1]]] * len(ROW_CUS)
    results, _ = fla_conv(values, cu_seqlens=cu_seqlens, rows=rows, device="cuda", dtype=BF16)
    assert_conv_grads(results, reference_grads(values, row_cus), rtol=RTOL, cu_seqlens=flat_cu_seqlens(row_cus),
                      name=f"causal_conv1d rows={rows}")


def test_strided_dy_into_the_varlen_conv_backward():
    # fla #871 / #1138 (fixed in 0.6.0): fla's kernels right on a strided dy, the plant caught
    cu = ROW_CUS[0]
    values = draw(SEED + 1, 1, cu[-1], D, dtype=BF16, fused=True, states=len(cu) - 1)
    ref = reference_grads(values, [cu])
    results, arrived = fla_conv(values, cu_seqlens=cu, rows=1, device="cuda", dtype=BF16)
    assert arrived == [False], f"fla's output got contiguous gradients {arrived}: the check needs a strided dy"
    assert_conv_grads(results, ref, rtol=RTOL, cu_seqlens=cu, name="causal_conv1d strided dy")

    planted, _ = fla_conv(values, cu_seqlens=cu, rows=1, device="cuda", dtype=BF16, plant=GradReadAsContiguous)
    with capture_records(), pytest.raises(AssertionError, match=r"\n\s+planted dx\s.*seq \d+ token \d+"):
        assert_parity(planted["dx"], ref["dx"], rtol=RTOL, name="planted dx", cu_seqlens=torch.tensor(cu))
    with capture_records(), pytest.raises(AssertionError, match=r"\n\s+planted dh0\s"):
        assert_parity(planted["dh0"], ref["dh0"], rtol=RTOL, name="planted dh0", activations=False)
