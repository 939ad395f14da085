"""Gated RMSNorm: one entry, backends as a parameter.

"torch" computes in at least float32 with torch ops (any device); "fla" runs fla 0.6.0's fused
Triton kernel `rms_norm_gated` (fla/modules/norm/fused_norm_gate.py, which also computes its
statistics in float32).
"""

import torch
import torch.nn.functional as F

from linattn import selection
from linattn.checks import fail

BACKENDS = ("torch", "fla")
ACTIVATIONS = ("silu", "sigmoid")


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """t in float32 if its dtype is lower (bf16, fp16); float32 and float64 pass unchanged.

    The one precision rule of the layers' small elementwise math (decay gate, beta, gated RMSNorm
    statistics), as the references do: HF Qwen3-Next computes `g = -A_log.float().exp() *
    softplus(a.float() + dt_bias)`, and fla computes the KDA gate, the in-kernel beta sigmoid and
    the gated RMSNorm in float32 and takes g and beta in float32.
    """
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    activation: str,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim, times weight, times act(gate) (norm before gate, as HF and fla).

    activation: "silu" (Qwen3-Next / Qwen3.5) or "sigmoid" (KDA). Statistics in at least float32;
    returns x's dtype (the output projection's input). backend None: "fla" for CUDA tensors where
    `selection.gate_norm_backend()` picks it, else "torch".
    """
    if not (backend is None or backend in BACKENDS):
        fail("backend", f"must be None or one of {BACKENDS}, got {backend!r}")
    if activation not in ACTIVATIONS:
        fail("activation", f"must be one of {ACTIVATIONS}, got {activation!r}")
    if gate.shape != x.shape:
        fail("gate", f"must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if weight.shape != x.shape[-1:]:
        fail("weight", f"must have shape {tuple(x.shape[-1:])}, got {tuple(weight.shape)}")
    if backend is None:
        backend = selection.gate_norm_backend() if x.is_cuda else "torch"
    if backend == "fla":
        if not x.is_cuda:
            fail("backend", f"'fla' runs fla's GPU kernel and needs CUDA tensors, got x on {x.device}")
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        # fla's kernel wants one dtype for x, gate and weight
        y = rms_norm_gated(x, gate.to(x.dtype), weight.to(x.dtype), None, activation=activation, eps=eps)
        return y.to(x.dtype)
    xc = at_least_float32(x)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xc.dtype)
    gate = gate.to(xc.dtype)
    y = y * (F.silu(gate) if activation == "silu" else torch.sigmoid(gate))
    return y.to(x.dtype)
