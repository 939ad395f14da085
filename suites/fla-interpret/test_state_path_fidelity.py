"""fla's own GatedDeltaNet and KimiDeltaAttention with fla's Cache, their Triton kernels
interpreted (float32): prefill chunks and decode steps as an inference loop runs them (eval, no
grad: fused_recurrent for calls of at most 64 tokens, the conv's cache paths and its decode step
`causal_conv1d_update`) against one full forward of the same layer from the same cache
(`assert_continuation_parity`; the client is suites/clients/fla_layers.py's `fla_state_path`).

Two sequences: 1 + 3 + 65 + 1 tokens then 2 decode steps, and 4 + 3 then 2 decode steps. The
bound is fidelity.py's float32 one (RTOL, 1e-4); a lost or stale state is an O(1) error.
"""

import pytest
import torch

from fidelity import RTOL
from pytest_linattn import Placement, assert_continuation_parity

CU = torch.tensor([0, 72, 81], dtype=torch.int32)


@pytest.mark.parametrize("kind, options", [("gdn", {}), ("kda", {"lower_bound": -5.0, "safe_gate": True})],
                         ids=["gated_deltanet", "kda-safe_gate"])
def test_fla_kernels_with_cache_continue_as_one_forward(spawn, kind, options):
    from clients.fla_layers import fla_cached_forward, fla_layer, fla_state_path

    reference, config, _ = fla_layer(kind, seed=41, **options)
    reference = reference.float()
    reference.layer_idx = 0
    assert_continuation_parity(spawn, fla_state_path(kind, differentiable=False, **options), reference,
                               [Placement()], CU, hidden_size=config.hidden_size, seed=43, rtol=RTOL,
                               conv_width=config.conv_size, chunk_size=64, dtype=torch.float32,
                               reference_forward=fla_cached_forward, name=f"fla-{kind}-interpreted")
