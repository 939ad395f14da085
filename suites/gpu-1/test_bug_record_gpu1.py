"""The bug record's GPU rows (class I: stride- and batch-shape-dependent kernel bugs), on fla's
own short-conv kernel in bf16 against the float64 reference (suites/bug_record/registry.py:
fla-871-1138, fla-955). The CPU record holds their strict xfails: linattn's packed layers hand the
conv B = 1 and contiguous gradients, so only a kernel-level check sees them.

Each check runs on fla's kernel as it is (it must pass) and on the plant (it must fail, naming
the tensor and where): dy read with contiguous strides; dweight from batch row 0 only.
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from bug_record.plants_layer import _GradReadAsContiguous  # noqa: E402
from fla.modules.convolution import causal_conv1d  # noqa: E402
from linattn import reference  # noqa: E402
from pytest_linattn.parity import assert_parity, capture_records  # noqa: E402

pytestmark = pytest.mark.gpus(1)

SEED, T, D, W = 955, 300, 192, 4


def _inputs(batch, fused):
    """x `[batch, T, D]`, weight `[D, W]` and dy, drawn in float64 and rounded to bf16; dy a
    strided view (the first D channels of a fused `[batch, T, 3D]` gradient) when `fused`."""
    gen = torch.Generator().manual_seed(SEED + batch + fused)
    x = torch.randn(batch, T, D, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
    w = (torch.randn(D, W, generator=gen, dtype=torch.float64) / W ** 0.5).to(torch.bfloat16).double()
    dy = torch.randn(batch, T, 3 * D if fused else D, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
    return x, w, dy


def _reference(x, w, dy):
    """dx, dw of the float64 reference, one batch row at a time (dy contiguous)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.cat([reference.short_conv(x[b:b + 1], w, activation="silu") for b in range(x.shape[0])])
    (y * dy[..., :D].contiguous()).sum().backward()
    return x.grad, w.grad


def _fla(x, w, dy, plant=None):
    """dx, dw of fla's causal_conv1d in bf16 on CUDA, dy passed as given (strided or not)."""
    x = x.to("cuda", torch.bfloat16).requires_grad_()
    w = w.to("cuda", torch.bfloat16).requires_grad_()
    if plant == "weight-grad-from-row-0":
        y = torch.cat([causal_conv1d(x[:1], weight=w, activation="silu")[0],
                       causal_conv1d(x[1:], weight=w.detach(), activation="silu")[0]])
    else:
        y = causal_conv1d(x, weight=w, activation="silu")[0]
    if plant == "dy-read-contiguous":
        y = _GradReadAsContiguous.apply(y)
    dy = dy.to("cuda", torch.bfloat16)
    y.backward(dy[..., :D])
    return x.grad, w.grad


def _check(batch, fused, plant=None):
    x, w, dy = _inputs(batch, fused)
    dx_ref, dw_ref = _reference(x, w, dy)
    dx, dw = _fla(x, w, dy, plant)
    assert_parity(dx, dx_ref, rtol=RTOL, name="causal_conv1d dx")
    assert_parity(dw, dw_ref, rtol=RTOL, name="causal_conv1d dweight", activations=False)


def test_strided_dy_into_the_conv_backward():
    # fla #871 / #1138: the backward read dy with hard-coded contiguous strides
    _check(batch=1, fused=True)
    with capture_records(), pytest.raises(AssertionError, match=r"causal_conv1d dx: .*\n.*\n\s+causal_conv1d dx\s"):
        _check(batch=1, fused=True, plant="dy-read-contiguous")


def test_batch_of_two_rows_through_the_conv_backward():
    # fla #955: with B > 1 dweight came from part of the batch only (dx right)
    _check(batch=2, fused=False)
    with capture_records(), pytest.raises(AssertionError, match=r"causal_conv1d dweight: .*\n.*\n\s+causal_conv1d "
                                                                r"dweight\s.*row \d+, col \d+"):
        _check(batch=2, fused=False, plant="weight-grad-from-row-0")
