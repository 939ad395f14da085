"""A GPU run whose float64 reference is an fla-based model: fla's own GatedDeltaNet and
KimiDeltaAttention with fla's Cache (suites/clients/fla_layers.py `fla_state_path`) run on fla's
compiled kernels in bf16 on the GPU, and the reference is the same fla layer in float64 on the
CPU, in the test process, under `linattn.emulation.fla_on_cpu()` entered around each reference
call only (`reference_forward`): spawn's ranks, started outside it, keep fla's compiled kernels.
The example docs/gpus.md ("The float64 reference of an fla-based model") shows.

The reference's weights are rounded to bf16 first (the ranks' layer gets them through
`same_weights`), so the bound is the bf16 kernels' alone: BF16_RTOL (KDA's tokens KDA_BF16_RTOL,
measured on every bf16 path: cases.gpu).
"""

import time

import pytest
import torch

from cases.gpu import BF16_RTOL, KDA_BF16_RTOL, require_cuda_and_fla

require_cuda_and_fla()

from linattn.emulation import fla_on_cpu  # noqa: E402
from pytest_linattn import Placement, assert_continuation_parity  # noqa: E402

pytestmark = pytest.mark.gpus(1)

# fla's layers at the GPU suites' head sizes (fla's kernels want head dims of 16 and more)
SIZES = dict(hidden_size=256, head_dim=64, num_heads=4, num_v_heads=8, conv_size=4, norm_eps=1e-5)
SEQLENS = (72, 70, 40, 9)  # as the CPU case (suites/cpu/library/test_fla_state_path.py): 64-token chunks crossed
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
KINDS = [("gdn", {}, BF16_RTOL), ("kda", {"lower_bound": -5.0, "safe_gate": True}, KDA_BF16_RTOL)]
TIMES = {}


def reference_on_cpu(reference, x, cu_seqlens, state):
    """The fla reference in float64 on the CPU: the emulation entered for this call only."""
    from clients.fla_layers import fla_cached_forward

    start = time.perf_counter()
    with fla_on_cpu():
        out = fla_cached_forward(reference, x, cu_seqlens, state)
    TIMES.setdefault("reference calls", []).append(time.perf_counter() - start)
    return out


def fla_reference(kind, options, seed=41):
    """fla's layer in float64 on the CPU, its weights the project's seeded ones rounded to bf16."""
    from fla.layers import GatedDeltaNet, KimiDeltaAttention

    from cases.layer_parity import random_state_dict
    from linattn.layers import config_from_fla_layer, to_fla_state_dict

    layer = (GatedDeltaNet if kind == "gdn" else KimiDeltaAttention)(**SIZES, **options).double()
    config = config_from_fla_layer(layer)
    layer.load_state_dict(to_fla_state_dict(random_state_dict(config, seed, round_to=torch.bfloat16), config))
    layer.layer_idx = 0
    return layer.eval(), config


@pytest.mark.parametrize("kind, options, rtol", KINDS, ids=[k for k, _, _ in KINDS])
def test_fla_layer_on_the_gpu_against_its_float64_self_on_the_cpu(spawn, kind, options, rtol):
    from clients.fla_layers import fla_state_path

    reference, config = fla_reference(kind, options)
    assert_continuation_parity(spawn, fla_state_path(kind, differentiable=False, sizes=SIZES, **options), reference,
                               [Placement()], CU, hidden_size=config.hidden_size, seed=42, rtol=rtol,
                               conv_width=config.conv_size, chunk_size=64, dtype=torch.bfloat16,
                               reference_forward=reference_on_cpu, name=f"fla-{kind}-ref-on-cpu")
    calls = TIMES.pop("reference calls", [])
    print(f"fla-{kind}: {len(calls)} reference call(s) under fla_on_cpu, {sum(calls):.2f} s")
