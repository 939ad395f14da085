"""TP = 2 over NCCL, bf16 layers on two GPUs (sequence parallel on and off) against the float64
replicated layer on the CPU, same weights and inputs: output, dx and every parameter gradient
(unsharded) <= 2e-2 relative. One spawn call per family runs both SP settings.
"""

import math

import pytest
import torch

if not torch.cuda.is_available():  # checked first: importing fla on a CPU costs seconds
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("fla", reason="fla is not installed: the GPU kernels need it")

from linattn.layers import (  # noqa: E402
    LinearAttentionConfig,
    build_layer,
    parameter_layouts,
    shard_state_dict,
    unshard_state_dict,
)
from pytest_linattn.parity import assert_parity  # noqa: E402

pytestmark = pytest.mark.gpus(2)

TP = 2
RTOL = 2e-2
DTYPE = torch.bfloat16
CU_SEQLENS = [0, 1, 130, 300, 516]  # 516 tokens: divisible by TP for sequence parallel
FAMILIES = {
    "qwen3_next": {},
    "qwen3_5": {},
    "kda": {"gate_lower_bound": -5.0},
}


def make_config(family):
    return LinearAttentionConfig(family, hidden_size=256, num_k_heads=4, num_v_heads=8,
                                 head_k_dim=64, head_v_dim=128, conv_size=4, **FAMILIES[family])


def random_state_dict(config, seed):
    """float64 values that bf16 holds exactly (drawn, then rounded to bf16)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, layout in parameter_layouts(config).items():
        t = torch.randn(layout.shape, generator=gen, dtype=torch.float64)
        if name == "A_log":
            t = torch.empty(layout.shape, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen).log()
        elif name == "dt_bias":
            dt = torch.exp(torch.rand(layout.shape, generator=gen, dtype=torch.float64)
                           * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            t = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        else:
            t = t / math.sqrt(layout.shape[-1])
        sd[name] = t.to(DTYPE).double()
    return sd


def run_layer(layer, x, dy, cu_seqlens):
    x = x.clone().requires_grad_()
    y = layer(x, cu_seqlens)
    (y * dy).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def run_tp_cases(cases):
    import torch.distributed as dist

    from linattn.parallel import new_groups

    rank = dist.get_rank()
    tp_group, _ = new_groups(dist.get_world_size())
    results = []
    for case in cases:
        config, sp = case["config"], case["sp"]
        layer = build_layer(config, tp_group=tp_group, sequence_parallel=sp, dtype=DTYPE, device="cuda")
        layer.load_state_dict({n: t.to(DTYPE) for n, t in shard_state_dict(case["state_dict"], config, rank, TP).items()})
        x, dy = case["x"], case["dy"]
        if sp:
            x, dy = x.chunk(TP, dim=1)[rank], dy.chunk(TP, dim=1)[rank]
        results.append(run_layer(layer, x.to("cuda", DTYPE), dy.to("cuda", DTYPE), case["cu_seqlens"].cuda()))
    return results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_bf16_layer_matches_float64(spawn, family):
    config = make_config(family)
    seed = 4000 + list(FAMILIES).index(family)
    sd = random_state_dict(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    T = CU_SEQLENS[-1]
    x = torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64).to(DTYPE).double()
    dy = torch.randn(1, T, config.hidden_size, generator=gen, dtype=torch.float64).to(DTYPE).double()
    cases = [dict(config=config, sp=sp, state_dict=sd, x=x, dy=dy, cu_seqlens=cu) for sp in (False, True)]
    per_rank = spawn(run_tp_cases, TP, cases)

    reference = build_layer(config, dtype=torch.float64)
    reference.load_state_dict(sd)
    y_ref, dx_ref, grads_ref = run_layer(reference, x, dy, cu)
    for i, case in enumerate(cases):
        label = f"tp{TP}/{family}/{'sp' if case['sp'] else 'nosp'}"
        ys, dxs, grads = zip(*(r[i] for r in per_rank))
        if case["sp"]:
            assert_parity(torch.cat(ys, dim=1), y_ref, rtol=RTOL, name=f"{label} output", cu_seqlens=cu)
            assert_parity(torch.cat(dxs, dim=1), dx_ref, rtol=RTOL, name=f"{label} dx", cu_seqlens=cu)
        else:
            for rank in range(TP):
                assert_parity(ys[rank], y_ref, rtol=RTOL, name=f"{label} output rank{rank}", cu_seqlens=cu)
                assert_parity(dxs[rank], dx_ref, rtol=RTOL, name=f"{label} dx rank{rank}", cu_seqlens=cu)
        assert_parity(unshard_state_dict(list(grads), config), grads_ref, rtol=RTOL, name=f"{label} grad")
