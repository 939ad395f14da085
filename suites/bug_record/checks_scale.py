"""The record's at-scale checks on a CPU (pytest_linattn.harness.scale), at shapes whose plants'
boundaries (a wrapped offset of 2**17 elements, a chunk of 256 tokens) stand for fla's (2**31
elements, 65,536 tokens): `delta_rule_at_scale` for a delta-rule op, `rows_at_scale` for an
elementwise op (RWKV-7's output correction)."""

from __future__ import annotations

import torch

from bug_record.plants_scale import CHUNK, gate_output_correction
from pytest_linattn.harness.scale import ScaleShape, assert_delta_rule_at_scale, assert_rows_match

# v holds 192,000 elements, past the plants' 2**17
DELTA_RULE_SHAPE = dict(name="record-scale", tokens=3000, heads=2, v_heads=4, head_k_dim=16, head_v_dim=16)
ROWS_LABEL = "record-gate-output-correction"


def delta_rule_at_scale(subject, seed: int):
    from linattn import kernels

    def linattn_op(q, k, v, g, beta):  # the clean subject: linattn's GDN op
        return kernels.gated_delta_rule(q, k, v, g, beta, scale=q.shape[-1] ** -0.5)[0]

    return assert_delta_rule_at_scale(subject or linattn_op, ScaleShape(**DELTA_RULE_SHAPE), rtol=1e-5,
                                      dtype=torch.float32, device="cpu", seed=seed, piece_tokens=512)


def rows_at_scale(subject, seed: int):
    """subject(o, r, k, r_k, v, g) -> out over three chunks and a bit, float32, forward and backward,
    against the float64 formula row by row (each token's head of every per-token tensor)."""
    B, T, H, D = 1, 3 * CHUNK + 17, 2, 8
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(o=(B, T, H * D), r=(B, T, H, D), k=(B, T, H, D), r_k=(H, D), v=(B, T, H, D), g=(B, T, H * D))
    xs = {n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    d_out = torch.randn(B, T, H * D, generator=gen, dtype=torch.float64)
    got = {n: x.float().requires_grad_() for n, x in xs.items()}
    ref = {n: x.clone().requires_grad_() for n, x in xs.items()}
    out = (subject or gate_output_correction)(*got.values())
    out.backward(d_out.float())
    ref_out = gate_output_correction(*ref.values())
    ref_out.backward(d_out)
    per_token = [n for n, s in shapes.items() if len(s) > 2]
    actual = {"out": out.detach(), **{f"d{n}": got[n].grad for n in per_token}}
    expected = {"out": (ref_out.detach(), H), **{f"d{n}": (ref[n].grad, H) for n in per_token}}
    return assert_rows_match(actual, expected, rtol=1e-5, label=ROWS_LABEL)
