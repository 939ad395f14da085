"""fla's own GatedDeltaNet and KimiDeltaAttention with fla's Cache, under the fla_on_cpu
emulation in float64: prefill chunks and decode steps (a serving loop's calls) against one full
forward of the same layer from the same cache, through `assert_continuation_parity` (<= 1e-10).

Differentiable (under grad fla's layers run the chunk kernels, the conv with its cache in and
out) and as inference (eval, no grad: fused_recurrent for calls of at most 64 tokens, the conv's
decode step, `causal_conv1d_update`). Unsharded: fla's layers have no TP of their own.
"""


import pytest
import torch

from linattn.reference.delta_rule import CHUNK_SIZE
from pytest_linattn import Placement, assert_continuation_parity

SEQLENS = (72, 70, 40, 9)  # as the project's layer cases: 1+3+65+1, 4+63+1, 38, 3+r+r, then 2 decode steps
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("differentiable", [True, False], ids=["chunk-with-grad", "inference"])
@pytest.mark.parametrize("kind, options", [("gdn", {}), ("kda", {"lower_bound": -5.0, "safe_gate": True})],
                         ids=["gated_deltanet", "kda-safe_gate"])
def test_fla_layer_with_cache_continues_as_one_forward(spawn, fla_on_cpu, kind, options, differentiable):
    from clients.fla_layers import fla_cached_forward, fla_layer, fla_state_path

    reference, config, _ = fla_layer(kind, seed=41, **options)
    reference.layer_idx = 0
    assert_continuation_parity(spawn, fla_state_path(kind, differentiable=differentiable, **options), reference,
                               [Placement()], CU, hidden_size=config.hidden_size, seed=42, rtol=1e-10,
                               conv_width=config.conv_size, chunk_size=CHUNK_SIZE,
                               reference_forward=fla_cached_forward, name=f"fla-{kind}")
