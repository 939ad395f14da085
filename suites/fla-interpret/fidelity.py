"""What the fla-interpret suite's tests share: the bound, the inputs, one call run both ways.

A case is one call of an fla entry point with its options. It runs twice on the same values: fla's
own kernels under Triton's interpreter on float32 CPU tensors (the process runs with
``--linattn-fla-interpreted``), and the same call under ``fla_on_cpu`` (the emulation, float64)
on float64 copies of those float32 values. Outputs and, with the same cotangents, the gradients of
every differentiable input must agree to RTOL.

RTOL = 1e-4, relative Frobenius error per tensor. Why: fla's kernels compute in float32 (the
interpreter runs each program's block ops in numpy float32), the emulation in float64, so what
is left is float32 rounding, amplified by chunked recurrences, exp of gates and the sums behind the
in-kernel gate's A_log / dt_bias gradients (a sum over every token and channel). Measured here:
worst 2.3e-6 (see test_ops_fidelity.py's docstring); the probe that preceded this suite saw at
most 3e-5 as max-abs over max-ref. 1e-4 stays above all of that, and a changed meaning is far
above it: the conv cache's dropped gradient is 0.6, a planted wrong option 1e-2 to 1.

Inputs sit where models put them, which is also where float32 is well conditioned: a raw gate
with no dt_bias is drawn about -4.5 (where dt_bias in [-7, -2] puts the others), so a token's
decay is exp(-A softplus(.)) ~ 0.5-1. Drawn unshifted (decays of exp(-10) to exp(-30) a token),
fla's float32 A_log gradient, a sum over every token that then cancels, was 3e-6 to 6e-4 off
over 12 seeds (fla's rounding, not a changed meaning: the emulation in float32 is off too).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from linattn.emulation import fla_on_cpu
from pytest_linattn import assert_parity

RTOL = 1e-4
F32, F64 = torch.float32, torch.float64
LOWER_BOUND = -5.0


def draw(gen, shape, kind="normal"):
    """Fresh float64 values of one kind, rounded to float32 (both sides see the same values)."""
    x = torch.randn(shape, generator=gen, dtype=F64)
    if kind == "logdecay":  # log decays in about [-3, 0)
        x = F.logsigmoid(x + 2.0)
    elif kind == "bounded":  # safe_gate's precomputed gate, in [lower_bound, 0)
        x = LOWER_BOUND * torch.sigmoid(x)
    elif kind == "raw_gate":  # a raw gate with no dt_bias to shift it: drawn where dt_bias puts it
        x = x - 4.5
    elif kind == "unit":
        x = torch.sigmoid(x)
    elif kind == "unit_vector":
        x = F.normalize(x, dim=-1)
    elif kind == "A_log":
        x = torch.empty(shape, dtype=F64).uniform_(1.0, 16.0, generator=gen).log()
    elif kind == "dt_bias":
        x = torch.empty(shape, dtype=F64).uniform_(-7.0, -2.0, generator=gen)
    elif kind == "weight":  # conv and norm weights near their usual scale
        x = 1.0 + 0.3 * x
    return x.to(F32).to(F64)


@dataclass
class Case:
    """One call: `op` is ``"fla.module:name"``; `tensors` name -> (shape, kind) or None (passed as None)."""

    op: str
    tensors: dict
    options: dict = field(default_factory=dict)
    cu_seqlens: list | None = None  # passed as cu_seqlens (a LongTensor) when given
    extra: dict = field(default_factory=dict)  # name -> callable(cu_seqlens tensor) -> value (cu_seqlens_cpu, seq_idx)
    grads: bool = True  # fla's fused_recurrent ops have no backward: forward only
    backprop: tuple | None = None  # the outputs that get a cotangent (None: all)

    def values(self, seed):
        gen = torch.Generator().manual_seed(seed)
        return {n: None if spec is None else draw(gen, *spec) for n, spec in self.tensors.items()}


def resolve(path):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def call(case, values, dtype):
    """(tensor outputs, leaves): the case's call on copies of `values` in `dtype`, resolved now
    (under fla_on_cpu the name is the emulation's)."""
    leaves = {n: None if v is None else v.to(dtype).requires_grad_(case.grads) for n, v in values.items()}
    options = dict(case.options)
    if case.cu_seqlens is not None:
        cu = torch.tensor(case.cu_seqlens, dtype=torch.long)
        options["cu_seqlens"] = cu
        options.update({name: make(cu) for name, make in case.extra.items()})
    out = resolve(case.op)(**leaves, **options)
    outputs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    return outputs, leaves


def assert_emulated(fn, what):
    """Under fla_on_cpu: else both sides would run fla's kernels and agree by construction."""
    assert getattr(fn, "__module__", "").startswith("linattn.emulation"), f"{what} is not emulated under fla_on_cpu"


def assert_not_emulated(fn, what):
    assert not getattr(fn, "__module__", "").startswith("linattn.emulation"), f"{what} is emulated outside fla_on_cpu"


def cotangents(outputs, backprop, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=F64) * (backprop is None or i in backprop)
            for i, o in enumerate(outputs)]


def backward(outputs, cots):
    loss = sum((o.double() * c).sum() for o, c in zip(outputs, cots) if o.requires_grad)
    loss.backward()


def run_both(case, seed):
    """{tensor name: fla's float32 result} and {tensor name: the emulation's float64 one}."""
    values = case.values(seed)
    assert_not_emulated(resolve(case.op), case.op)
    fla_out, fla_leaves = call(case, values, F32)
    with fla_on_cpu():
        assert_emulated(resolve(case.op), case.op)
        emu_out, emu_leaves = call(case, values, F64)
    assert len(fla_out) == len(emu_out), f"fla returns {len(fla_out)} tensors, the emulation {len(emu_out)}"
    fla_res = {f"output {i}": o for i, o in enumerate(fla_out)}
    emu_res = {f"output {i}": o for i, o in enumerate(emu_out)}
    if case.grads:
        cots = cotangents(emu_out, case.backprop)
        backward(fla_out, cots)
        backward(emu_out, cots)
        for n, leaf in fla_leaves.items():
            a, b = (None, None) if leaf is None else (leaf.grad, emu_leaves[n].grad)
            if a is not None or b is not None:  # a gradient only one side computes is compared with zeros
                fla_res[f"grad {n}"] = a if a is not None else torch.zeros_like(b, dtype=F32)
                emu_res[f"grad {n}"] = b if b is not None else torch.zeros_like(a, dtype=F64)
    return fla_res, emu_res


def assert_fidelity(fla_res, emu_res, name, cu_seqlens=None):
    """fla's float32 results against the emulation's, every tensor in one table."""
    __tracebackhide__ = True
    for key, t in fla_res.items():
        assert t.shape == emu_res[key].shape, f"{name} {key}: fla shape {tuple(t.shape)}, emulation {tuple(emu_res[key].shape)}"
        assert t.dtype != F64, f"{name} {key}: fla's result is float64: the interpreted kernels did not run"
    # cu_seqlens only locates the worst token; the dict also holds states and weight gradients
    assert_parity(fla_res, emu_res, rtol=RTOL, name=name,
                  cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens))


def check_case(cases, name, first_seed):
    """Case `name` of `cases` (seeded first_seed + its index) through fla's interpreted kernels and
    the emulation: assert_fidelity of the two."""
    case = cases[name]
    seed = first_seed + list(cases).index(name)
    fla_res, emu_res = run_both(case, seed)
    assert_fidelity(fla_res, emu_res, f"{name} (seed {seed})", cu_seqlens=case.cu_seqlens)
