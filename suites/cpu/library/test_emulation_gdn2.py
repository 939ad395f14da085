"""linattn.emulation.gdn2: fla 0.6.0's chunk_gdn2 and fused_recurrent_gdn2 on linattn's reference.

Against linattn.reference.gdn2 computed directly (float64, <= 1e-12) with every option fla's
entries take (the in-kernel gate written out here), on a packed batch with a length-1 sequence;
dtypes as fla returns them; fla's own checks and the emulation's refusals; through the fla_on_cpu
switch (fla's layer reaches it); fla's GatedDeltaNet2 in its chunk mode against its fused_recurrent
mode (<= 1e-12); and chunk_gdn2's cp_context= at CP 2, fla's two layouts, against the
single-process result (<= 1e-10).
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

from linattn import reference
from linattn.emulation import gdn2 as emu
from pytest_linattn import assert_parity

F64 = torch.float64
RTOL64, RTOL_CP = 1e-12, 1e-10
K, V = 8, 6
KEYS = {"chunk": "fla.ops.gdn2.chunk:chunk_gdn2", "fused_recurrent": "fla.ops.gdn2.fused_recurrent:fused_recurrent_gdn2"}


@pytest.fixture(scope="module")
def fla():
    return pytest.importorskip("fla", reason="fla not installed (pip install -e .[fla-cpu])")


def packed(seed, lengths, H=2, HV=2, dtype=F64, raw_gate=False):
    """Fresh q, k, v, g (log decay, or a raw gate near -4.5), b in (0, 2), w in (0, 1), h0, do, A_log, dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    unit = lambda *shape: torch.rand(*shape, generator=gen, dtype=F64)  # noqa: E731
    g = rand(1, T, HV, K) - 4.5 if raw_gate else F.logsigmoid(rand(1, T, HV, K) + 2.0)
    x = dict(q=rand(1, T, H, K), k=F.normalize(rand(1, T, H, K), dim=-1), v=rand(1, T, HV, V), g=g,
             b=2 * unit(1, T, HV, K), w=unit(1, T, HV, V), h0=rand(len(lengths), HV, K, V), do=rand(1, T, HV, V),
             A_log=unit(HV).mul(1.5).add(0.5).log(), dt_bias=rand(HV * K) - 1.0)
    x = {name: t.to(dtype) for name, t in x.items()}
    return x, torch.tensor([0, *lengths]).cumsum(0)


def with_grads(op, x, index=None, names=("q", "k", "v", "g", "b", "w"), **kwargs):
    """(o, final_state, {d<input>}) of op on leaves of x (tokens `index` of each token tensor)."""
    leaves = {n: (x[n] if index is None or x[n].dim() < 4 else x[n][:, index]).detach().clone().requires_grad_()
              for n in names}
    args = [leaves.pop(n) for n in ("q", "k", "v", "g", "b", "w")]
    o, S = op(*args, **leaves, **kwargs)
    do = x["do"] if index is None else x["do"][:, index]
    (o.double() * do).sum().backward()
    return o, S, {f"d{n}": t.grad for n, t in zip(names, args + list(leaves.values()))}


def gate(g, A_log, dt_bias, lower_bound=None):
    """fla's in-kernel gate per key channel, written out: -exp(A) softplus(g + bias) or lower_bound sigmoid(...)."""
    g = g + dt_bias.view(g.shape[-2:])
    if lower_bound is None:
        return -A_log.exp()[:, None] * F.softplus(g)
    return lower_bound * torch.sigmoid(g if A_log is None else A_log.exp()[:, None] * g)


def test_signatures_match_fla(fla):
    from fla.ops.gdn2 import chunk_gdn2, fused_recurrent_gdn2

    describe = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert describe(emu.chunk_gdn2) == describe(chunk_gdn2)
    assert describe(emu.fused_recurrent_gdn2) == describe(fused_recurrent_gdn2)


@pytest.mark.parametrize("entry, options", [
    ("chunk", dict(output_final_state=True, with_h0=True, use_qk_l2norm_in_kernel=True, scale=0.3)),
    ("chunk", dict(output_final_state=True, with_h0=True, state_v_first=True, cu_seqlens_cpu=True)),
    ("chunk", dict(use_gate_in_kernel=True, gate_args=("A_log", "dt_bias"))),
    ("chunk", dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-4.0, gate_args=("A_log", "dt_bias"))),
    ("chunk", dict(use_gate_in_kernel=True, lower_bound=-3.0, gate_args=("dt_bias",))),
    ("fused_recurrent", dict(output_final_state=True, with_h0=True, use_qk_l2norm_in_kernel=True, gva=True)),
    ("fused_recurrent", dict(output_final_state=True, with_h0=True, state_v_first=True, use_gate_in_kernel=True,
                             lower_bound=-2.0, gate_args=("A_log", "dt_bias"), gva=True)),
], ids=["chunk-h0-final-l2norm-scale", "chunk-v-first-cpu-cu", "chunk-gate", "chunk-safe-bounded-gate",
        "chunk-bounded-gate-no-A", "recurrent-gva-h0-l2norm", "recurrent-gva-v-first-bounded-gate"])
def test_emulated_op_matches_reference(entry, options):
    options = dict(options)
    gate_args = options.pop("gate_args", ())
    x, cu = packed(11, [1, 9, 70], H=1 if options.pop("gva", False) else 2, raw_gate=bool(gate_args))
    h0 = x["h0"] if options.pop("with_h0", False) else None
    v_first = options.get("state_v_first", False)
    if options.pop("cu_seqlens_cpu", False):
        options["cu_seqlens_cpu"] = cu.clone()
    op = emu.chunk_gdn2 if entry == "chunk" else emu.fused_recurrent_gdn2
    names = ("q", "k", "v", "g", "b", "w") + gate_args
    o, S, grads = with_grads(op, x, names=names, cu_seqlens=cu,
                             initial_state=None if h0 is None else (h0.transpose(-1, -2) if v_first else h0), **options)
    lower_bound = options.get("lower_bound")

    def ref(q, k, v, g, b, w, A_log=None, dt_bias=None):
        if gate_args:
            g = gate(g, A_log, dt_bias, lower_bound)
        return reference.gdn2(q, k, v, g, b, w, scale=options.get("scale"), initial_state=h0,
                              output_final_state=options.get("output_final_state", False), cu_seqlens=cu,
                              use_qk_l2norm=options.get("use_qk_l2norm_in_kernel", False),
                              mode="chunk" if entry == "chunk" else "recurrent")

    o_ref, S_ref, grads_ref = with_grads(lambda *a, **kw: ref(*a, **kw), x, names=names)
    assert (S is None) == (S_ref is None) == ("output_final_state" not in options)
    got, want = {"o": o, **grads}, {"o": o_ref, **grads_ref}
    if S is not None:
        got["final_state"], want["final_state"] = (S.transpose(-1, -2) if v_first else S), S_ref
    assert len(got) == len(names) + 1 + (S is not None)
    assert_parity(got, want, rtol=RTOL64, name=f"{entry}_gdn2", cu_seqlens=cu)


def test_dtypes_are_fla_s():
    x, cu = packed(12, [5, 3], dtype=torch.bfloat16)
    args = [x[n] for n in ("q", "k", "v", "g", "b", "w")]
    o, S = emu.chunk_gdn2(*args, initial_state=x["h0"].float(), output_final_state=True, cu_seqlens=cu)
    assert (o.dtype, S.dtype) == (torch.bfloat16, torch.float32)
    o_ref, S_ref = reference.gdn2(*args, initial_state=x["h0"].float(), output_final_state=True, cu_seqlens=cu)
    assert_parity({"o": o, "final_state": S}, {"o": o_ref, "final_state": S_ref}, rtol=1e-2, name="bf16 in")
    # fused_recurrent allocates o like v
    o, S = emu.fused_recurrent_gdn2(*args[:2], args[2].float(), *args[3:5], args[5].float(), output_final_state=True)
    assert (o.dtype, S.dtype) == (torch.float32, torch.float32)


class _Context:
    cu_seqlens = torch.tensor([0, 8])


def _call(entry, **change):
    x, cu = packed(13, [4, 4])
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], b=x["b"], w=x["w"], cu_seqlens=cu)
    args.update(change)
    return (emu.chunk_gdn2 if entry == "chunk" else emu.fused_recurrent_gdn2)(**args)


@pytest.mark.parametrize("entry, change, error, match", [
    ("chunk", dict(return_intermediate_states=True), NotImplementedError, "chunk_gdn2\\(return_intermediate_states"),
    ("chunk", dict(chunk_size=32), ValueError, "`chunk_size` must be 64 for GDN-2"),
    ("chunk", dict(use_gate_in_kernel=True), ValueError, "`A_log` must be provided"),
    ("chunk", dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(2, dtype=F64)), ValueError,
     "`lower_bound` must be specified"),
    ("chunk", dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0, A_log=torch.zeros(2, dtype=F64)),
     ValueError, "safe range"),
    ("chunk", dict(safe_gate=True, g=torch.full((1, 8, 2, K), -6.0, dtype=F64)), ValueError, "safe_gate=True"),
    ("chunk", dict(v=torch.randn(1, 8, 4, V, dtype=F64), w=torch.rand(1, 8, 4, V, dtype=F64)), AssertionError,
     "v must have shape"),  # chunk_gdn2 takes no GVA
    ("chunk", dict(b=torch.rand(1, 8, 2, V, dtype=F64)), AssertionError, "erase gate"),
    ("chunk", dict(initial_state=torch.randn(3, 2, K, V, dtype=F64)), ValueError, "number of initial states"),
    ("chunk", dict(initial_state=torch.randn(2, 2, K, V, dtype=torch.bfloat16)), AssertionError, "float32"),
    ("chunk", dict(cp_context=_Context(), initial_state=torch.randn(1, 2, K, V, dtype=F64)), AssertionError,
     "Initial state"),
    ("chunk", dict(cp_context=_Context(), output_final_state=True), AssertionError, "Output final state"),
    ("fused_recurrent", dict(ssm_state_indices=torch.arange(2)), NotImplementedError,
     "fused_recurrent_gdn2\\(ssm_state_indices"),
    ("fused_recurrent", dict(use_gate_in_kernel=True), NotImplementedError, "fused_recurrent_gdn2\\(A_log=None\\)"),
    ("fused_recurrent", dict(w=torch.rand(1, 8, 2, K, dtype=F64)), AssertionError, "w must have shape"),
    ("fused_recurrent", dict(q=torch.randn(2, 4, 2, K, dtype=F64)), ValueError, "batch size is expected to be 1"),
])
def test_refusals(entry, change, error, match):
    with pytest.raises(error, match=match):
        _call(entry, **change)


def test_switch_reaches_fla_s_layer_and_restores(fla):
    import fla.layers.gdn2 as fla_layer_module
    import fla.ops.gdn2 as fla_gdn2

    from linattn.emulation import fla_on_cpu

    originals = fla_gdn2.chunk_gdn2, fla_gdn2.fused_recurrent_gdn2
    with fla_on_cpu():
        assert fla_gdn2.chunk_gdn2 is fla_layer_module.chunk_gdn2 is emu.PATCHES[KEYS["chunk"]]
        assert fla_gdn2.fused_recurrent_gdn2 is fla_layer_module.fused_recurrent_gdn2 is emu.fused_recurrent_gdn2
    assert (fla_gdn2.chunk_gdn2, fla_gdn2.fused_recurrent_gdn2) == originals
    assert fla_layer_module.chunk_gdn2 is originals[0] and originals[0] is not emu.chunk_gdn2


def test_fla_layer_chunk_mode_matches_its_fused_recurrent_mode(fla_on_cpu):
    # fla's layer trains on chunk_gdn2 and decodes (eval, no grad, <= 64 tokens) on fused_recurrent_gdn2
    from clients.gdn2 import fla_gdn2_layer

    layer = fla_gdn2_layer(seed=14)
    x = torch.randn(1, 24, layer.hidden_size, generator=torch.Generator().manual_seed(15), dtype=F64)
    cu = torch.tensor([0, 1, 10, 24])
    y_chunk = layer(x, cu_seqlens=cu)[0]
    with torch.no_grad():
        y_recurrent = layer.eval()(x, cu_seqlens=cu)[0]
    assert y_chunk.requires_grad and not y_recurrent.requires_grad  # the two modes ran
    assert_parity(y_recurrent, y_chunk, rtol=RTOL64, name="fla GatedDeltaNet2 fused_recurrent vs chunk", cu_seqlens=cu)


# ----------------------------------------------------------------------------------------------
# context parallelism: cp_context=build_cp_context(...) under the switch, CP 2

CP_CASES = [("crossing", [1, 9, 6], "contiguous"), ("zigzag", [3, 10, 3], "zigzag")]


def _local_index(total, rank, cp_size, layout):
    """Global tokens of a rank: one interval (contiguous) or intervals r and 2cp-1-r (fla's zigzag)."""
    part = total // (2 * cp_size)
    intervals = [rank, 2 * cp_size - 1 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]
    return torch.cat([torch.arange(i * part, (i + 1) * part) for i in intervals])


def _run_cp(cases):
    """On every rank, under fla_on_cpu: fla's chunk_gdn2 with cp_context."""
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context
    from fla.ops.gdn2 import chunk_gdn2

    assert chunk_gdn2 is emu.PATCHES[KEYS["chunk"]]
    results = []
    for x, cu, layout in cases:
        index = _local_index(int(cu[-1]), dist.get_rank(), dist.get_world_size(), layout)
        ctx = build_cp_context(cu, dist.group.WORLD, layout=layout)
        o, S, grads = with_grads(chunk_gdn2, x, index, cp_context=ctx, use_qk_l2norm_in_kernel=True)
        assert S is None
        results.append({"o": o.detach(), **grads})
    return results


def test_cp_matches_single_process(fla_on_cpu, spawn):
    cases = [(*packed(20 + i, lengths), layout) for i, (_, lengths, layout) in enumerate(CP_CASES)]
    per_rank = spawn(_run_cp, 2, cases)
    for i, ((name, _, layout), (x, cu, _)) in enumerate(zip(CP_CASES, cases)):
        T = int(cu[-1])
        o, _, grads = with_grads(emu.chunk_gdn2, x, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        expected = {"o": o.detach(), **grads}
        tokens = torch.cat([_local_index(T, r, 2, layout) for r in range(2)])
        got = {}
        for key, want in expected.items():
            got[key] = torch.empty_like(want)
            got[key][:, tokens] = torch.cat([per_rank[r][i][key] for r in range(2)], dim=1)
        assert len(got) == 7
        assert_parity(got, expected, rtol=RTOL_CP, cu_seqlens=cu, name=f"cp2/{name}/chunk_gdn2")
