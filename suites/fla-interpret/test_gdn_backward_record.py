"""The bug record's N29 on fla's own GDN backward, interpreted (float32, CPU), against the float64
reference (`linattn.reference.gated_delta_rule`).

fla PR #826 (closed; issue #640): on Hopper with Triton >= 3.4, `tl.trans` of a tensor in the
wgmma layout inside `chunk_bwd_kernel_dqkwg` (fla/ops/common/chunk_o.py) miscompiles; the gated
delta rule's db and dg come out wrong, its forward right. fla 0.6.0 refuses that backward on
Hopper with Triton in [3.4.0, 3.7.1) (the project's layers take the kda route there), so no GPU
lent here runs it. The plant is the miscompile's effect written into the kernel's source: in dk's
product `tl.dot(tl.trans(b_ds), b_q, b_dk)` the transpose is lost, in a copy of the installed fla
module made at test time (the one line changed; the copy is never kept). fla's own backward must
match the reference; the planted one must be caught with exactly dk and dg named (dg is formed
from dk in the same kernel) at their worst token, the forward still right. The report names db
and dg: which tensor the miscompiled transpose was is not in the thread, so this is the effect
at one site, not the report's exact wrong values.
"""

import importlib.util
import inspect
import re
import time

import pytest
import torch
import torch.nn.functional as F

from fidelity import F32, F64, RTOL
from pytest_linattn.parity import assert_parity, capture_records

CU = torch.tensor([0, 45, 96, 130])  # 3 sequences, 64-token chunks: one crossed, a partial last chunk
H, K, V = 2, 32, 32
SEED = 826
# the gated branch of the kernel (USE_G: the one fla refuses on Hopper), where dg reads dk right after
TRANSPOSED = "b_dk = tl.dot(tl.trans(b_ds), b_q, b_dk)\n\n        b_dg = tl.sum(b_dq * b_q, axis=1)"


def inputs(seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    T = int(CU[-1])

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(F32).to(F64)  # float32 values, both sides

    q, k, v, do = draw(1, T, H, K), draw(1, T, H, K), draw(1, T, H, V), draw(1, T, H, V)
    g = F.logsigmoid(draw(1, T, H) + 2.0).to(F32).to(F64)  # log decays in about [-3, 0)
    beta = torch.sigmoid(draw(1, T, H)).to(F32).to(F64)
    return dict(q=q, k=k, v=v, g=g, beta=beta), do


def gradients(fn, values, do, dtype):
    leaves = {n: t.to(dtype).clone().requires_grad_(True) for n, t in values.items()}
    o = fn(**leaves)
    o.backward(do.to(dtype))
    return dict(o=o.detach().double(), **{f"d{n}": t.grad.double() for n, t in leaves.items()})


def fla_gdn(**t):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(**t, scale=K ** -0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=CU)[0]


def reference_gdn(**t):
    from linattn import reference

    return reference.gated_delta_rule(**t, scale=K ** -0.5, use_qk_l2norm=True, cu_seqlens=CU)[0]


def kernel_losing_the_transpose(tmp_path):
    """fla 0.6.0's chunk_bwd_kernel_dqkwg from a copy of its module with `tl.trans(b_ds)` read as
    `b_ds` in dk's product (a file: Triton reads a kernel's source)."""
    import fla.ops.common.chunk_o as chunk_o

    source = inspect.getsource(chunk_o)
    assert source.count(TRANSPOSED) == 1, f"fla's dqkwg kernel no longer reads {TRANSPOSED!r}: the plant needs a new site"
    path = tmp_path / "chunk_o_planted.py"
    path.write_text(source.replace(TRANSPOSED, TRANSPOSED.replace("tl.trans(b_ds)", "b_ds")))
    spec = importlib.util.spec_from_file_location("chunk_o_planted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chunk_bwd_kernel_dqkwg


def test_dqkwg_losing_the_transpose_is_caught(tmp_path, monkeypatch, record_property):
    import fla.ops.common.chunk_o as chunk_o

    values, do = inputs()
    ref = gradients(reference_gdn, values, do, F64)
    assert_parity(gradients(fla_gdn, values, do, F32), ref, rtol=RTOL, name="fla chunk_gated_delta_rule",
                  cu_seqlens=CU)

    monkeypatch.setattr(chunk_o, "chunk_bwd_kernel_dqkwg", kernel_losing_the_transpose(tmp_path))
    start = time.perf_counter()
    planted = gradients(fla_gdn, values, do, F32)
    assert_parity(planted["o"], ref["o"], rtol=RTOL, name="planted o", cu_seqlens=CU)  # the forward stays right
    with capture_records(), pytest.raises(AssertionError) as failure:
        assert_parity(planted, ref, rtol=RTOL, name="planted", cu_seqlens=CU)
    record_property("seconds", f"{time.perf_counter() - start:.2f}")
    wrong = re.findall(r"^\s*(d\w+)\s+\S+\s+\S+\s+\S+\s+(seq \d+ token \d+[^\n]*)$", str(failure.value), re.M)
    # dk's product lost its transpose, dg reads dk; dq (the same b_ds untransposed), dv and dbeta stay right
    assert {name for name, _ in wrong} == {"dk", "dg"}, str(failure.value)
    record_property("located", " / ".join(f"{name} {where.strip()}" for name, where in wrong))
