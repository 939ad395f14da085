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
