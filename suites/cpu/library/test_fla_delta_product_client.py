"""fla's GatedDeltaProduct sharded as a team would (suites/clients/delta_product.py) under
fla_on_cpu and the sharded-parity harness, against the same layer replicated, float64, <= 1e-10:
TP 2, CP 2 (contiguous) and TP 2 x CP 2 (fla's zigzag), on a packing with sequences across every
interval edge. That replicated layer against fla's own GatedDeltaProduct: <= 1e-6, the floor of
fla's float32 cast of A_log in its decay gate (the client computes the gate in float64).

Two plants, each caught with a located report: the per-step key rows sharded as one block per TP
rank (rank 0 then gets every head's first step instead of its own heads' steps), and the op given
this rank's cu_seqlens instead of the CP context (no state crosses the ranks).
"""

import pytest
import torch

from cases.layer_parity import report_row, run_layer_tensors
from pytest_linattn import Placement, assert_parity, assert_sharded_parity
from pytest_linattn.parity import capture_records

RTOL = 1e-10
FLA_FLOAT32_GATE_RTOL = 1e-6  # fla's layer computes exp(A_log) in float32


def contiguous_rows(t, heads, tp, tp_rank):
    """The plant: k rows split as if they were (head, dim) rows, ignoring the step-major layout."""
    return t.chunk(tp, dim=0)[tp_rank]


def test_fla_delta_product_sharded_matches_replicated(fla_on_cpu, spawn, packed_seqlens):
    from clients.delta_product import fla_delta_product_client, fla_delta_product_layer, replicated_delta_product

    layer = replicated_delta_product(fla_delta_product_layer(seed=51))
    cu = packed_seqlens(32, 5, cp_size=2, layout="fla-zigzag", seed=6)
    placements = [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2, cp_layout="fla-zigzag")]
    assert_sharded_parity(spawn, fla_delta_product_client(), layer, placements, cu, hidden_size=layer.hidden_size,
                          seed=52, rtol=RTOL, world_size=4, name="fla delta_product")


def test_keys_sharded_across_steps_are_caught(fla_on_cpu, spawn):
    from clients.delta_product import fla_delta_product_client, fla_delta_product_layer, replicated_delta_product

    layer = replicated_delta_product(fla_delta_product_layer(seed=53))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, fla_delta_product_client(shard_keys=contiguous_rows), layer, [Placement(tp=2)],
                              [0, 1, 9, 16], hidden_size=layer.hidden_size, seed=54, rtol=RTOL,
                              name="fla delta_product")
    report = str(info.value)
    # the shard function splits a weight otherwise than unshard joins it: said first
    assert report.startswith("shard and unshard disagree: ") and "\n\nparity failed for case fla delta_product/tp2/seed54: 5 failing check(s)" in report
    # O(1) off, located: the output by sequence and token, the keys' weight gradient by row
    output = report_row(report, "fla delta_product/tp2/seed54 output")
    assert float(output.split()[4]) > 0.1 and "seq 2 token 1 (global 10), feature" in output
    keys = report_row(report, "k_proj.weight")
    assert float(keys.split()[1]) > 0.1 and "row " in keys


def test_replicated_client_matches_fla_s_own_layer(fla_on_cpu):
    from clients.delta_product import fla_delta_product_layer, replicated_delta_product
    from clients.fla_layers import fla_forward

    fla_layer = fla_delta_product_layer(seed=55)
    client = replicated_delta_product(fla_layer)
    cu = torch.tensor([0, 1, 9, 16, 24])
    gen = torch.Generator().manual_seed(56)
    x, dy = (torch.randn(1, 24, fla_layer.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    results = [run_layer_tensors(fla_layer, x, dy, cu, fla_forward), run_layer_tensors(client, x, dy, cu)]
    assert len(results[0]) == 15
    assert_parity(results[1], results[0], rtol=FLA_FLOAT32_GATE_RTOL, name="client vs fla GatedDeltaProduct",
                  cu_seqlens=cu)


def test_state_not_passed_across_cp_ranks_is_caught(fla_on_cpu, spawn):
    # the convs get fla's CP context, the op only this rank's cu_seqlens: sequence 1 crosses the
    # rank boundary and restarts from zero state on rank 1
    from clients.delta_product import fla_delta_product_client, fla_delta_product_layer, replicated_delta_product

    layer = replicated_delta_product(fla_delta_product_layer(seed=57))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, fla_delta_product_client(op_gets_cp_context=False), layer, [Placement(cp=2)],
                              [0, 1, 12, 16], hidden_size=layer.hidden_size, seed=58, rtol=RTOL,
                              name="fla delta_product")
    report = str(info.value)
    assert report.startswith("parity failed for case fla delta_product/cp2-contiguous/seed58:")
    output = report_row(report, "fla delta_product/cp2-contiguous/seed58 output")
    assert float(output.split()[3]) > 0.1 and "seq 1 token" in output and "on CP rank 1," in output
    dx = report_row(report, "fla delta_product/cp2-contiguous/seed58 dx")
    assert "seq 1 token" in dx and "on CP rank 0," in dx  # dS never goes back to the rank before
