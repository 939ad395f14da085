"""fla #1080's mechanism at a CPU's scale: a kernel's element offsets kept in too few bits, so past
the width's range a load reads the wrapped offset's elements. fla's chunk kernels computed their
block-pointer offsets in int32 and went wrong past B*T*H*K = 2**31; here the width is 2**17, so
the at-scale check (pytest_linattn.harness.scale) sees it on a few thousand tokens."""

from __future__ import annotations

import re

import torch

from linattn import kernels

WRAP = 1 << 17  # the plant's offset range: elements of v past it are read from offset % WRAP


def gated_delta_rule_reading_v_through_wrapped_offsets(q, k, v, g, beta):
    """linattn's GDN op with v read through an element offset kept modulo WRAP."""
    flat = v.reshape(-1)
    wrapped = flat[torch.arange(flat.numel(), device=v.device) % WRAP].view_as(v)
    return kernels.gated_delta_rule(q, k, wrapped, g, beta, scale=q.shape[-1] ** -0.5)[0]


def first_wrapped_token(v_heads: int, head_v_dim: int) -> int:
    """The first token whose v row is read through a wrapped offset."""
    return WRAP // (v_heads * head_v_dim)


def located(name: str, v_heads: int, head_v_dim: int) -> str:
    """The at-scale report's line for the outputs: wrong from the first wrapped token on."""
    return (rf"{re.escape(name)} o: relative error \S+ \(rtol \S+\); first wrong row token "
            rf"{first_wrapped_token(v_heads, head_v_dim):,} head \d+ ")


# fla #906: RWKV-7's output correction in chunks of CHUNK tokens; its mask compared a token's
# absolute index with the chunk size, so every chunk after the first was skipped (65,536 tokens
# in fla; CHUNK here, so a CPU case crosses it)
CHUNK = 256


def gate_output_correction(o, r, k, r_k, v, g):
    """RWKV-7's output correction and gate, `(o + ((r * k * r_k).sum(-1) * v).view_as(o)) * g`
    (o, g `[B, T, H*D]`; r, k, v `[B, T, H, D]`; r_k `[H, D]`), in the inputs' dtype: the clean op."""
    correction = ((r * k * r_k).sum(-1, keepdim=True) * v).reshape(o.shape)
    return (o + correction) * g


class _SkippingTailChunks(torch.autograd.Function):
    """The op computed chunk by chunk, a chunk's tokens masked by `absolute index < CHUNK`: the
    chunks after the first are never written, forward or backward (unwritten memory: NaN)."""

    @staticmethod
    def forward(ctx, o, r, k, r_k, v, g):
        ctx.save_for_backward(o, r, k, r_k, v, g)
        out = torch.full_like(o, float("nan"))
        out[:, :CHUNK] = gate_output_correction(o[:, :CHUNK], r[:, :CHUNK], k[:, :CHUNK], r_k, v[:, :CHUNK],
                                                g[:, :CHUNK])
        return out

    @staticmethod
    def backward(ctx, d_out):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            head = gate_output_correction(*(x[:, :CHUNK] if x.dim() > 2 else x for x in inputs))
            grads = torch.autograd.grad(head, inputs, d_out[:, :CHUNK])
        out = []
        for x, grad in zip(inputs, grads):
            if x.dim() > 2:  # per-token gradients: the tail chunks unwritten
                grad = grad.clone()
                grad[:, CHUNK:] = float("nan")
            out.append(grad)
        return tuple(out)


def gate_output_correction_skipping_tail_chunks(o, r, k, r_k, v, g):
    return _SkippingTailChunks.apply(o, r, k, r_k, v, g)


def located_tail_chunk(label: str) -> str:
    return rf"{re.escape(label)} out: relative error \S+ \(rtol \S+\); first wrong row token {CHUNK:,} head 0 "
