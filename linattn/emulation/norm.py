"""fla's norms (``fla.modules.norm``) in plain torch, in the emulation's compute dtype: the gated
norms (``fused_norm_gate``) and ``l2norm`` (``= l2_norm``; ``L2Norm`` calls it).

The gated norms, fla's math kept here: ``h = x + residual``; the norm of h over the last dim (RMS:
``h / sqrt(mean(h^2) + eps)``; layer norm: ``(h - mean) / sqrt(var + eps)``, biased variance),
then ``* weight + bias``, then the output gate: ``* g * sigmoid(g)`` ("swish"/"silu") or
``* sigmoid(g)`` ("sigmoid"). The output is in x's dtype. With ``prenorm`` the functions also
return the residual stream h: in residual's dtype when given, float32 with
``residual_in_fp32``, else x itself (fla's return). The ``*_gate_linear`` variants gate with
swish and apply ``F.linear(y, linear_weight, linear_bias)``.

``l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dim, in ``output_dtype`` (None: x's).

fla's ``layernorm_gated`` (``RMSNormGated``, group norms, gate before the norm) is a different
module and is not emulated here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linattn.emulation.patching import compute_dtype, refuse

ACTIVATIONS = ("swish", "silu", "sigmoid")

__all__ = [
    "layer_norm_gated", "rms_norm_gated", "layer_norm_swish_gate_linear", "rms_norm_swish_gate_linear", "l2norm",
    "PATCHES",
]


def _norm_gate(name, x, g, weight, bias, activation, residual, residual_in_fp32, eps, is_rms_norm):
    """(gated norm output in the compute dtype, the residual stream as fla returns it)."""
    if activation not in ACTIVATIONS:
        refuse(name, "activation", activation)
    if residual is not None:
        assert residual.shape == x.shape
    dtype = compute_dtype()
    h = x.to(dtype) if residual is None else x.to(dtype) + residual.to(dtype)
    if is_rms_norm:
        h_hat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    else:
        centered = h - h.mean(-1, keepdim=True)
        h_hat = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    y = h_hat if weight is None else h_hat * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    gate = g.reshape(h.shape).to(dtype)
    y = y * gate * torch.sigmoid(gate) if activation in ("swish", "silu") else y * torch.sigmoid(gate)

    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else None)
    residual_out = x.reshape(x.shape) if residual_dtype is None else h.to(residual_dtype)
    return y, residual_out


def layer_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False, eps=1e-6):
    y, residual_out = _norm_gate("layer_norm_gated", x, g, weight, bias, activation, residual, residual_in_fp32, eps, False)
    y = y.to(x.dtype)
    return (y, residual_out) if prenorm else y


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False, eps=1e-6):
    y, residual_out = _norm_gate("rms_norm_gated", x, g, weight, bias, activation, residual, residual_in_fp32, eps, True)
    y = y.to(x.dtype)
    return (y, residual_out) if prenorm else y


def _gate_linear(name, x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual, prenorm, residual_in_fp32, eps,
                 is_rms_norm):
    if linear_weight is None:
        refuse(name, "linear_weight", None)
    if torch.is_autocast_enabled():
        refuse(name, "autocast", True)
    y, residual_out = _norm_gate(name, x, g, norm_weight, norm_bias, "swish", residual, residual_in_fp32, eps, is_rms_norm)
    dtype = y.dtype
    out = F.linear(y, linear_weight.to(dtype), None if linear_bias is None else linear_bias.to(dtype))
    out = out.to(x.dtype)  # fla: the linear runs in x's dtype
    return (out, residual_out) if prenorm else out


def layer_norm_swish_gate_linear(x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, prenorm=False,
                                 residual_in_fp32=False, eps=1e-6):
    return _gate_linear("layer_norm_swish_gate_linear", x, g, norm_weight, norm_bias, linear_weight, linear_bias,
                        residual, prenorm, residual_in_fp32, eps, False)


def rms_norm_swish_gate_linear(x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, prenorm=False,
                               residual_in_fp32=False, eps=1e-6):
    return _gate_linear("rms_norm_swish_gate_linear", x, g, norm_weight, norm_bias, linear_weight, linear_bias,
                        residual, prenorm, residual_in_fp32, eps, True)


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x²) + eps) over the last dim, in output_dtype (None: x's)."""
    y = x.to(compute_dtype())
    y = y * torch.rsqrt((y * y).sum(-1, keepdim=True) + eps)
    return y.to(x.dtype if output_dtype is None else output_dtype)


# the modules' forwards (the SwishGate subclasses inherit them)


def fused_layer_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    return layer_norm_gated(x=x, g=g, weight=self.weight, bias=self.bias, activation=self.activation, residual=residual,
                            prenorm=prenorm, residual_in_fp32=residual_in_fp32, eps=self.eps)


def fused_rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    return rms_norm_gated(x=x, g=g, weight=self.weight, bias=self.bias, activation=self.activation, residual=residual,
                          prenorm=prenorm, residual_in_fp32=residual_in_fp32, eps=self.eps)


def fused_layer_norm_gated_linear_forward(self, x, g, weight=None, bias=None, residual=None, prenorm=False,
                                          residual_in_fp32=False):
    return layer_norm_swish_gate_linear(x=x, g=g, norm_weight=self.weight, norm_bias=self.bias, linear_weight=weight,
                                        linear_bias=bias, residual=residual, prenorm=prenorm,
                                        residual_in_fp32=residual_in_fp32, eps=self.eps)


def fused_rms_norm_gated_linear_forward(self, x, g, weight=None, bias=None, residual=None, prenorm=False,
                                        residual_in_fp32=False):
    return rms_norm_swish_gate_linear(x=x, g=g, norm_weight=self.weight, norm_bias=self.bias, linear_weight=weight,
                                      linear_bias=bias, residual=residual, prenorm=prenorm,
                                      residual_in_fp32=residual_in_fp32, eps=self.eps)


_MODULE = "fla.modules.norm.fused_norm_gate"
PATCHES = {
    f"{_MODULE}:layer_norm_gated": layer_norm_gated,
    f"{_MODULE}:rms_norm_gated": rms_norm_gated,
    f"{_MODULE}:layer_norm_swish_gate_linear": layer_norm_swish_gate_linear,
    f"{_MODULE}:rms_norm_swish_gate_linear": rms_norm_swish_gate_linear,
    f"{_MODULE}:FusedLayerNormGated.forward": fused_layer_norm_gated_forward,
    f"{_MODULE}:FusedRMSNormGated.forward": fused_rms_norm_gated_forward,
    f"{_MODULE}:FusedLayerNormGatedLinear.forward": fused_layer_norm_gated_linear_forward,
    f"{_MODULE}:FusedRMSNormGatedLinear.forward": fused_rms_norm_gated_linear_forward,
    "fla.modules.norm.l2norm:l2norm": l2norm,  # l2_norm too; L2Norm.forward calls it
}
