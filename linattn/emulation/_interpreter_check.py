"""Tiny kernels for `linattn.emulation.interpreted`'s self-check.

Imported only after TRITON_INTERPRET=1 (its kernel is then an interpreted one). They need the
patches: two configs (without the one-config pruning the autotuner benchmarks, which needs a GPU
driver), a ``range`` loop variable used as a tensor (``i.to(tl.int64)``, as fla's kernels do),
``tl.gather`` bound by name in the module (as fla.ops.utils.op binds it), a load and a store
masked by ``scalar & block`` (as fla's conv backward masks), and a dot with
``input_precision="bf16x3"`` (KDA's safe-gate kernels ask for it).
"""

import torch
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 8})], key=["n"])
@triton.jit
def _blocked_sum(x, y, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, tl.cdiv(n, BLOCK)):
        offs = i.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x + offs, mask=offs < n, other=0.0)
    tl.store(y + tl.arange(0, BLOCK), acc)


_gather = tl.gather  # bound by name, as fla.ops.utils.op does


@triton.jit
def _gather_first(x, y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = (n > 0) & (offs < BLOCK)  # a scalar int1 & a block int1: Triton 3.9's interpreter makes it int32
    block = tl.load(x + offs, mask=mask, other=0.0)[None, :]
    tl.store(y + offs[None, :], _gather(block, tl.zeros([1, BLOCK], dtype=tl.int32), axis=0), mask=mask[None, :])


def run() -> None:
    """Raises when the interpreted kernel does not run or computes a wrong sum."""
    x = torch.arange(10, dtype=torch.float32)
    y = torch.zeros(8, dtype=torch.float32)
    _blocked_sum[(1,)](x, y, 10)
    total = float(y.sum())
    if total != 45.0:
        raise RuntimeError(f"a blocked sum of 0..9 gave {total}, not 45")
    x, y = torch.arange(4, dtype=torch.float32), torch.zeros(4, dtype=torch.float32)
    _gather_first[(1,)](x, y, 1, 4)
    if not torch.equal(x, y):
        raise RuntimeError(f"a masked gather along a one-row axis gave {y.tolist()}, not {x.tolist()}")
    error = _dot_error(torch.float32, "bf16x3")
    if not error < 1e-4:
        raise RuntimeError(f"a float32 dot with input_precision='bf16x3' is {error:.2g} off")


@triton.jit
def _dot16(a, b, c, PRECISION: tl.constexpr):
    idx = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(c + idx, tl.dot(tl.load(a + idx), tl.load(b + idx), input_precision=PRECISION))


def _dot_error(dtype, precision) -> float:
    """Max abs error of a 16x16 dot of `dtype` tensors (values of order 1) against float32's."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(2))
    c = torch.zeros(16, 16, dtype=torch.float32)
    _dot16[(1,)](a, b, c, precision)
    return float((c - a.float() @ b.float()).abs().max())


def bf16_dot_is_right() -> bool:
    """Whether a 16x16 bfloat16 dot comes out right (Triton 3.9's interpreter multiplies the raw
    uint16 bits it stores bf16 in)."""
    return _dot_error(torch.bfloat16, "ieee") < 1e-2
