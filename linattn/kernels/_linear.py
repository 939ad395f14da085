"""A linear layer with float32 output for bf16 weights: one entry, backends as a parameter.

KDA's gate is computed in float32 from its input projections on (see kimi_delta_attention.py).
"torch" upcasts both operands and runs a float32 matmul (any device; on CUDA without TF32 that
runs at a fraction of bf16 tensor-core speed). "bf16_split" runs bf16 tensor-core matmuls with
float32 accumulation and float32 output (`torch.mm(..., out_dtype=torch.float32)`, CUDA only): a
bf16 operand is exact there, and a float32 input is split into two bf16 parts, hi + lo with
|lo| <= 2^-8 |hi|, so the output keeps about 2^-16 relative precision instead of bf16's 2^-8.
Gradients are bf16-precise: the incoming gradient is rounded to bf16 (exact where it comes from
a bf16 kernel, as in the layers) and x enters the weight's gradient as its hi part; each result
is rounded to its operand's dtype.

bias and round_to: KDA's f + dt_bias, rounded to bf16 once after the cancellation. With
"bf16_split" and round_to bf16 the bias enters the matmul itself, as three bf16 parts (exact to
2^-24 of it) against columns of ones, so the float32 accumulator holds the whole sum and the
matmul writes bf16 once: no float32 output in memory (at KDA's gate, 4 bytes a gate element). Its
backward takes the bf16 gradient as it comes instead of through float32 copies.
"""

import torch
import torch.nn.functional as F

from linattn.checks import fail

BACKENDS = ("torch", "bf16_split")


def float32_linear(x: torch.Tensor, weight: torch.Tensor, backend: str = "torch", *,
                   bias: torch.Tensor | None = None, round_to: torch.dtype | None = None) -> torch.Tensor:
    """x `[..., in]` @ weight `[out, in]`.T (+ bias `[out]`) in float32 precision, returned in
    float32 (float64 stays float64 with the "torch" backend), or rounded once to round_to."""
    if backend not in BACKENDS:
        fail("backend", f"must be one of {BACKENDS}, got {backend!r}")
    if not (weight.dim() == 2 and x.shape[-1] == weight.shape[1]):
        fail("weight", f"must be [out, {x.shape[-1]}], got shape {tuple(weight.shape)}")
    if not (bias is None or bias.shape == weight.shape[:1]):
        fail("bias", f"must be None or [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    if not (round_to is None or (isinstance(round_to, torch.dtype) and round_to.is_floating_point)):
        fail("round_to", f"must be None or a floating dtype, got {round_to!r}")
    if backend == "torch":
        up = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
        y = F.linear(x.to(up), weight.to(up), None if bias is None else bias.to(up))
        return y if round_to is None else y.to(round_to)
    if not (x.is_cuda and weight.is_cuda):
        fail("backend", f"'bf16_split' needs CUDA tensors, got {x.device}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        fail("weight", f"must be bf16 or float32 for 'bf16_split', got {weight.dtype}")
    return _Bf16SplitLinear.apply(x, weight, bias, round_to)


def _parts(t: torch.Tensor, n: int = 2) -> list[torch.Tensor]:
    """bf16 parts summing to t: t itself when bf16, else n parts, each the bf16 rounding of what
    the ones before leave (two: about 2^-16 relative, hi and lo; three: 2^-24). The remainders
    stay in t's dtype (a bf16 part promotes exactly), one kernel each."""
    if t.dtype == torch.bfloat16:
        return [t]
    parts, rest = [], t
    for _ in range(n - 1):
        parts.append(rest.bfloat16())
        rest = rest - parts[-1]
    return parts + [rest.bfloat16()]


def _mm_with_bias_to_bf16(pa: list[torch.Tensor], pb: list[torch.Tensor], bias: torch.Tensor) -> torch.Tensor:
    """`_mm`'s terms + bias in one bf16 matmul, its float32 accumulator rounded once: the terms'
    operands stacked along the inner dimension, then 8 more: columns of ones against the bias's
    three bf16 parts and five rows of zeros (a multiple of 8 stays one, as the tensor cores want).
    The inner width is small (KDA's f_b_proj: 2 x 128 + 8), so cuBLAS does not split it (a split-K
    sum may be reduced in bf16). Every constant is made on the device: a tensor from host data
    would be a pageable copy, which waits for the stream."""
    terms = _terms(pa, pb)
    bias_parts = _parts(bias.float(), 3)
    width = bias.shape[0]
    bias_rows = torch.cat([p[None] for p in bias_parts] + [bias_parts[0].new_zeros(1, width).expand(5, width)])
    ones = bias_parts[0].new_ones(1, 1).expand(terms[0][0].shape[0], 8)
    return torch.mm(torch.cat([ta for ta, _ in terms] + [ones], dim=1),
                    torch.cat([tb for _, tb in terms] + [bias_rows], dim=0))


def _terms(pa: list[torch.Tensor], pb: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The products of bf16 parts (`_parts`) that make a @ b to about 2^-16: hi x hi and the
    hi x lo ones (lo x lo, 2^-16 of the result, is left out)."""
    return [(pa[0], pb[0])] + [(ta, pb[0]) for ta in pa[1:]] + [(pa[0], tb) for tb in pb[1:]]


def _mm(pa: list[torch.Tensor], pb: list[torch.Tensor]) -> torch.Tensor:
    """Sum of `_terms` as matmuls with float32 output."""
    terms = _terms(pa, pb)
    if len(terms) > 1 and pa[0].shape[1] <= pb[0].shape[1]:
        # inner dimension no wider than the output (f_b_proj: 128 -> HV * dk): one matmul over
        # the terms stacked along it, cheaper than adding float32 outputs
        return torch.mm(torch.cat([ta for ta, _ in terms], dim=1), torch.cat([tb for _, tb in terms], dim=0),
                        out_dtype=torch.float32)
    out = torch.mm(*terms[0], out_dtype=torch.float32)
    for ta, tb in terms[1:]:
        out += torch.mm(ta, tb, out_dtype=torch.float32)
    return out


class _Bf16SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, round_to):
        x2 = x.reshape(-1, x.shape[-1])
        x_parts, w_parts = _parts(x2), _parts(weight)
        # backward reads only the bf16 hi parts: saved instead of float32 x or weight, half the bytes
        ctx.save_for_backward(x_parts[0], w_parts[0])
        ctx.shapes_and_dtypes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if round_to == torch.bfloat16 and bias is not None:
            y = _mm_with_bias_to_bf16(x_parts, [p.t() for p in w_parts], bias)
            return y.view(*x.shape[:-1], weight.shape[0])
        y = _mm(x_parts, [p.t() for p in w_parts])
        if round_to not in (None, torch.float32):
            # the bias added in float32 and the sum rounded in one pass
            out = torch.empty(y.shape, dtype=round_to, device=y.device)
            y = torch.add(y, bias, out=out) if bias is not None else y.to(round_to)
        elif bias is not None:
            y += bias
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x_hi, w_hi = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, bias_dtype = ctx.shapes_and_dtypes
        dy_rows = dy.reshape(-1, dy.shape[-1])
        dy2 = dy_rows.bfloat16()  # no copy when round_to was bf16
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(dy2, w_hi, out_dtype=torch.float32).view(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.mm(dy2.t(), x_hi, out_dtype=torch.float32).to(w_dtype)
        if ctx.needs_input_grad[2]:
            dbias = dy_rows.sum(0, dtype=torch.float32).to(bias_dtype)
        return dx, dw, dbias, None
