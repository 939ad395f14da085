"""linattn.emulation.delta_product: fla 0.6.0's chunk_gated_delta_product on linattn's reference.

Against linattn.reference.gated_delta_product computed directly (float64, <= 1e-12) with every
option fla's entry takes, on a packed batch with a length-1 sequence; dtypes as fla returns them;
fla's own refusals; through the fla_on_cpu switch (fla's layer reaches it); fla's layer in its
chunk mode against its fused_recurrent mode (two emulated entries, <= 1e-12); and cp_context= at
CP 2, fla's two layouts, against the single-process result (<= 1e-10).
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

from linattn import reference
from linattn.emulation import delta_product as emu
from pytest_linattn import assert_parity

F64 = torch.float64
RTOL64, RTOL_CP = 1e-12, 1e-10
H, K, V, N_STEPS = 2, 8, 6, 3
KEY = "fla.ops.gated_delta_product.chunk:chunk_gated_delta_product"


@pytest.fixture(scope="module")
def fla():
    return pytest.importorskip("fla", reason="fla not installed (pip install -e .[fla-cpu])")


def packed(seed, lengths, n=N_STEPS, gated=True, dtype=F64):
    """Fresh q, k, v, g, beta, h0, do for packed sequences; beta in (0, 2) (allow_neg_eigval's range)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    x = dict(q=rand(1, T, H, K), k=F.normalize(rand(1, T * n, H, K), dim=-1), v=rand(1, T * n, H, V),
             g=F.logsigmoid(rand(1, T, H) + 2.0) if gated else None,
             beta=2 * torch.rand(1, T * n, H, generator=gen, dtype=F64), h0=rand(len(lengths), H, K, V),
             do=rand(1, T, H, V))
    x = {name: None if t is None else t.to(dtype) for name, t in x.items()}
    return x, torch.tensor([0, *lengths]).cumsum(0)


def with_grads(op, x, index=None, **kwargs):
    """(o, final_state, {d<input>}) of op on leaves of x (tokens `index` of each token tensor, steps with them)."""
    steps = None if index is None else (index[:, None] * N_STEPS + torch.arange(N_STEPS)).flatten()
    leaves = {}
    for name in ("q", "k", "v", "g", "beta"):
        t = x[name]
        if t is not None:
            t = t if index is None else t[:, index if name in ("q", "g") else steps]
            leaves[name] = t.detach().clone().requires_grad_()
    o, S = op(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"), leaves["beta"], N_STEPS, **kwargs)
    do = x["do"] if index is None else x["do"][:, index]
    (o.double() * do).sum().backward()
    return o, S, {f"d{n}": t.grad for n, t in leaves.items()}


def test_signature_matches_fla(fla):
    from fla.ops.gated_delta_product import chunk_gated_delta_product

    describe = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert describe(emu.chunk_gated_delta_product) == describe(chunk_gated_delta_product)


@pytest.mark.parametrize("gated, options", [
    (True, dict(output_final_state=True, with_h0=True, use_qk_l2norm_in_kernel=True, scale=0.3)),
    (True, dict(cu_seqlens_cpu=True)),
    (False, dict(output_final_state=True, with_h0=True)),
], ids=["h0-final-l2norm-scale", "cu_seqlens_cpu", "ungated-h0-final"])
def test_emulated_op_matches_reference(gated, options):
    x, cu = packed(11, [1, 9, 14], gated=gated)
    options = dict(options)
    h0 = x["h0"] if options.pop("with_h0", False) else None
    if options.pop("cu_seqlens_cpu", False):
        options["cu_seqlens_cpu"] = cu.clone()
    o, S, grads = with_grads(emu.chunk_gated_delta_product, x, initial_state=h0, cu_seqlens=cu, **options)
    options.pop("cu_seqlens_cpu", None)
    l2norm = options.pop("use_qk_l2norm_in_kernel", False)
    o_ref, S_ref, grads_ref = with_grads(reference.gated_delta_product, x, initial_state=h0, cu_seqlens=cu,
                                         use_qk_l2norm=l2norm, mode="recurrent", **options)
    assert (S is None) == (S_ref is None) == ("output_final_state" not in options)
    got, want = {"o": o, **grads}, {"o": o_ref, **grads_ref}
    if S is not None:
        got["final_state"], want["final_state"] = S, S_ref
    assert_parity(got, want, rtol=RTOL64, name="chunk_gated_delta_product", cu_seqlens=cu)


def test_dtypes_are_fla_s():
    x, cu = packed(12, [5, 3], dtype=torch.bfloat16)
    o, S = emu.chunk_gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], N_STEPS,
                                         initial_state=x["h0"].float(), output_final_state=True, cu_seqlens=cu)
    assert (o.dtype, S.dtype) == (torch.bfloat16, torch.float32)
    o_ref, S_ref = reference.gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], N_STEPS,
                                                 initial_state=x["h0"].float(), output_final_state=True,
                                                 cu_seqlens=cu)
    assert_parity({"o": o, "final_state": S}, {"o": o_ref, "final_state": S_ref}, rtol=1e-2, name="bf16 in")


def _call(**change):
    x, cu = packed(13, [4, 4])
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], num_householder=N_STEPS, cu_seqlens=cu)
    args.update(change)
    return emu.chunk_gated_delta_product(**args)


class _Context:
    cu_seqlens = torch.tensor([0, 8])


@pytest.mark.parametrize("change, error, match", [
    (dict(q=torch.randn(1, 8, H, K)), AssertionError, "does not support float32"),
    (dict(num_householder=2), AssertionError, None),  # k holds 3 steps per token
    (dict(v=torch.randn(1, 24, 2 * H, V, dtype=F64)), AssertionError, None),  # fla's op takes no GVA
    (dict(g=torch.randn(1, 24, H, dtype=F64)), AssertionError, None),
    (dict(initial_state=torch.randn(3, H, K, V, dtype=F64)), ValueError, "number of initial states"),
    (dict(cp_context=_Context(), g=None, cu_seqlens=None), AssertionError, "Non-gated GDP is not supported for CP"),
    (dict(cp_context=_Context(), initial_state=torch.randn(1, H, K, V, dtype=F64)), AssertionError, "Initial state"),
    (dict(cp_context=_Context(), output_final_state=True), AssertionError, "Output final state"),
    (dict(chunk_size=64), TypeError, "chunk_size"),  # fla's entry takes no **kwargs
])
def test_fla_s_refusals_are_kept(change, error, match):
    with pytest.raises(error, match=match):
        _call(**change)


def test_switch_reaches_fla_s_layer_and_restores(fla):
    import fla.layers.gated_deltaproduct as fla_layer_module
    import fla.ops.gated_delta_product as fla_gdp

    from linattn.emulation import fla_on_cpu

    original = fla_gdp.chunk_gated_delta_product
    with fla_on_cpu():
        assert fla_gdp.chunk_gated_delta_product is fla_layer_module.chunk_gated_delta_product is emu.PATCHES[KEY]
    assert fla_gdp.chunk_gated_delta_product is fla_layer_module.chunk_gated_delta_product is original
    assert original is not emu.chunk_gated_delta_product


def test_fla_layer_chunk_mode_matches_its_fused_recurrent_mode(fla_on_cpu):
    # fla's layer trains on chunk_gated_delta_product and decodes (eval, no grad, <= 64 tokens)
    # on fused_recurrent_gated_delta_rule over the step stream: two emulated entries, one math
    from clients.delta_product import fla_delta_product_layer

    layer = fla_delta_product_layer(seed=14)
    x = torch.randn(1, 24, layer.hidden_size, generator=torch.Generator().manual_seed(15), dtype=F64)
    cu = torch.tensor([0, 1, 10, 24])
    y_chunk = layer(x, cu_seqlens=cu)[0]
    with torch.no_grad():
        y_recurrent = layer.eval()(x, cu_seqlens=cu)[0]
    assert y_chunk.requires_grad and not y_recurrent.requires_grad  # the two modes ran
    assert_parity(y_recurrent, y_chunk, rtol=RTOL64, name="fla GatedDeltaProduct fused_recurrent vs chunk",
                  cu_seqlens=cu)


# ----------------------------------------------------------------------------------------------
# context parallelism: cp_context=build_cp_context(...) under the switch, CP 2

CP_CASES = [("crossing", [1, 9, 6], "contiguous"), ("zigzag", [3, 10, 3], "zigzag")]


def _local_index(total, rank, cp_size, layout):
    """Global tokens of a rank: one interval (contiguous) or intervals r and 2cp-1-r (fla's zigzag)."""
    part = total // (2 * cp_size)
    intervals = [rank, 2 * cp_size - 1 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]
    return torch.cat([torch.arange(i * part, (i + 1) * part) for i in intervals])


def _run_cp(cases):
    """On every rank, under fla_on_cpu: fla's chunk_gated_delta_product with cp_context."""
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_product import chunk_gated_delta_product

    assert chunk_gated_delta_product is emu.PATCHES[KEY]
    results = []
    for x, cu, layout in cases:
        index = _local_index(int(cu[-1]), dist.get_rank(), dist.get_world_size(), layout)
        ctx = build_cp_context(cu, dist.group.WORLD, layout=layout)
        o, S, grads = with_grads(chunk_gated_delta_product, x, index, cp_context=ctx, use_qk_l2norm_in_kernel=True)
        assert S is None
        results.append({"o": o.detach(), **grads})
    return results


def test_cp_matches_single_process(fla_on_cpu, spawn):
    cases = [(*packed(20 + i, lengths), layout) for i, (_, lengths, layout) in enumerate(CP_CASES)]
    per_rank = spawn(_run_cp, 2, cases)
    for i, ((name, _, layout), (x, cu, _)) in enumerate(zip(CP_CASES, cases)):
        T = int(cu[-1])
        o, _, grads = with_grads(emu.chunk_gated_delta_product, x, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        expected = {"o": o.detach(), **grads}
        tokens = torch.cat([_local_index(T, r, 2, layout) for r in range(2)])
        steps = (tokens[:, None] * N_STEPS + torch.arange(N_STEPS)).flatten()
        got = {}
        for key, want in expected.items():
            got[key] = torch.empty_like(want)
            got[key][:, steps if want.shape[1] == T * N_STEPS else tokens] = torch.cat(
                [per_rank[r][i][key] for r in range(2)], dim=1)
        assert_parity(got, expected, rtol=RTOL_CP, cu_seqlens=cu, name=f"cp2/{name}/chunk_gated_delta_product")
