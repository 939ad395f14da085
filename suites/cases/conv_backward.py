"""fla's short-conv backward on the bug record's two kernel rows, shared by fla-interpret (fla's
kernels under Triton's interpreter, float32, CPU) and gpu-1 (compiled, bf16, CUDA):

- fla PR #955 (open; live in fla 0.6.0): ``causal_conv1d`` with ``cu_seqlens`` and a batch of
  B > 1 rows. fla's varlen kernels address token ``bos`` of sequence n as ``x + bos * stride_t``
  (``fla/modules/causal_conv1d/ops.py``), so ``cu_seqlens`` runs over the B*T flattened tokens of
  a contiguous x (PR #955's repro: x ``[2, T, D]``, ``cu_seqlens = [0, T, 2T]``): y and dx come out
  right. The backward sizes its per-chunk weight-gradient buffer ``dw`` as B*NT rows
  (``weight.new_empty(B*NT, D, W)``, NT the chunks of all sequences), but in the varlen branch a
  program's row is ``i_tg = i_t``, whatever its batch index: rows NT..B*NT-1 are never written,
  and ``dw.sum(0)`` adds them to dweight (``db`` likewise, with a bias).
- fla #871 / #1138 (fixed in fla 0.6.0): the backward kernel and ``compute_dh0_kernel`` read dy
  with hard-coded contiguous strides; a dy that arrives as a strided view (the conv output's slice
  of a fused gradient: ``torch.cat`` of q, k, v convs backpropagates narrow views) gave wrong dx
  and dh0. The check gives fla such a dy, with cu_seqlens and an initial state (so the dh0 kernel
  runs too); the plant `bug_record.plants_layer.GradReadAsContiguous` reads it as contiguous.

What is unwritten memory worth? The rows fla never writes hold whatever the allocator hands back:
on a GPU an earlier tensor's bytes, on a CPU malloc's; zeros now and then, which would give the
right dweight by luck. `unwritten_memory_as_nan` turns on PyTorch's own fill of uninitialized
memory (``torch.use_deterministic_algorithms`` with ``torch.utils.deterministic
.fill_uninitialized_memory``: floats from ``torch.empty`` are NaN), so a row no program wrote is
NaN every run, and a right path (every row written) is unaffected.

The reference is ``linattn.reference.short_conv`` in float64, run row by row and, inside a row,
sequence by sequence (its cu_seqlens), on the values fla gets (rounded to fla's dtype first).
"""

from __future__ import annotations

import contextlib
import re

import torch

from linattn import reference
from pytest_linattn.parity import assert_parity

__all__ = ["CONV", "DweightFromUnwrittenRows", "W", "assert_varlen_batch", "assert_conv_grads", "draw", "fla_conv",
           "flat_cu_seqlens", "reference_grads", "unwritten_memory_as_nan"]

CONV = "fla.modules.causal_conv1d.ops:causal_conv1d"  # fla 0.6.0's triton entry (the default backend)
W = 4


def flat_cu_seqlens(row_cus) -> list[int]:
    """The boundaries over the flattened tokens of rows that each pack whole sequences (every row
    T long): row b's boundaries shifted by b*T."""
    T = row_cus[0][-1]
    assert all(cu[0] == 0 and cu[-1] == T for cu in row_cus), row_cus
    return [0] + [b * T + end for b, cu in enumerate(row_cus) for end in cu[1:]]


def draw(seed, B, T, D, *, dtype, fused=False, states=0):
    """Fresh float64 values rounded to `dtype` (both sides see the same values): x ``[B, T, D]``,
    weight ``[D, W]``, dy ``[B, T, D]`` (``[B, T, 3D]`` when `fused`: the conv's gradient is its
    first D channels), and `states` initial states ``[N, D, W]`` (fla's cache layout) when > 0."""
    gen = torch.Generator().manual_seed(seed)
    rounded = lambda t: t.to(dtype).double()  # noqa: E731
    values = {"x": rounded(torch.randn(B, T, D, generator=gen, dtype=torch.float64)),
              "weight": rounded(1.0 + 0.3 * torch.randn(D, W, generator=gen, dtype=torch.float64)),
              "dy": rounded(torch.randn(B, T, 3 * D if fused else D, generator=gen, dtype=torch.float64))}
    if states:
        values["initial_state"] = rounded(torch.randn(states, D, W, generator=gen, dtype=torch.float64))
    return values


def reference_grads(values, row_cus) -> dict[str, torch.Tensor]:
    """y, dx, dweight (and dh0 with an initial state) of the float64 reference, one row at a time,
    each row's sequences by its own cu_seqlens; y, dx flattened to ``[1, B*T, D]``. The cotangent
    is dy's first D channels. fla's conv cache ``[N, D, W]`` enters as its last W-1 columns (column
    0 is shifted out), so dh0's column 0 is zero."""
    D = values["weight"].shape[0]
    x = values["x"].clone().requires_grad_()
    w = values["weight"].clone().requires_grad_()
    h0 = values.get("initial_state")
    h0 = None if h0 is None else h0.clone().requires_grad_()
    ys, first = [], 0
    for b, cu in enumerate(row_cus):
        n = len(cu) - 1
        state = None if h0 is None else h0[first:first + n, :, 1:]
        ys.append(reference.short_conv(x[b:b + 1], w, cu_seqlens=torch.tensor(cu), activation="silu",
                                       initial_state=state))
        first += n
    y = torch.cat(ys)
    (y * values["dy"][..., :D]).sum().backward()
    out = {"y": y.detach().flatten(0, 1)[None], "dx": x.grad.flatten(0, 1)[None], "dweight": w.grad}
    if h0 is not None:
        out["dh0"] = h0.grad
    return out


@contextlib.contextmanager
def unwritten_memory_as_nan():
    """``torch.empty`` (and ``new_empty``) fill floats with NaN inside (PyTorch's deterministic
    mode, warn-only: nothing else changes); the previous settings restored after."""
    import torch.utils.deterministic as deterministic

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        deterministic.fill_uninitialized_memory = was[2]


def fla_conv(values, *, cu_seqlens, rows, device, dtype, plant=None) -> tuple[dict[str, torch.Tensor], list]:
    """fla's causal_conv1d (silu, no bias) forward and backward on `values` in `dtype` on `device`:
    x as `rows` batch rows (``[rows, B*T/rows, D]``, contiguous), `cu_seqlens` (a list, or None)
    over its flattened tokens. dy is passed as given: a strided view when `values["dy"]` is fused.
    `plant`: an autograd Function applied to fla's output (the plant sits between the gradient and
    fla's backward). The backward runs under `unwritten_memory_as_nan`.

    Returns ({"y", "dx" as ``[1, B*T, D]``, "dweight"[, "dh0"]}, the contiguity of each gradient
    that reached fla's output)."""
    import importlib

    module, _, name = CONV.partition(":")
    causal_conv1d = getattr(importlib.import_module(module), name)
    D = values["weight"].shape[0]
    shape = (rows, values["x"].numel() // (rows * D), D)
    x = values["x"].to(device, dtype).reshape(shape).contiguous().requires_grad_()
    w = values["weight"].to(device, dtype).requires_grad_()
    h0 = values.get("initial_state")
    h0 = None if h0 is None else h0.to(device, dtype).requires_grad_()
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long, device=device)
    y, _ = causal_conv1d(x, weight=w, activation="silu", initial_state=h0, cu_seqlens=cu)
    arrived = []
    y.register_hook(lambda grad: arrived.append(grad.is_contiguous()))
    out = y if plant is None else plant.apply(y)
    dy = values["dy"].to(device, dtype).reshape(*shape[:2], -1)[..., :D]  # a view: strided when fused
    with unwritten_memory_as_nan():
        out.backward(dy)
    results = {"y": y.detach().reshape(1, -1, D), "dx": x.grad.reshape(1, -1, D), "dweight": w.grad}
    if h0 is not None:
        results["dh0"] = h0.grad
    return results, arrived


def assert_conv_grads(results, ref, *, rtol, cu_seqlens, name):
    """y and dx located by (sequence, token) over the flattened tokens; dweight (and dh0) by
    index. AssertionError naming the tensor that is off."""
    __tracebackhide__ = True
    tokens = {k: results[k] for k in ("y", "dx")}
    assert_parity(tokens, {k: ref[k] for k in tokens}, rtol=rtol, name=f"{name} tokens",
                  cu_seqlens=torch.tensor(cu_seqlens))
    params = {k: v for k, v in results.items() if k not in tokens}
    assert_parity(params, {k: ref[k] for k in params}, rtol=rtol, name=f"{name} weights", activations=False)


class DweightFromUnwrittenRows(AssertionError):
    """fla PR #955's failure: fla's y and dx right, every element of its dweight NaN (rows of the
    weight-gradient buffer that no program wrote, summed in). `located`: the report's dweight row."""

    def __init__(self, message, located=""):
        super().__init__(message)
        self.located = located


def assert_varlen_batch(results, ref, *, rtol, cu_seqlens, name):
    """PR #955's check on fla's results for B > 1 rows with cu_seqlens (`fla_conv`): y and dx
    (a plain AssertionError if off: not this bug), then dweight. DweightFromUnwrittenRows when
    the report's dweight row says NaN and every element is NaN; any other dweight failure as it is."""
    __tracebackhide__ = True
    tokens = {k: results[k] for k in ("y", "dx")}
    assert_parity(tokens, {k: ref[k] for k in tokens}, rtol=rtol, name=name, cu_seqlens=torch.tensor(cu_seqlens))
    try:
        assert_parity(results["dweight"], ref["dweight"], rtol=rtol, name=f"{name} dweight", activations=False)
    except AssertionError as failure:
        report = str(failure)
        row = re.search(rf"^\s*({re.escape(name)} dweight\s+nan\s.*)$", report, flags=re.M)
        if row and bool(results["dweight"].isnan().all()):
            located = re.sub(r"\s{2,}", "  ", row.group(1).strip())
            raise DweightFromUnwrittenRows(f"fla's y and dx right, every element of its dweight NaN:\n{report}",
                                           located) from None
        raise
