"""bench_suite's op rows: each emulated fla op (linattn.emulation) against the linattn.reference op
it wraps, fwd+bwd in float64 on the same inputs, CPU time.

Where fla computes something in the kernel (the gate, the beta sigmoid), the reference side
computes it too, with linattn's own functions, so both rows do the same work. fla's gated norm
has no linattn.reference op: its row compares with linattn.kernels.gated_rms_norm (torch).
The CP rows (2 ranks) compare the emulated op with fla's cp_context against linattn.parallel.cp's
exchange around the reference piece op, on the contiguous piece; under fla's whole-batch zigzag
the delta rules add the relayout to it (one all-to-all each way), the conv exchanges only its
halos. build_cp_context's row (fla's metadata and linattn's context against linattn's context
alone) is shown, not judged.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

F64 = torch.float64
W = 4  # conv width
# (tokens, sequences, key heads, value heads, head dim): the emulation tests' sizes; a longer packing
SHAPES = {"test": (32, 4, 2, 4, 16), "layer": (1024, 4, 4, 4, 32)}


def _inputs(shape: str, seed: int = 0) -> dict:
    T, N, H, HV, K = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=gen, dtype=F64)

    D = HV * K
    cu = torch.tensor([0, 1] + [1 + (T - 1) * (i + 1) // (N - 1) for i in range(N - 1)])  # a length-1 sequence first
    return dict(cu=cu, q=rand(1, T, H, K), k=F.normalize(rand(1, T, H, K), dim=-1), v=rand(1, T, HV, K),
                g=F.logsigmoid(rand(1, T, HV)), gk=F.logsigmoid(rand(1, T, HV, K)), raw=rand(1, T, HV),
                rawk=rand(1, T, HV, K), beta=torch.rand(1, T, HV, generator=gen, dtype=F64), x=rand(1, T, D),
                res=rand(1, T, D), w=rand(D, W), b=rand(D), A_log=rand(HV) * 0.1, dt=rand(HV), dtk=rand(HV * K),
                h0=rand(N, HV, K, K), cache=rand(N, D, W), xn=rand(1, T, HV, K), nw=rand(K))


def _total(out) -> torch.Tensor:
    """One scalar from every tensor output (fla's ops return tuples with None)."""
    if isinstance(out, torch.Tensor):
        return out.sum()
    return sum(t.sum() for t in out if isinstance(t, torch.Tensor))


def _pairs(d: dict):
    """(op label, emulated call, reference call, the inputs that take gradients)."""
    from linattn import kernels, reference
    from linattn.emulation import conv, delta_rules as emu, norm
    from linattn.reference.delta_rule import l2norm

    cu, ld = d["cu"], kernels.log_decay
    gdn, kda = reference.gated_delta_rule, reference.kda
    yield ("chunk_gated_delta_rule", lambda q, k, v, g, b: emu.chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=cu),
           lambda q, k, v, g, b: gdn(q, k, v, g, b, cu_seqlens=cu), "q k v g beta")
    yield ("chunk_gated_delta_rule in-kernel+state",
           lambda q, k, v, g, b: emu.chunk_gated_delta_rule(
               q, k, v, g, b, initial_state=d["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
               use_gate_in_kernel=True, A_log=d["A_log"], dt_bias=d["dt"], use_beta_sigmoid_in_kernel=True,
               cu_seqlens=cu),
           lambda q, k, v, g, b: gdn(q, k, v, ld(g, d["A_log"], d["dt"], per_channel=False), b.sigmoid(),
                                     initial_state=d["h0"], output_final_state=True, use_qk_l2norm=True,
                                     cu_seqlens=cu), "q k v raw beta")
    yield ("fused_recurrent_gated_delta_rule",
           lambda q, k, v, g, b: emu.fused_recurrent_gated_delta_rule(q, k, v, g, beta=b, cu_seqlens=cu),
           lambda q, k, v, g, b: gdn(q, k, v, g, b, cu_seqlens=cu, mode="recurrent"), "q k v g beta")
    yield ("chunk_kda", lambda q, k, v, g, b: emu.chunk_kda(q, k, v, g, b, cu_seqlens=cu),
           lambda q, k, v, g, b: kda(q, k, v, g, b, cu_seqlens=cu), "q k v gk beta")
    yield ("chunk_kda in-kernel+state",
           lambda q, k, v, g, b: emu.chunk_kda(
               q, k, v, g, b, initial_state=d["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
               use_gate_in_kernel=True, A_log=d["A_log"], dt_bias=d["dtk"], lower_bound=-5.0, safe_gate=True,
               use_beta_sigmoid_in_kernel=True, cu_seqlens=cu),
           lambda q, k, v, g, b: kda(q, k, v, ld(g, d["A_log"], d["dtk"], -5.0, per_channel=True), b.sigmoid(),
                                     initial_state=d["h0"], output_final_state=True, use_qk_l2norm=True,
                                     cu_seqlens=cu), "q k v rawk beta")
    yield ("fused_recurrent_kda", lambda q, k, v, g, b: emu.fused_recurrent_kda(q, k, v, g, b, cu_seqlens=cu),
           lambda q, k, v, g, b: kda(q, k, v, g, b, cu_seqlens=cu, mode="recurrent"), "q k v gk beta")
    yield ("fused_kda_gate", lambda g: emu.fused_kda_gate(g, d["A_log"], d["dtk"]),
           lambda g: ld(g, d["A_log"], d["dtk"], per_channel=True), "rawk")
    yield ("causal_conv1d", lambda x, w, b, r: conv.causal_conv1d(x, w, b, r, activation="silu", cu_seqlens=cu),
           lambda x, w, b, r: reference.short_conv(x, w, cu, b, "silu") + r, "x w b res")
    yield ("causal_conv1d cache in+out",
           lambda x, w, b, r: conv.causal_conv1d(x, w, b, r, d["cache"], True, "silu", cu_seqlens=cu),
           lambda x, w, b, r: reference.short_conv(x, w, cu, b, "silu") + r, "x w b res")
    yield ("l2norm", lambda x: emu.l2norm(x), lambda x: l2norm(x), "xn")
    yield ("rms_norm_gated (vs kernels.gated_rms_norm)",
           lambda x, g, w: norm.rms_norm_gated(x, g, w, None, activation="sigmoid", eps=1e-5),
           lambda x, g, w: kernels.gated_rms_norm(x, g, w, 1e-5, "sigmoid", "torch"), "xn v nw")


def time_pair(emulated, reference, inputs, repeats: int) -> tuple[float, float]:
    """Min CPU ms of fwd+bwd of each callable over `repeats` rounds (after one untimed round); the
    order alternates every round so drift reaches both alike."""
    best = [float("inf"), float("inf")]
    for i in range(repeats + 1):
        for j in ((0, 1) if i % 2 else (1, 0)):
            for x in inputs:
                x.grad = None
            start = time.process_time()
            _total((emulated, reference)[j](*inputs)).backward()
            if i:
                best[j] = min(best[j], (time.process_time() - start) * 1e3)
    return best[0], best[1]


def _row(op, shape, emulated_ms, reference_ms, part="ops", judged=True) -> dict:
    """judged False: a row shown for what it costs, not held to the ops target."""
    return {"part": part, "op": op, "shape": shape, "emulated_ms": emulated_ms, "reference_ms": reference_ms,
            "ratio": emulated_ms / reference_ms if reference_ms else None, "judged": judged}


def op_rows(shapes, repeats: int) -> list[dict]:
    rows = []
    for shape in shapes:
        d = _inputs(shape)
        for op, emulated, reference, names in _pairs(d):
            inputs = [d[n].detach().clone().requires_grad_() for n in names.split()]
            rows.append(_row(op, shape, *time_pair(emulated, reference, inputs, repeats)))
    return rows


# ---------------------------------------------------------------------------------------------
# CP variants (2 ranks)


def _kda_piece(q, k, v, g, beta, **kwargs):
    from linattn import reference

    return reference.kda(q, k, v, g, beta, mode="chunk", **kwargs)


def _gdn_piece(q, k, v, g, beta, **kwargs):
    from linattn import reference

    return reference.gated_delta_rule(q, k, v, g, beta, mode="chunk", **kwargs)


def _cp_rank(shape: str, repeats: int) -> dict:
    """On every rank: {(op, layout): (emulated ms, reference ms)}, this rank's minimum."""
    import torch.distributed as dist

    from linattn import reference
    from linattn.emulation import conv, cp as emu_cp, delta_rules as emu
    from linattn.parallel import cp as linattn_cp

    torch.set_num_threads(1)
    d, group = _inputs(shape), dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    cu, T = d["cu"], int(d["cu"][-1])
    ref_ctx = linattn_cp.build_context(cu, group)
    contiguous = torch.arange(rank * T // size, (rank + 1) * T // size)
    out = {}
    for layout in ("contiguous", "zigzag"):
        ctx = emu_cp.build_cp_context(cu, group, conv1d_kernel_size=W, layout=layout)
        index = contiguous if layout == "contiguous" else emu_cp._fla_zigzag_index(T, rank, size)

        def args(names, index):  # this rank's tokens of q, k, .. / x; the conv's weight and bias whole
            return [(d[n][:, index] if n not in ("w", "b") else d[n]).detach().clone().requires_grad_()
                    for n in names.split()]

        pairs = [
            ("chunk_kda cp_context", "q k v gk beta", lambda *a: emu.chunk_kda(*a, cp_context=ctx),
             lambda *a: linattn_cp.delta_rule(*a, op="kda", backend="exchange", piece_op=_kda_piece,
                                              cp_context=ref_ctx)),
            ("chunk_gated_delta_rule cp_context", "q k v g beta",
             lambda *a: emu.chunk_gated_delta_rule(*a, cp_context=ctx),
             lambda *a: linattn_cp.delta_rule(*a, op="gated_delta_rule", backend="exchange", piece_op=_gdn_piece,
                                              cp_context=ref_ctx)),
            ("causal_conv1d cp_context", "x w b",
             lambda x, w, b: conv.causal_conv1d(x, w, b, activation="silu", cp_context=ctx),
             lambda x, w, b: linattn_cp.short_conv(x, w, b, "silu", backend="exchange", piece_op=reference.short_conv,
                                                   cp_context=ref_ctx)),
        ]
        for op, names, emulated, ref in pairs:
            args_emu, args_ref = args(names, index), args(names, contiguous)
            best = [float("inf"), float("inf")]
            for i in range(repeats + 1):
                for j, (fn, inputs) in enumerate(((emulated, args_emu), (ref, args_ref))):
                    for x in inputs:
                        x.grad = None
                    start = time.process_time()
                    _total(fn(*inputs)).backward()
                    if i:
                        best[j] = min(best[j], (time.process_time() - start) * 1e3)
            out[(op, layout)] = tuple(best)
        # a layer builds its context once per forward
        start = time.process_time()
        for _ in range(repeats):
            emu_cp.build_cp_context(cu, group, conv1d_kernel_size=W, layout=layout)
        built = (time.process_time() - start) * 1e3 / repeats
        start = time.process_time()
        for _ in range(repeats):
            linattn_cp.build_context(cu, group)
        out[("build_cp_context", layout)] = (built, (time.process_time() - start) * 1e3 / repeats)
    return out


def cp_op_rows(repeats: int, shapes=("test", "layer")) -> list[dict]:
    from pytest_linattn.ranks.pool import PoolManager

    rows = []
    with PoolManager("cpu") as pools:
        for shape in shapes:
            per_rank = pools.run(_cp_rank, 2, (shape, repeats))
            for key in per_rank[0]:
                emulated, ref = (max(r[key][j] for r in per_rank) for j in range(2))
                op, layout = key
                # build_cp_context computes fla's fields besides linattn's context: shown, not judged
                rows.append(_row(f"{op} ({'fla-zigzag' if layout == 'zigzag' else layout})", shape, emulated, ref,
                                 part="cp-ops", judged=op != "build_cp_context"))
    return rows
