"""The bug record's two kernel rows on fla's own short-conv kernels, interpreted (float32, CPU),
against the float64 reference (suites/cases/conv_backward.py says what each bug is and where in
fla 0.6.0's ``fla/modules/causal_conv1d/ops.py`` it lives):

- fla-955 (fla PR #955, open): a live bug of the pinned fla 0.6.0. ``causal_conv1d`` with
  cu_seqlens and a batch of 2 rows gives a right y and dx and a NaN dweight: rows of its
  weight-gradient buffer that no program wrote, summed in. NaN because the backward runs with
  PyTorch's fill of uninitialized memory; without it, whatever the allocator held (1.8e19 and
  6.7e14 relative error in two calls of one process here, 1.3e-7 in another, on fresh zeros). A
  strict xfail that fails for that reason only; the same check passes on the same tokens packed
  as one row and on two rows without cu_seqlens. Repro: suites/live_bugs/fla_955_causal_conv1d_varlen_batch.py.
- fla-871-1138 (fla #871, #1138; both fixed in 0.6.0): a strided dy (the conv's slice of a fused
  gradient) into the backward, with cu_seqlens and an initial state so that the dh0 kernel runs
  too: fla's kernels are right, and the plant reading dy as contiguous is caught, dx and dh0 named.

suites/gpu-1/test_bug_record_gpu1.py runs the same checks on fla's compiled kernels in bf16.
docs/bugs.md's rows for these entries come from this file's outcomes (write_bugs_md.py runs it).
"""

import re
import time

import pytest
import torch

from cases.conv_backward import (DweightFromUnwrittenRows, assert_conv_grads, assert_varlen_batch, draw, fla_conv,
                                 flat_cu_seqlens, reference_grads)
from fidelity import F32, RTOL
from pytest_linattn.parity import assert_parity, capture_records

ROW_CUS = [[0, 10, 24], [0, 6, 24]]  # 2 rows of 24 tokens, 2 sequences each
CU = flat_cu_seqlens(ROW_CUS)  # [0, 10, 24, 30, 48]: over the 48 flattened tokens
D = 32
SEED = 955


@pytest.mark.xfail(strict=True, raises=DweightFromUnwrittenRows, reason=(
    "fla PR #955 (open), live in fla 0.6.0: causal_conv1d with cu_seqlens and B > 1 returns a wrong dweight "
    "(y and dx right): the backward sizes its weight-gradient buffer B*NT rows, its varlen branch writes NT "
    "of them and dweight sums all B*NT"))
def test_varlen_batch_of_two_rows_dweight(record_property):
    values = draw(SEED, len(ROW_CUS), ROW_CUS[0][-1], D, dtype=F32)
    ref = reference_grads(values, ROW_CUS)
    start = time.perf_counter()
    results, _ = fla_conv(values, cu_seqlens=CU, rows=len(ROW_CUS), device="cpu", dtype=F32)
    try:
        assert_varlen_batch(results, ref, rtol=RTOL, cu_seqlens=CU, name="causal_conv1d B=2 cu_seqlens")
    except DweightFromUnwrittenRows as failure:
        record_property("seconds", f"{time.perf_counter() - start:.2f}")
        record_property("located", failure.located)
        raise


@pytest.mark.parametrize("rows, cu_seqlens", [(1, CU), (2, None)], ids=["one_packed_row", "two_rows_no_cu_seqlens"])
def test_conv_backward_right_paths(rows, cu_seqlens):
    """The check of the test above is sound: on the same tokens packed as one row (the layout fla
    documents for cu_seqlens), and on two rows of one sequence each without cu_seqlens, fla's
    dweight is right, every buffer row written (unwritten memory is NaN here too)."""
    values = draw(SEED, len(ROW_CUS), ROW_CUS[0][-1], D, dtype=F32)
    row_cus = ROW_CUS if cu_seqlens is not None else [[0, ROW_CUS[0][-1]]] * len(ROW_CUS)
    results, _ = fla_conv(values, cu_seqlens=cu_seqlens, rows=rows, device="cpu", dtype=F32)
    assert_conv_grads(results, reference_grads(values, row_cus), rtol=RTOL, cu_seqlens=flat_cu_seqlens(row_cus),
                      name=f"causal_conv1d rows={rows}")


def test_strided_dy_into_the_varlen_conv_backward(record_property):
    """fla #871 / #1138, fixed in 0.6.0: the conv's gradient arrives as the first D channels of a
    fused ``[1, T, 3D]`` gradient; fla's backward (dx, dweight) and its dh0 kernel read it by its
    strides. The plant reading it as contiguous is caught, dx and dh0 named."""
    from bug_record.plants_layer import GradReadAsContiguous

    cu = ROW_CUS[0]
    values = draw(SEED + 1, 1, cu[-1], D, dtype=F32, fused=True, states=len(cu) - 1)
    ref = reference_grads(values, [cu])
    results, arrived = fla_conv(values, cu_seqlens=cu, rows=1, device="cpu", dtype=F32)
    assert arrived == [False], f"fla's output got contiguous gradients {arrived}: the check needs a strided dy"
    assert_conv_grads(results, ref, rtol=RTOL, cu_seqlens=cu, name="causal_conv1d strided dy")

    start = time.perf_counter()
    planted, _ = fla_conv(values, cu_seqlens=cu, rows=1, device="cpu", dtype=F32, plant=GradReadAsContiguous)
    with capture_records(), pytest.raises(AssertionError) as tokens_failure:
        assert_parity(planted["dx"], ref["dx"], rtol=RTOL, name="planted dx", cu_seqlens=torch.tensor(cu))
    with capture_records(), pytest.raises(AssertionError) as dh0_failure:
        assert_parity(planted["dh0"], ref["dh0"], rtol=RTOL, name="planted dh0", activations=False)
    record_property("seconds", f"{time.perf_counter() - start:.2f}")
    dx_row = re.search(r"^\s*(planted dx\s+\S+\s+\S+\s+\S+\s+seq \d+ token \d+.*)$", str(tokens_failure.value), re.M)
    dh0_row = re.search(r"^\s*(planted dh0\s+\S+\s+\S+\s+\S+\s+.*)$", str(dh0_failure.value), re.M)
    assert dx_row and dh0_row, f"{tokens_failure.value}\n{dh0_failure.value}"
    record_property("located", " / ".join(re.sub(r"\s{2,}", "  ", r.group(1).strip()) for r in (dx_row, dh0_row)))
