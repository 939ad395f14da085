"""fla's kernels through the op entries, bf16 on one GPU, against the float64 references.

Inputs are drawn in float64 on the CPU from a fixed seed, rounded to the kernel's dtype, and the
reference runs in float64 on those rounded values, so the only error left is the kernel's.
The bound is 2e-2 (fla's own tests use 5e-3 to 2e-2).
"""

import pytest
import torch
import torch.nn.functional as F

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.layer_parity import GPU_HEADS  # noqa: E402
from linattn import kernels, reference, selection  # noqa: E402
from pytest_linattn import assert_parity  # noqa: E402

SEED = 2026
DTYPE = torch.bfloat16
CU_SEQLENS = [0, 1, 130, 300, 515]  # four packed sequences: length 1, a partial chunk, 170, 215
DEVICE = "cuda"

pytestmark = pytest.mark.gpus(1)

# (key heads, value heads): the GPU layer suites' replicated layer (cases.layer_parity.GPU_HEADS), whose
# kernels the layer tests then reuse (the head count is a compile-time constant in fla's kernels)
H_FULL, HV_FULL, K_DIM, V_DIM = GPU_HEADS
HEADS = [(H_FULL, HV_FULL)]

FACTS = selection.read_facts()
CAUSAL_CONV1D_BWD = FACTS.causal_conv1d_bwd_importable
GDN_BWD_REFUSED = selection.choose_gdn_route(FACTS).value == "kda"


def draw(shape, gen, kind="normal"):
    sample = torch.randn if kind == "normal" else torch.rand
    return sample(shape, generator=gen, dtype=torch.float64)


def leaves(tensors, dtypes):
    """The kernel's inputs (rounded to their dtypes, on the GPU) and the reference's (float64 of the same values)."""
    ours = [t.to(dtype).to(DEVICE).requires_grad_() for t, dtype in zip(tensors, dtypes)]
    ref = [t.detach().double().requires_grad_() for t in ours]
    return ours, ref


def grads_of(outputs, cotangents, inputs):
    loss = sum((o.double() * c.to(o.device)).sum() for o, c in zip(outputs, cotangents))
    return torch.autograd.grad(loss, inputs)


# ---- short conv ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["triton", "mix", "cuda"])
def test_short_conv_backend_matches_reference(backend):
    if backend in ("mix", "cuda") and not CAUSAL_CONV1D_BWD:
        pytest.skip(f"backend {backend} needs causal-conv1d's CUDA kernels, which do not import here")
    gen = torch.Generator().manual_seed(SEED)
    T, D, W = CU_SEQLENS[-1], 256, 4
    cu = torch.tensor(CU_SEQLENS, device=DEVICE)
    (x, weight, bias), (x64, w64, b64) = leaves(
        [draw((1, T, D), gen), draw((D, W), gen) / W, draw((D,), gen)], [DTYPE] * 3)
    y = kernels.short_conv(x, weight, cu, bias, "silu", backend=backend)
    y_ref = reference.short_conv(x64, w64, cu, b64, "silu")
    assert y.dtype == DTYPE
    dy = draw((1, T, D), gen)
    grads = grads_of([y], [dy.to(DEVICE)], [x, weight, bias])
    grads_ref = grads_of([y_ref], [dy.to(DEVICE)], [x64, w64, b64])
    assert_parity(y, y_ref, rtol=RTOL, name=f"short_conv[{backend}] y")
    for name, grad, grad_ref in zip(("dx", "dweight", "dbias"), grads, grads_ref):
        assert_parity(grad, grad_ref, rtol=RTOL, name=f"short_conv[{backend}] {name}")


# ---- KDA and gated delta rule -------------------------------------------------------------

def delta_inputs(per_channel_gate, H, HV, K=K_DIM, V=V_DIM):
    gen = torch.Generator().manual_seed(SEED + HV)
    T, N = CU_SEQLENS[-1], len(CU_SEQLENS) - 1
    gate_shape = (1, T, HV, K) if per_channel_gate else (1, T, HV)
    tensors = [
        draw((1, T, H, K), gen),                                  # q
        F.normalize(draw((1, T, H, K), gen), dim=-1),             # k
        draw((1, T, HV, V), gen),                                 # v
        F.logsigmoid(draw(gate_shape, gen, "uniform")),           # g: log decay, as fla's tests draw it
        draw((1, T, HV), gen, "uniform").sigmoid(),               # beta
        draw((N, HV, K, V), gen),                                 # initial state
    ]
    # g and the state in float32, as the layers hand them to fla
    dtypes = [DTYPE, DTYPE, DTYPE, torch.float32, DTYPE, torch.float32]
    ours, ref = leaves(tensors, dtypes)
    cotangents = [draw((1, T, HV, V), gen), draw((N, HV, K, V), gen)]
    return ours, ref, cotangents


def check_delta_rule(op, ours, ref, cotangents, backward=True, **kwargs):
    cu = torch.tensor(CU_SEQLENS, device=DEVICE)
    reference_op = reference.kda if op == "kda" else reference.gated_delta_rule
    o, s = getattr(kernels, op)(*ours[:5], initial_state=ours[5], output_final_state=True, cu_seqlens=cu, **kwargs)
    o_ref, s_ref = reference_op(*ref[:5], initial_state=ref[5], output_final_state=True, cu_seqlens=cu)
    label = f"{op}{kwargs or ''}"
    assert o.dtype == DTYPE
    assert_parity(o, o_ref, rtol=RTOL, name=f"{label} o")
    assert_parity(s, s_ref, rtol=RTOL, name=f"{label} final_state")
    if not backward:
        return
    grads = grads_of([o, s], cotangents, ours)
    grads_ref = grads_of([o_ref, s_ref], cotangents, ref)
    for name, grad, grad_ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_ref):
        assert_parity(grad, grad_ref, rtol=RTOL, name=f"{label} {name}")


@pytest.mark.parametrize("H, HV", HEADS)
def test_kda_matches_reference(H, HV):
    check_delta_rule("kda", *delta_inputs(True, H, HV))


@pytest.mark.parametrize("H, HV", HEADS)
def test_gdn_kda_route_matches_reference(H, HV):
    # the route used where fla refuses GDN's backward; correct everywhere chunk_kda runs
    check_delta_rule("gated_delta_rule", *delta_inputs(False, H, HV), route="kda")


@pytest.mark.parametrize("H, HV", HEADS)
def test_gdn_direct_route_matches_reference(H, HV):
    # where fla refuses the backward (Hopper, Triton in [3.4.0, 3.7.1), no TileLang) only the
    # forward is checked: that is what the kda route exists for
    check_delta_rule("gated_delta_rule", *delta_inputs(False, H, HV), backward=not GDN_BWD_REFUSED,
                     route="gated_delta_rule")


def test_gdn_default_route_runs_backward():
    # route=None takes selection.gdn_route(): it must never pick a route whose backward fla refuses
    check_delta_rule("gated_delta_rule", *delta_inputs(False, *HEADS[0]))
    assert selection.gdn_route() == ("kda" if GDN_BWD_REFUSED else "gated_delta_rule")


def test_gdn_direct_backward_is_refused_where_selection_says_so():
    if not GDN_BWD_REFUSED:
        pytest.skip("fla allows GDN's backward on this machine")
    ours, _, cotangents = delta_inputs(False, *HEADS[0])
    cu = torch.tensor(CU_SEQLENS, device=DEVICE)
    o, s = kernels.gated_delta_rule(*ours[:5], initial_state=ours[5], output_final_state=True, cu_seqlens=cu,
                                    route="gated_delta_rule")
    with pytest.raises(RuntimeError, match="3.7.1"):
        grads_of([o, s], cotangents, ours)


# ---- float32 linear on bf16 tensor cores ------------------------------------------------------

@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_float32_linear_bf16_split_keeps_float32_precision(x_dtype):
    # KDA's gate projections: x bf16 (f_a_proj) or float32 (f_b_proj's input), weights bf16
    gen = torch.Generator().manual_seed(SEED)
    T, IN, OUT = 2048, 256, 1024
    (x, weight), (x64, w64) = leaves([draw((1, T, IN), gen), draw((OUT, IN), gen) / IN ** 0.5], [x_dtype, DTYPE])
    y = kernels.float32_linear(x, weight, "bf16_split")
    assert y.dtype == torch.float32
    dy = draw((1, T, OUT), gen).to(DTYPE).double()  # bf16 values, as from the layer's bf16 kernel
    grads = grads_of([y], [dy.to(DEVICE)], [x, weight])
    grads_ref = grads_of([x64 @ w64.T], [dy.to(DEVICE)], [x64, w64])
    assert_parity(y, x64 @ w64.T, rtol=1e-5, name="float32_linear y")
    # dx: exact products, float32 sums; dweight: x's bf16 part, rounded to bf16 (2^-9 each)
    for name, grad, grad_ref, dtype in zip(("dx", "dweight"), grads, grads_ref, (x_dtype, DTYPE)):
        assert grad.dtype == dtype
        assert_parity(grad, grad_ref, rtol=1e-5 if dtype == torch.float32 else 2 ** -8, name=f"float32_linear {name}")


def test_float32_linear_bf16_split_adds_the_bias_before_one_rounding():
    # KDA's fused gate: f_b_proj(f_low) + dt_bias, the sum rounded to bf16 once (dt_bias cancels
    # most of the product, so rounding the product first would lose f's leading bits)
    gen = torch.Generator().manual_seed(SEED + 1)
    T, IN, OUT = 2048, 128, 1024
    x, weight, bias = draw((1, T, IN), gen), draw((OUT, IN), gen) / IN ** 0.5, draw((OUT,), gen) * 4
    (x, weight, bias), (x64, w64, b64) = leaves([x, weight, bias], [torch.float32, DTYPE, torch.float32])
    y = kernels.float32_linear(x, weight, "bf16_split", bias=bias, round_to=DTYPE)
    y_ref = x64 @ w64.T + b64
    assert y.dtype == DTYPE
    assert_parity(y, y_ref, rtol=2 ** -8, name="float32_linear+bias y")
    # one rounding of the float32 sum: the exact sum rounded to bf16, but where float32's error
    # (about 2^-16 of the product) crosses a rounding boundary; a rounded product would miss often
    same = (y == y_ref.to(DTYPE)).double().mean().item()
    assert same > 0.99, f"only {same:.4f} of the outputs are the exact sum rounded once"
    dy = draw((1, T, OUT), gen).to(DTYPE).to(DEVICE)  # the kernel's bf16 gradient, taken as it comes
    grads = grads_of([y], [dy], [x, weight, bias])
    grads_ref = grads_of([y_ref], [dy.double()], [x64, w64, b64])
    for name, grad, grad_ref, dtype in zip(("dx", "dweight", "dbias"), grads, grads_ref,
                                            (torch.float32, DTYPE, torch.float32)):
        assert grad.dtype == dtype
        assert_parity(grad, grad_ref, rtol=2 ** -8 if dtype == DTYPE else 1e-5, name=f"float32_linear+bias {name}")
