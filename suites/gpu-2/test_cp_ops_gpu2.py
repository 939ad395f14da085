"""CP=2 ops over NCCL in bf16 against the float64 reference on the full batch (<= 2e-2).

Two backends per case: "fla" (fla's chunk kernels and causal conv with an fla CP context) and
"exchange" (our halo all-gather and rank-to-rank state passing around fla's single-GPU kernels).
Both layouts; zigzag goes through the all-to-all relayout.
"""

import pytest
import torch
import torch.nn.functional as F

from gpu_suite import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cp_op_parity import DELTA_RULES as OPS, reference_case, shard as shard_tokens, unshard
from layer_parity import GPU_HEADS
from linattn.parallel import cp
from pytest_linattn.parity import assert_parity
from pytest_linattn.seqlens import packed_seqlens

pytestmark = pytest.mark.gpus(2)

T = 512
W, D = 4, 128
# the head shape of every GPU suite: the CP layer tests have already tuned the CP kernels for it
H, HV, K, V = GPU_HEADS


def _cases(cp_size):
    gen = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cases = []
    for layout in cp.LAYOUTS:
        for seed in (0, 1):
            cu = packed_seqlens(T, cp_size=cp_size, layout=layout, seed=seed, edge_boundary=bool(seed))
            # inputs rounded to bf16 once, so the reference sees exactly what the kernels see
            case = dict(name=f"{layout}/seed{seed}", layout=layout, cu=cu)
            case["conv"] = dict(x=randn(1, T, D).bfloat16(), weight=randn(D, W).bfloat16(),
                                bias=randn(D).bfloat16(), dy=randn(1, T, D).bfloat16())
            for op, g_shape in (("gated_delta_rule", (1, T, HV)), ("kda", (1, T, HV, K))):
                case[op] = dict(
                    q=randn(1, T, H, K).bfloat16(), k=randn(1, T, H, K).bfloat16(),
                    v=randn(1, T, HV, V).bfloat16(),
                    g=F.logsigmoid(randn(*g_shape)).float(),  # fla keeps log decays in float32
                    beta=torch.sigmoid(randn(1, T, HV)).bfloat16(), do=randn(1, T, HV, V).bfloat16(),
                )
            cases.append(case)
    return cases


def _leaf(t, device):
    return t.detach().to(device).clone().requires_grad_(True)


def _run_cp_cases(cases):
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    rank, size = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        cu, layout = case["cu"], case["layout"]
        ctx = cp.build_context(cu.to(device), dist.group.WORLD, layout, total_tokens=T)

        def shard(t):
            return shard_tokens(t, cu, rank, size, layout).to(device)

        out = {}
        for path in ("fla", "exchange"):
            c = case["conv"]
            x = _leaf(shard(c["x"]), device)
            weight, bias = _leaf(c["weight"], device), _leaf(c["bias"], device)
            y = ctx.relayout.from_contiguous(
                cp.short_conv(ctx.relayout.to_contiguous(x), weight, bias, "silu", backend=path, cp_context=ctx))
            (y * shard(c["dy"])).sum().backward()
            out[(path, "conv")] = dict(y=y.detach(), dx=x.grad, dweight=weight.grad, dbias=bias.grad)
            for op in OPS:
                t = case[op]
                ins = {n: _leaf(shard(t[n]), device) for n in ("q", "k", "v", "g", "beta")}
                o = cp.delta_rule(*ctx.relayout.to_contiguous(*ins.values()), op=op, use_qk_l2norm=True,
                                  backend=path, cp_context=ctx)
                o = ctx.relayout.from_contiguous(o)
                (o * shard(t["do"])).sum().backward()
                out[(path, op)] = dict(o=o.detach(), **{f"d{n}": leaf.grad for n, leaf in ins.items()})
        results.append(out)
    return results


@pytest.mark.cp_sizes(2)
def test_cp_ops_bf16_match_reference(spawn, cp_size):
    cases = _cases(cp_size)
    per_rank = spawn(_run_cp_cases, cp_size, cases)
    for i, case in enumerate(cases):
        cu, layout = case["cu"], case["layout"]
        ref = reference_case(case, use_qk_l2norm=True)
        for (path, op), first in per_rank[0][i].items():
            got = {}
            for key in first:
                pieces = [per_rank[r][i][(path, op)][key] for r in range(cp_size)]
                if key in ("dweight", "dbias"):  # parameter grads are per-rank partial sums
                    got[key] = torch.stack([p.double() for p in pieces]).sum(0)
                else:
                    got[key] = unshard(pieces, cu, layout)
            assert_parity(got, ref[op], rtol=RTOL, name=f"cp{cp_size}/{case['name']}/{path}/{op}", cu_seqlens=cu)
