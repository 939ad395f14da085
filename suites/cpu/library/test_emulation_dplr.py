"""linattn.emulation.dplr and .rwkv7: fla 0.6.0's DPLR delta rule and RWKV-7 entries on linattn's
reference, and the small kernels fla's RWKV7Attention runs beside them.

Every entry against linattn.reference.dplr_delta_rule computed directly (float64, <= 1e-12) with
the options fla's entry takes, on a packed batch with a length-1 sequence; signatures and dtypes
as fla's; fla's refusals; the layer kernels against fla's own torch references; fla's layer in its
chunk mode against its fused recurrent mode; and cp_context= at CP 2, fla's two layouts, against
the single-process result (<= 1e-10).
"""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn import reference
from linattn.emulation import dplr as emu
from linattn.emulation import rwkv7 as emu_layer
from pytest_linattn import assert_parity

F64 = torch.float64
RTOL64, RTOL_CP = 1e-12, 1e-10
H, K, V = 2, 8, 6


@pytest.fixture(scope="module")
def fla():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("fla", reason="fla not installed (pip install -e .[fla-cpu])")


def packed(seed, lengths, dtype=F64):
    """Fresh RWKV-7-like q, k, v, a = -kk, b = kk·iclr, gk in (-0.61, 0), h0, do for packed sequences."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    kk = F.normalize(rand(1, T, H, K), dim=-1)
    x = dict(q=rand(1, T, H, K), k=rand(1, T, H, K) / K ** 0.5, v=rand(1, T, H, V), a=-kk,
             b=kk * torch.rand(1, T, H, K, generator=gen, dtype=F64),
             gk=-0.6065306597126334 * torch.rand(1, T, H, K, generator=gen, dtype=F64),
             h0=rand(len(lengths), H, K, V), do=rand(1, T, H, V))
    return {n: t.to(dtype) for n, t in x.items()}, torch.tensor([0, *lengths]).cumsum(0)


NAMES = ("q", "k", "v", "a", "b", "gk")


def with_grads(op, x, index=None, **kwargs):
    """(o, final_state, {d<input>}) of op(q, k, v, a, b, gk, **kwargs) on leaves of x (tokens `index`)."""
    leaves = {n: (x[n] if index is None else x[n][:, index]).detach().clone().requires_grad_() for n in NAMES}
    o, S = op(*leaves.values(), **kwargs)
    (o.double() * (x["do"] if index is None else x["do"][:, index])).sum().backward()
    return o, S, {f"d{n}": t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("module, entry, ours", [
    ("fla.ops.generalized_delta_rule", "chunk_dplr_delta_rule", emu.chunk_dplr_delta_rule),
    ("fla.ops.generalized_delta_rule", "fused_recurrent_dplr_delta_rule", emu.fused_recurrent_dplr_delta_rule),
    ("fla.ops.rwkv7", "chunk_rwkv7", emu.chunk_rwkv7),
    ("fla.ops.rwkv7", "fused_recurrent_rwkv7", emu.fused_recurrent_rwkv7),
    ("fla.ops.rwkv7", "fused_mul_recurrent_rwkv7", emu.fused_mul_recurrent_rwkv7),
    ("fla.modules.token_shift", "token_shift", emu_layer.token_shift),
    ("fla.ops.rwkv7.fused_addcmul", "fused_addcmul_rwkv7", emu_layer.fused_addcmul_rwkv7),
    ("fla.ops.rwkv7.fused_k_update", "fused_k_rwkv7", emu_layer.fused_k_rwkv7),
    ("fla.ops.rwkv7.gate_output_correction", "gate_output_correction", emu_layer.gate_output_correction),
])
def test_signature_matches_fla(fla, module, entry, ours):
    import importlib

    theirs = getattr(importlib.import_module(module), entry)
    describe = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert describe(ours) == describe(theirs)


@pytest.mark.parametrize("entry, options, reverse", [
    ("chunk_dplr_delta_rule", dict(scale=0.3, output_final_state=True, with_h0=True, safe_gate=True,
                                   lower_bound=-0.61, chunk_size=64, cu_seqlens_cpu=True), False),
    ("fused_recurrent_dplr_delta_rule", dict(output_final_state=True, with_h0=True, reverse=True), True),
    ("chunk_rwkv7", dict(output_final_state=True, with_h0=True), False),
    ("fused_recurrent_rwkv7", dict(scale=0.7, with_h0=True), False),
], ids=["chunk-all-options", "fused-recurrent-reverse", "chunk_rwkv7", "fused_recurrent_rwkv7"])
def test_emulated_op_matches_reference(entry, options, reverse):
    x, cu = packed(11, [1, 9, 14])
    options = dict(options)
    if options.pop("with_h0", False):
        options["initial_state"] = x["h0"]
    if options.pop("cu_seqlens_cpu", False):
        options["cu_seqlens_cpu"] = cu.clone()
    fn = getattr(emu, entry)
    if "rwkv7" in entry:  # fla's argument order: r, w, k, v, a, b
        op = lambda q, k, v, a, b, gk, **kw: fn(q, gk, k, v, a, b, **kw)  # noqa: E731
    else:
        op = fn
    o, S, grads = with_grads(op, x, cu_seqlens=cu, **options)
    default_scale = 1.0 if entry == "chunk_rwkv7" else K ** -0.5
    want_final = options.get("output_final_state", entry == "fused_recurrent_rwkv7")
    o_ref, S_ref, grads_ref = with_grads(reference.dplr_delta_rule, x, cu_seqlens=cu, reverse=reverse,
                                         scale=options.get("scale", default_scale),
                                         initial_state=options.get("initial_state"), output_final_state=want_final)
    assert (S is None) == (S_ref is None) == (not want_final)
    got, want = {"o": o, **grads}, {"o": o_ref, **grads_ref}
    if S is not None:
        got["final_state"], want["final_state"] = S, S_ref
    assert_parity(got, want, rtol=RTOL64, name=entry, cu_seqlens=cu)


def test_fused_mul_recurrent_rwkv7_is_the_rule_with_kk_and_iclr():
    x, cu = packed(12, [3, 1, 8])
    gen = torch.Generator().manual_seed(13)
    kk, iclr = F.normalize(torch.randn(1, 12, H, K, generator=gen, dtype=F64), dim=-1), x["b"].abs()
    o, S = emu.fused_mul_recurrent_rwkv7(x["q"], x["gk"], x["k"], x["v"], kk, iclr, initial_state=x["h0"],
                                         output_final_state=True, reverse=True, cu_seqlens=cu)
    o_ref, S_ref = reference.rwkv7_kk_a(x["q"], x["gk"], x["k"], x["v"], kk, iclr, initial_state=x["h0"],
                                        output_final_state=True, reverse=True, cu_seqlens=cu)
    assert_parity({"o": o, "final_state": S}, {"o": o_ref, "final_state": S_ref}, rtol=RTOL64,
                  name="fused_mul_recurrent_rwkv7", cu_seqlens=cu)


def test_dtypes_are_fla_s():
    x, cu = packed(14, [5, 3], dtype=torch.bfloat16)
    o, S = emu.chunk_dplr_delta_rule(*(x[n] for n in NAMES), initial_state=x["h0"].float(), output_final_state=True,
                                     cu_seqlens=cu)
    assert (o.dtype, S.dtype) == (torch.bfloat16, torch.float32)
    o_ref, S_ref = reference.dplr_delta_rule(*(x[n] for n in NAMES), initial_state=x["h0"].float(),
                                             output_final_state=True, cu_seqlens=cu)
    assert_parity({"o": o, "final_state": S}, {"o": o_ref, "final_state": S_ref}, rtol=1e-2, name="bf16 in")


class _Context:
    cu_seqlens = torch.tensor([0, 8])
    cu_seqlens_cpu = None


@pytest.mark.parametrize("change, error, match", [
    (dict(head_first=True), DeprecationWarning, "head_first has been removed"),
    (dict(use_qk_l2norm_in_kernel=True), NotImplementedError, r"chunk_dplr_delta_rule\(use_qk_l2norm_in_kernel"),
    (dict(lower_bound=0.0), ValueError, "lower_bound` must be negative"),
    (dict(initial_state=torch.randn(3, H, K, V, dtype=F64)), ValueError, "number of initial states"),
    (dict(cp_context=_Context(), initial_state=torch.randn(1, H, K, V, dtype=F64)), AssertionError, "Initial state"),
    (dict(cp_context=_Context(), output_final_state=True), AssertionError, "Output final state"),
])
def test_fla_s_refusals_are_kept(change, error, match):
    x, cu = packed(15, [4, 4])
    with pytest.raises(error, match=match):
        emu.chunk_dplr_delta_rule(*(x[n] for n in NAMES), cu_seqlens=cu, **change)


def test_layer_kernels_match_fla_s_torch_references(fla):
    from fla.modules.token_shift import token_shift_ref
    from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
    from fla.ops.rwkv7.fused_k_update import k_update_ref
    from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref

    gen = torch.Generator().manual_seed(16)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    cu, D = torch.tensor([0, 1, 6, 11]), H * K
    x, mixes, cache = rand(1, 11, D), [rand(1, 1, D) for _ in range(6)], rand(3, D)
    got = {"delta": emu_layer.token_shift(x, cu), "delta batched": emu_layer.token_shift(x.view(1, 11, D))}
    want = {"delta": token_shift_ref(x, cu), "delta batched": token_shift_ref(x)}
    delta_cached, cache_out = emu_layer.token_shift(x, cu, cache=cache, output_cache=True)
    firsts, lasts = cu[:-1], cu[1:] - 1
    got["delta cached"], want["delta cached"] = delta_cached, want["delta"].index_put(
        (torch.tensor(0), firsts), cache - x[0, firsts])
    got["cache out"], want["cache out"] = cache_out, x[0, lasts]
    for i, (m, w) in enumerate(zip(emu_layer.fused_addcmul_rwkv7(x, got["delta"], *mixes),
                                   torch_addcmul_rwkv7(x, want["delta"], *mixes))):
        got[f"mix {i}"], want[f"mix {i}"] = m, w
    k, a, ka = rand(1, 11, D), torch.rand(1, 11, D, generator=gen, dtype=F64), rand(D)
    got["k"], want["k"] = emu_layer.fused_k_rwkv7(k, a, ka), k_update_ref(k, a, ka)
    o, r, kh, v, g, r_k = rand(1, 11, D), rand(1, 11, H, K), rand(1, 11, H, K), rand(1, 11, H, K), rand(1, 11, D), rand(H, K)
    got["o"] = emu_layer.gate_output_correction(o, r, kh, r_k, v, g)
    want["o"] = gate_output_correction_ref(o, r, kh, r_k, v, g)
    assert len(got) == len(want) == 12
    assert_parity(got, want, rtol=1e-15, name="RWKV7Attention's kernels")


def test_fla_layer_chunk_mode_matches_its_fused_recurrent_mode(fla_on_cpu):
    # fla's layer trains on chunk_rwkv7 and decodes (eval, no grad, < 64 tokens) on
    # fused_mul_recurrent_rwkv7: two emulated entries, one math
    from clients.rwkv7 import fla_rwkv7_layer

    layer = fla_rwkv7_layer(seed=17)
    x = torch.randn(1, 24, layer.hidden_size, generator=torch.Generator().manual_seed(18), dtype=F64)
    cu = torch.tensor([0, 1, 10, 24])
    y_chunk = layer(x, v_first=x, cu_seqlens=cu)[0]
    with torch.no_grad():
        y_recurrent = layer.eval()(x, v_first=x, cu_seqlens=cu)[0]
    assert y_chunk.requires_grad and not y_recurrent.requires_grad  # the two modes ran
    assert_parity(y_recurrent, y_chunk, rtol=RTOL64, name="fla RWKV7Attention fused_recurrent vs chunk", cu_seqlens=cu)


# ----------------------------------------------------------------------------------------------
# context parallelism: cp_context=build_cp_context(...) under the switch, CP 2

CP_CASES = [("crossing", [1, 9, 6], "contiguous"), ("zigzag", [3, 10, 3], "zigzag")]


def _local_index(total, rank, cp_size, layout):
    """Global tokens of a rank: one interval (contiguous) or intervals r and 2cp-1-r (fla's zigzag)."""
    part = total // (2 * cp_size)
    intervals = [rank, 2 * cp_size - 1 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]
    return torch.cat([torch.arange(i * part, (i + 1) * part) for i in intervals])


def _run_cp(cases):
    """On every rank, under fla_on_cpu: fla's chunk_rwkv7 with cp_context."""
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context
    from fla.ops.rwkv7 import chunk_rwkv7

    assert chunk_rwkv7 is emu.chunk_rwkv7
    results = []
    for x, cu, layout in cases:
        index = _local_index(int(cu[-1]), dist.get_rank(), dist.get_world_size(), layout)
        ctx = build_cp_context(cu, dist.group.WORLD, layout=layout)
        o, S, grads = with_grads(lambda q, k, v, a, b, gk, **kw: chunk_rwkv7(q, gk, k, v, a, b, **kw), x, index,
                                 cp_context=ctx)
        assert S is None
        results.append({"o": o.detach(), **grads})
    return results


def test_cp_matches_single_process(fla_on_cpu, spawn):
    cases = [(*packed(20 + i, lengths), layout) for i, (_, lengths, layout) in enumerate(CP_CASES)]
    per_rank = spawn(_run_cp, 2, cases)
    for i, ((name, _, layout), (x, cu, _)) in enumerate(zip(CP_CASES, cases)):
        o, _, grads = with_grads(emu.chunk_dplr_delta_rule, x, cu_seqlens=cu, scale=1.0)
        expected = {"o": o.detach(), **grads}
        tokens = torch.cat([_local_index(int(cu[-1]), r, 2, layout) for r in range(2)])
        got = {}
        for key, want in expected.items():
            got[key] = torch.empty_like(want)
            got[key][:, tokens] = torch.cat([per_rank[r][i][key] for r in range(2)], dim=1)
        assert_parity(got, expected, rtol=RTOL_CP, cu_seqlens=cu, name=f"cp2/{name}/chunk_rwkv7")
