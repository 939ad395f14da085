"""Delta-rule ops at production lengths against a float64 reference computed in pieces.

A kernel at 500k tokens cannot be checked against a float64 reference of the whole sequence at
once (the reference's intra-chunk terms alone would not fit), and its bugs live exactly there:
int32 offsets that wrap once B*T*H*K passes 2**31 (fla #1080), chunk masks that break past 65,536
tokens (fla #906). So the reference runs piece by piece with the state passed along (the
recurrence is exact across a cut), forward and backward (each piece recomputed, its input state's
gradient handed to the piece before), and each piece is compared with the same tokens of the
op's output and gradients as it is computed: nothing of the reference's size is ever held.

    assert_delta_rule_at_scale(op, ScaleShape(...), dtype=..., device=...)

judges each tensor by its relative error over the whole sequence (rtol), and each (token, head)
row by its error against the tensor's typical row norm (ROW_TOL): the first wrong row is named
(token, head), with how many rows are wrong, since a wrapped offset corrupts a range of rows
(their NaNs, if any, understate it: fla #1080 counted 4.7x more wrong elements than NaNs).
Plain module, no pytest.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from linattn.checks import fail, positive_int
from linattn.reference import gated_delta_rule, kda

__all__ = ["ROW_TOL", "RowErrors", "ScaleResult", "ScaleShape", "assert_delta_rule_at_scale", "assert_rows_match",
           "delta_rule_at_scale"]

ROW_TOL = 0.25  # a (token, head) row off by a quarter of the typical row norm: bf16 stays 10x below
INPUTS = ("q", "k", "v", "g", "beta")


@dataclasses.dataclass(frozen=True)
class ScaleShape:
    """One sequence batch of a delta-rule op: q, k `[batch, tokens, heads, head_k_dim]`, v
    `[batch, tokens, v_heads, head_v_dim]`; per_channel_decay: KDA's g `[.., v_heads, head_k_dim]`,
    else GDN's `[.., v_heads]`."""

    name: str
    tokens: int
    heads: int
    v_heads: int
    head_k_dim: int = 128
    head_v_dim: int = 128
    batch: int = 1
    per_channel_decay: bool = False

    def __post_init__(self):
        for field in ("tokens", "heads", "v_heads", "head_k_dim", "head_v_dim", "batch"):
            positive_int(getattr(self, field), f"ScaleShape.{field}")
        if self.v_heads % self.heads:
            fail("ScaleShape.v_heads", f"must be a multiple of heads ({self.heads}), got {self.v_heads}")

    @property
    def largest_offset(self) -> int:
        """Elements of the largest input (B*T*HV*max(K, V), and B*T*H*K): past 2**31 an int32
        offset into it wraps."""
        return self.batch * self.tokens * max(self.v_heads * max(self.head_k_dim, self.head_v_dim),
                                              self.heads * self.head_k_dim)

    def chunk_state_elements(self, chunk_size: int = 64) -> int:
        """Elements of a chunked kernel's per-chunk states `[B, chunks, HV, K, V]` (fla's h, and dh
        in the backward: chunk_size 64): with K = V = 128 twice the value input's at 64-token
        chunks, so they pass 2**31 at half the tokens the inputs do."""
        positive_int(chunk_size, "chunk_size")
        return self.batch * -(-self.tokens // chunk_size) * self.v_heads * self.head_k_dim * self.head_v_dim


@dataclasses.dataclass
class ScaleResult:
    shape: ScaleShape
    errors: dict  # tensor -> relative error over the whole sequence
    first_wrong: dict  # tensor -> (token, head, row error) of its first wrong row, or None
    wrong_rows: dict  # tensor -> rows over ROW_TOL (NaN rows included)
    nan_elements: dict  # tensor -> NaN or Inf elements of the op's side
    op_seconds: float  # the op's forward (and backward), synchronised
    reference_seconds: float
    peak_bytes: int  # the device's peak allocation during the op (0 on a CPU)

    def failures(self, rtol: float) -> list[str]:
        lines = []
        for name, err in self.errors.items():
            where = self.first_wrong[name]
            if not err <= rtol or where is not None or self.nan_elements[name]:
                at = (f"; first wrong row token {where[0]:,} head {where[1]} (off by {where[2]:.2e} of a typical "
                      f"row), {self.wrong_rows[name]:,} wrong rows" if where else "")
                nan = f"; {self.nan_elements[name]:,} NaN/Inf elements" if self.nan_elements[name] else ""
                lines.append(f"{self.shape.name} {name}: relative error {err:.2e} (rtol {rtol:.0e}){at}{nan}")
        return lines

    def table_row(self) -> str:
        worst = max(self.errors, key=lambda n: self.errors[n])
        return (f"{self.shape.name}: {self.shape.batch}x{self.shape.tokens:,} tokens, H {self.shape.heads}, "
                f"HV {self.shape.v_heads}, K {self.shape.head_k_dim}, V {self.shape.head_v_dim} "
                f"(largest offset {self.shape.largest_offset:,} = 2^{math.log2(self.shape.largest_offset):.2f}, "
                f"64-token chunk states 2^{math.log2(self.shape.chunk_state_elements()):.2f}); "
                f"worst {worst} {self.errors[worst]:.2e}; op {self.op_seconds:.1f} s, peak "
                f"{self.peak_bytes / 2**30:.1f} GiB; reference {self.reference_seconds:.1f} s")


def random_inputs(shape: ScaleShape, dtype: torch.dtype, device, seed: int) -> dict:
    """Fresh seeded inputs as the layers hand them: q, k l2-normalised, a log decay g in
    [-0.25, -0.005] per token (the cumulative decay of a 64-token chunk stays in float32's range),
    beta in (0, 1). g is float32, as the layers compute it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, HV, K, V = shape.batch, shape.tokens, shape.heads, shape.v_heads, shape.head_k_dim, shape.head_v_dim

    def randn(*size, dt=dtype):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(dt)

    def unit(*size):  # l2-normalised in float32, piece by piece of tokens to bound the float32 copy
        out = torch.empty(*size, device=device, dtype=dtype)
        for start in range(0, T, 1 << 16):
            piece = torch.randn(B, min(T - start, 1 << 16), *size[2:], generator=gen, device=device)
            out[:, start:start + piece.shape[1]] = F.normalize(piece, dim=-1).to(dtype)
        return out

    g_size = (B, T, HV, K) if shape.per_channel_decay else (B, T, HV)
    g = -torch.empty(*g_size, device=device, dtype=torch.float32).uniform_(0.005, 0.25, generator=gen)
    return dict(q=unit(B, T, H, K), k=unit(B, T, H, K), v=randn(B, T, HV, V), g=g,
                beta=torch.rand(B, T, HV, generator=gen, device=device, dtype=torch.float32).to(dtype))


def delta_rule_at_scale(op, shape: ScaleShape, *, dtype=torch.bfloat16, device="cuda", seed: int = 0,
                        piece_tokens: int = 1 << 16, backward: bool = True,
                        reference_device=None) -> ScaleResult:
    """Run op(q, k, v, g, beta) -> o (scale 1/sqrt(K), zero initial state) forward and, if backward,
    backward with a seeded output gradient; compare piece by piece with the float64 reference
    (gated_delta_rule, or kda for per_channel_decay) on reference_device (default: device)."""
    positive_int(piece_tokens, "piece_tokens")
    ref_device = torch.device(reference_device or device)
    device = torch.device(device)
    inputs = random_inputs(shape, dtype, device, seed)
    for t in inputs.values():
        t.requires_grad_(backward)
    d_out = None
    if backward:
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        d_out = torch.randn(shape.batch, shape.tokens, shape.v_heads, shape.head_v_dim, generator=gen,
                            device=device).to(dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    out = op(*(inputs[n] for n in INPUTS))
    if backward:
        out.backward(d_out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    op_seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    out = out.detach()

    names = ["o"] + ([f"d{n}" for n in INPUTS] if backward else [])
    acc = {n: RowErrors() for n in names}
    start = time.perf_counter()
    reference = kda if shape.per_channel_decay else gated_delta_rule
    scale = shape.head_k_dim ** -0.5

    def piece_inputs(lo, hi, grad):
        xs = [inputs[n].detach()[:, lo:hi].to(ref_device, torch.float64).requires_grad_(grad) for n in INPUTS]
        return xs

    bounds = [(lo, min(lo + piece_tokens, shape.tokens)) for lo in range(0, shape.tokens, piece_tokens)]
    states = [None]  # the state entering each piece
    for lo, hi in bounds:
        with torch.no_grad():
            o, state = reference(*piece_inputs(lo, hi, False), scale=scale, initial_state=states[-1],
                                 output_final_state=True)
        acc["o"].add(out[:, lo:hi], o, lo)
        states.append(state)
    if backward:
        grads = {f"d{n}": inputs[n].grad for n in INPUTS}
        d_state = None
        for (lo, hi), state_in in zip(reversed(bounds), reversed(states[:-1])):
            xs = piece_inputs(lo, hi, True)
            s_in = None if state_in is None else state_in.clone().requires_grad_(True)
            o, s_out = reference(*xs, scale=scale, initial_state=s_in, output_final_state=True)
            seeds = [d_out[:, lo:hi].to(ref_device, torch.float64)]
            outs = [o]
            if d_state is not None:
                outs.append(s_out)
                seeds.append(d_state)
            torch.autograd.backward(outs, seeds)
            for n, x in zip(INPUTS, xs):
                acc[f"d{n}"].add(grads[f"d{n}"][:, lo:hi], x.grad, lo)
            d_state = None if s_in is None else s_in.grad
    reference_seconds = time.perf_counter() - start
    return ScaleResult(shape, {n: a.error() for n, a in acc.items()}, {n: a.first_wrong() for n, a in acc.items()},
                       {n: a.wrong_rows for n, a in acc.items()}, {n: a.nan for n, a in acc.items()},
                       op_seconds, reference_seconds, peak)


def assert_delta_rule_at_scale(op, shape: ScaleShape, *, rtol: float, **kwargs) -> ScaleResult:
    """delta_rule_at_scale, then AssertionError naming each tensor over rtol, with a wrong row, or
    with a NaN, its first wrong (token, head) and how many rows are wrong."""
    result = delta_rule_at_scale(op, shape, **kwargs)
    lines = result.failures(rtol)
    if lines:
        raise AssertionError("delta rule at scale: " + result.table_row() + "\n  " + "\n  ".join(lines))
    return result


def assert_rows_match(actual: dict, reference: dict, *, rtol: float, label: str, piece_tokens: int = 1 << 15) -> dict:
    """Any op's tensors `[B, T, H, ...]` (or `[B, T, H*D]`, read as `[B, T, H, D]` with
    `reference`'s head split given as `{name: (tensor, heads)}`) against float64 references of the
    same shapes, by the at-scale rules: relative error per tensor over the sequence, and each
    (token, head) row against the typical row norm, the first wrong one named. Returns the errors;
    AssertionError naming every tensor over rtol, with a wrong row or a NaN."""
    errors, lines = {}, []
    for name, (ref, heads) in reference.items():
        acc = RowErrors()
        got = actual[name]
        for lo in range(0, ref.shape[1], piece_tokens):
            hi = min(lo + piece_tokens, ref.shape[1])
            split = (ref.shape[0], hi - lo, heads, -1)
            acc.add(got[:, lo:hi].reshape(split), ref[:, lo:hi].reshape(split), lo)
        errors[name] = acc.error()
        where = acc.first_wrong()
        if not errors[name] <= rtol or where is not None:
            at = (f"; first wrong row token {where[0]:,} head {where[1]} (off by {where[2]:.2e} of a typical row), "
                  f"{acc.wrong_rows:,} wrong rows" if where else "")
            lines.append(f"{label} {name}: relative error {errors[name]:.2e} (rtol {rtol:.0e}){at}")
    if lines:
        raise AssertionError("rows at scale:\n  " + "\n  ".join(lines))
    return errors


class RowErrors:
    """Squared error and norm over the pieces, and the rows [token, head] over ROW_TOL of the
    typical row norm (known only at the end: the first piece's rows are judged by their own
    piece's typical norm, the rest by the running one; the judged scale is the reference's)."""

    def __init__(self):
        self.err2 = self.ref2 = 0.0
        self.rows = 0
        self.nan = 0
        self.wrong_rows = 0
        self.first = None

    def add(self, actual, ref, token0):
        ref = ref.detach()
        actual = actual.detach().to(ref.device, torch.float64)
        finite = torch.isfinite(actual)
        self.nan += int((~finite).sum())
        diff = torch.where(finite, actual - ref, torch.full_like(ref, float("inf")))
        self.err2 += float(torch.where(finite, diff, 0).square().sum())
        self.ref2 += float(ref.square().sum())
        # rows: one (batch, token, head) over the last dim; B folds into tokens in the report
        row_err = diff.flatten(3).norm(dim=-1) if diff.dim() > 3 else diff.abs()
        row_ref = ref.flatten(3).norm(dim=-1) if ref.dim() > 3 else ref.abs()
        self.rows += row_ref.numel()
        typical = math.sqrt(self.ref2 / max(self.rows, 1))
        wrong = ~(row_err <= ROW_TOL * typical)
        count = int(wrong.sum())
        if count:
            self.wrong_rows += count
            b, t, h = (int(i) for i in wrong.nonzero()[0])
            where = (token0 + t, h, float(row_err[b, t, h]) / typical if typical else float("inf"))
            if self.first is None or where[0] < self.first[0]:
                self.first = where

    def error(self) -> float:
        if self.nan:
            return float("nan")
        return math.sqrt(self.err2 / self.ref2) if self.ref2 else float("inf")

    def first_wrong(self):
        return self.first
