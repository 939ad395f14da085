"""fla's varlen chunk kernels on a packed batch padded past its last boundary (T > cu_seqlens[-1]),
as a trainer that pads its packed batch passes it, interpreted (float32, CPU), against the float64
reference (linattn.reference.gated_delta_rule):

- the tokens before cu_seqlens[-1]: outputs and q / k / v / g / beta gradients right;
- the padding tail (QwenLM/FlashQLA #28, part 1): fla 0.6.0's `chunk_gated_delta_rule` writes
  neither its outputs nor its input gradients there. They are what the allocator held (NaN here:
  PyTorch's fill of uninitialized memory), and a trainer's projection sums them into its weight
  gradients unless it zeroes them itself: a strict xfail that fails for that reason only. The
  contract a padded caller needs is zeros (or a refusal of T > cu_seqlens[-1]); fla accepts the
  input without an error. Repro: suites/live_bugs/fla_varlen_padded_tail_unwritten.py.
"""

import time

import pytest
import torch

from cases.conv_backward import unwritten_memory_as_nan
from fidelity import RTOL
from pytest_linattn.parity import assert_parity

T, H, K, V = 40, 2, 16, 16
CU = [0, 10, 30]  # two sequences, then a padding tail of 10 tokens
NAMES = ("q", "k", "v", "g", "beta")


class TailUnwritten(AssertionError):
    """The padding tail's outputs or gradients are not zeros: unwritten memory."""


def inputs(seed=28):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    do = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    return dict(q=q, k=k, v=v, g=g, beta=beta), do


def fla_run(values, do):
    """fla's chunk_gated_delta_rule forward and backward in float32, unwritten memory NaN."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    leaves = {n: t.float().requires_grad_() for n, t in values.items()}
    with unwritten_memory_as_nan():
        o, _ = chunk_gated_delta_rule(*(leaves[n] for n in NAMES), cu_seqlens=torch.tensor(CU))
        o.backward(do.float())
    return {"o": o.detach(), **{f"d{n}": leaves[n].grad for n in NAMES}}


def reference_run(values, do):
    """The float64 reference on the real tokens only (the tail is no sequence's)."""
    from linattn.reference import gated_delta_rule

    end = CU[-1]
    leaves = {n: t[:, :end].clone().requires_grad_() for n, t in values.items()}
    o, _ = gated_delta_rule(*(leaves[n] for n in NAMES), cu_seqlens=torch.tensor(CU))
    o.backward(do[:, :end])
    return {"o": o.detach(), **{f"d{n}": leaves[n].grad for n in NAMES}}


def test_tokens_before_the_tail_are_right():
    values, do = inputs()
    got, ref = fla_run(values, do), reference_run(values, do)
    end = CU[-1]
    assert_parity({n: t[:, :end].double() for n, t in got.items()}, ref, rtol=RTOL, name="fla-padded-tail/real")


@pytest.mark.xfail(strict=True, raises=TailUnwritten, reason=(
    "QwenLM/FlashQLA #28 (part 1), live in fla 0.6.0: chunk_gated_delta_rule with T > cu_seqlens[-1] leaves "
    "the padding tail's outputs and input gradients unwritten"))
def test_padded_tail_outputs_and_gradients_are_zeros(record_property):
    values, do = inputs()
    start = time.perf_counter()
    got = fla_run(values, do)
    tail = {n: t[:, CU[-1]:] for n, t in got.items()}
    unwritten = [n for n, t in tail.items() if not torch.equal(t, torch.zeros_like(t))]
    if unwritten:
        located = (f"tokens {CU[-1]}..{T - 1} (after cu_seqlens[-1] = {CU[-1]}, T = {T}): not zeros in "
                   f"{', '.join(unwritten)}; NaN (unwritten) in "
                   f"{', '.join(n for n, t in tail.items() if torch.isnan(t).any()) or 'none'}")
        record_property("seconds", f"{time.perf_counter() - start:.2f}")
        record_property("located", located)
        raise TailUnwritten(located)
