"""fla's PrecondGatedDeltaNet sharded as a team would (suites/precond_clients.py) under fla_on_cpu
and the sharded-parity harness, against the same layer replicated, float64, <= 1e-10: TP 2 on a
packing with a one-token sequence. That replicated layer against fla's own PrecondGatedDeltaNet:
<= 1e-6, the floor of fla's float32 cast of a_proj's and
a_atk_proj's outputs and of A_log / A_log_atk in its two decay gates (the client computes both
gates in float64). A CP placement is refused, naming fla's refusal of cp_context.

One plant, caught with a located report: the ATK preconditioner's decay-gate rows (a_atk_proj, one
per key head) dealt to the TP ranks in reverse order, so each rank's keys are preconditioned with
the other rank's gate.
"""

import pytest
import torch

from layer_parity import report_row, run_layer_tensors
from pytest_linattn import Placement, assert_parity, assert_sharded_parity
from pytest_linattn.parity import capture_records

RTOL = 1e-10
FLA_FLOAT32_GATE_RTOL = 1e-6  # fla's layer computes both decay gates in float32


def reversed_key_heads(t, tp, tp_rank):
    """The plant: TP rank r gets rank tp-1-r's block of key heads."""
    return t.chunk(tp, 0)[tp - 1 - tp_rank]


def test_fla_precond_sharded_matches_replicated(fla_on_cpu, spawn, packed_seqlens):
    from precond_clients import fla_precond_client, fla_precond_layer, replicated_precond

    layer = replicated_precond(fla_precond_layer(seed=71))
    cu = torch.tensor([0, 1, 9, 23, 40])  # a one-token sequence, then 8, 14 and 17 tokens
    assert_sharded_parity(spawn, fla_precond_client(), layer, [Placement(tp=2)], cu, hidden_size=layer.hidden_size,
                          seed=72, rtol=RTOL, name="fla precond gdn")


def test_replicated_client_matches_fla_s_own_layer(fla_on_cpu):
    from precond_clients import fla_precond_layer, replicated_precond
    from fla_clients import fla_forward

    fla_layer = fla_precond_layer(seed=75)
    client = replicated_precond(fla_layer)
    cu = torch.tensor([0, 1, 9, 16, 24])
    gen = torch.Generator().manual_seed(76)
    x, dy = (torch.randn(1, 24, fla_layer.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    results = [run_layer_tensors(fla_layer, x, dy, cu, fla_forward), run_layer_tensors(client, x, dy, cu)]
    assert len(results[0]) == 20  # y, dx and all 18 parameters, the ATK ones included
    assert_parity(results[1], results[0], rtol=FLA_FLOAT32_GATE_RTOL, name="client vs fla PrecondGatedDeltaNet",
                  cu_seqlens=cu)


def test_cp_placement_is_refused_naming_fla_s_refusal(fla_on_cpu):
    from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule
    from precond_clients import build_precond

    with pytest.raises(ValueError, match=r"CP 2 refused: fla's chunk_precond_gated_delta_rule refuses cp_context"):
        build_precond(Placement(tp=2, cp=2), (None, None), torch.float64, "cpu")
    # the refusal the client names is fla's own: the op given a CP context raises
    gen = torch.Generator().manual_seed(77)
    q, k = (torch.randn(1, 8, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 8, 2, 6, generator=gen, dtype=torch.float64)
    gates = [-torch.rand(1, 8, h, generator=gen, dtype=torch.float64) for h in (1, 2)]
    betas = [torch.rand(1, 8, h, generator=gen, dtype=torch.float64) for h in (1, 2)]
    with pytest.raises(NotImplementedError, match="Context parallelism is not yet supported for "
                                                  "chunk_precond_gated_delta_rule"):
        chunk_precond_gated_delta_rule(q, k, v, gates[0], gates[1], betas[0], betas[1], cp_context=object())


def test_atk_gate_sharded_in_reversed_head_order_is_caught(fla_on_cpu, spawn):
    from precond_clients import fla_precond_client, fla_precond_layer, replicated_precond

    layer = replicated_precond(fla_precond_layer(seed=73))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, fla_precond_client(shard_atk_gate=reversed_key_heads), layer, [Placement(tp=2)],
                              [0, 1, 9, 16], hidden_size=layer.hidden_size, seed=74, rtol=RTOL, name="fla precond gdn")
    report = str(info.value)
    assert report.startswith("parity failed for case fla precond gdn/tp2/seed74:")
    # the output is off by ~1e-2 (the ATK gate only reshapes the keys' preconditioner), located by
    # sequence and token; the ATK gate's own weight gradient is O(1) off, located by row
    output = report_row(report, "fla precond gdn/tp2/seed74 output")
    assert float(output.split()[5]) > 1e-3 and "seq 1 token" in output
    atk_gate = report_row(report, "a_atk_proj.weight")
    assert float(atk_gate.split()[1]) > 0.1 and "row " in atk_gate
