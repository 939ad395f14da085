"""Each family's layer in bf16 on the CPU against the float64 replicated layer: output, dx and every
parameter gradient (the gate's A_log, dt_bias and projections included) <= 2e-2 relative.

The CPU proxy of suites/gpu-1/test_layers_bf16_gpu1.py (the same cases, seeds, sizes and packing:
cases.layer_parity.BF16_CASES): the torch kernels compute bf16 inputs in float32, so what is left is the
bf16 rounding of the layer's own math, the part the GPU run shares with this one.

The 2e-2 bound sits above a gate or beta computed in bf16 (GDN's dt_bias gradient goes from
1.05e-2 to 1.89e-2 that way), so the precision rule is also checked directly: what the bf16 layer
hands the kernel (g, beta) and the gated RMSNorm's statistics are float32 and agree with the same
math in float64 on the same bf16 weights, input and projections to 1e-5 (float32 math: <= 7e-7;
bf16: >= 1.6e-3).
"""


import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import linattn.kernels
from cases.layer_parity import BF16_CASES, bf16_case, check_bf16_layer
from linattn.layers import build_layer, gated_rms_norm
from pytest_linattn.parity import assert_parity

# float32 math: <= 7e-7 (KDA's bounded gate, lower_bound * sigmoid(exp(A_log) * f), scales the
# rounding of f by up to exp(A_log) = 16; the rest ~5e-8); any of them in bf16: >= 1.6e-3
PRECISION_RTOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """Ops this small run faster on one thread (5x on a busy 2-core CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_cpu_layer_matches_float64(case):
    check_bf16_layer(case, "cpu")


class _RecordRsqrt(TorchFunctionMode):
    """Records every torch.rsqrt result computed while active (the norm's 1 / rms)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.rsqrt:
            self.outputs.append(out)
        return out


def _float64_gate_and_beta(layer, x, projections):
    """g and beta in float64 from the bf16 layer's own weights, input x and, for GDN, its a / b
    projections (the policy: bf16 projections, everything after them in at least float32; KDA's
    gate projections too)."""
    c, p = layer.config, {n: t.double() for n, t in layer.named_parameters()}
    if c.op != "kda":
        a, b = (projections[n].double() for n in ("a", "b"))
        return -p["A_log"].exp() * F.softplus(a + p["dt_bias"]), torch.sigmoid(b)
    T, HV, dk = x.shape[1], c.num_v_heads, c.head_k_dim
    f = (x.double() @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T).view(1, T, HV, dk) + p["dt_bias"].view(HV, dk)
    rate = p["A_log"].exp().view(HV, 1)
    g = -rate * F.softplus(f) if c.gate_lower_bound is None else c.gate_lower_bound * torch.sigmoid(rate * f)
    return g, torch.sigmoid(F.linear(x, layer.b_proj.weight).double())  # the layer's bf16 projection


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_layer_computes_gate_beta_and_norm_in_float32(case, monkeypatch):
    config, sd, cu, x, _ = bf16_case(case)
    layer = build_layer(config, dtype=torch.bfloat16)
    layer.load_state_dict({n: t.to(torch.bfloat16) for n, t in sd.items()})
    x = x.to(torch.bfloat16)
    seen, projections = {}, {}

    def recording(op):
        def kernel(q, k, v, g, beta, *args, **kwargs):
            seen.update(g=g, beta=beta)
            return op(q, k, v, g, beta, *args, **kwargs)
        return kernel

    for name in ("gated_delta_rule", "kda"):
        monkeypatch.setattr(linattn.kernels, name, recording(getattr(linattn.kernels, name)))

    def recording_norm(o, gate, weight, eps, activation):
        with _RecordRsqrt() as rsqrt:
            y = gated_rms_norm(o, gate, weight, eps, activation)
        assert len(rsqrt.outputs) == 1, "gated_rms_norm no longer computes one torch.rsqrt: update this test"
        seen["1/rms"] = rsqrt.outputs[0]
        seen["1/rms float64"] = torch.rsqrt(o.double().pow(2).mean(-1, keepdim=True) + eps)
        return y

    monkeypatch.setattr(linattn.kernels, "gated_rms_norm", recording_norm)
    if config.op != "kda":
        project = layer._project_inputs

        def recording_projections(h):
            out = project(h)
            projections.update(b=out[1], a=out[2])
            return out

        layer._project_inputs = recording_projections

    with torch.no_grad():
        layer(x, cu)
    g, beta = _float64_gate_and_beta(layer, x, projections)
    got = {"g": seen["g"], "beta": seen["beta"], "1/rms": seen["1/rms"]}
    wrong = {name: str(t.dtype) for name, t in got.items() if t.dtype != torch.float32}
    assert not wrong, f"{case}: computed below float32: {wrong}"
    assert_parity(got, {"g": g, "beta": beta, "1/rms": seen["1/rms float64"]}, rtol=PRECISION_RTOL,
                  name=f"{case} precision", cu_seqlens=cu)
