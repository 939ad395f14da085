"""fla's GatedDeltaNet2 (GDN-2) sharded as a team would (suites/clients/gdn2.py) under fla_on_cpu
and the sharded-parity harness, against the same layer replicated, float64, <= 1e-10: TP 2, CP 2
(contiguous) and TP 2 x CP 2 (fla's zigzag), on a packing with sequences across every interval
edge. That replicated layer against fla's own GatedDeltaNet2: <= 1e-6, the floor of fla's float32
cast of f_proj's output and A_log in its decay gate (the client computes the gate in float64).

Two plants, each caught with a located report: the write gate's rows (w_proj, per value head)
sharded in strided head order (rank 0 gets value heads 0 and 2, which belong to key heads 0 and 1,
instead of 0 and 1), and the op given this rank's cu_seqlens instead of the CP context (no state
crosses the ranks).
"""

import pytest
import torch

from cases.layer_parity import report_row, run_layer_tensors
from pytest_linattn import Placement, assert_parity, assert_sharded_parity
from pytest_linattn.parity import capture_records

RTOL = 1e-10
FLA_FLOAT32_GATE_RTOL = 1e-6  # fla's layer computes its decay gate in float32


def strided_value_heads(t, tp, tp_rank):
    """The plant: value heads dealt round-robin over the TP ranks (as if GVA grouped them "(g h)")."""
    from clients.gdn2 import SIZES

    head_v_dim = int(SIZES["head_dim"] * SIZES["expand_v"])
    return t.unflatten(0, (-1, tp, head_v_dim))[:, tp_rank].flatten(0, 1)


def test_fla_gdn2_sharded_matches_replicated(fla_on_cpu, spawn, packed_seqlens):
    from clients.gdn2 import fla_gdn2_client, fla_gdn2_layer, replicated_gdn2

    layer = replicated_gdn2(fla_gdn2_layer(seed=61))
    cu = packed_seqlens(32, 5, cp_size=2, layout="fla-zigzag", seed=6)
    placements = [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2, cp_layout="fla-zigzag")]
    assert_sharded_parity(spawn, fla_gdn2_client(), layer, placements, cu, hidden_size=layer.hidden_size,
                          seed=62, rtol=RTOL, world_size=4, name="fla gdn2")


def test_replicated_client_matches_fla_s_own_layer(fla_on_cpu):
    from clients.gdn2 import fla_gdn2_layer, replicated_gdn2
    from clients.fla_layers import fla_forward

    fla_layer = fla_gdn2_layer(seed=65)
    client = replicated_gdn2(fla_layer)
    cu = torch.tensor([0, 1, 9, 16, 24])
    gen = torch.Generator().manual_seed(66)
    x, dy = (torch.randn(1, 24, fla_layer.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    results = [run_layer_tensors(fla_layer, x, dy, cu, fla_forward), run_layer_tensors(client, x, dy, cu)]
    assert len(results[0]) == 19
    assert_parity(results[1], results[0], rtol=FLA_FLOAT32_GATE_RTOL, name="client vs fla GatedDeltaNet2",
                  cu_seqlens=cu)


def test_write_gate_sharded_in_strided_head_order_is_caught(fla_on_cpu, spawn):
    from clients.gdn2 import fla_gdn2_client, fla_gdn2_layer, replicated_gdn2

    layer = replicated_gdn2(fla_gdn2_layer(seed=63))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, fla_gdn2_client(shard_write_gate=strided_value_heads), layer, [Placement(tp=2)],
                              [0, 1, 9, 16], hidden_size=layer.hidden_size, seed=64, rtol=RTOL, name="fla gdn2")
    report = str(info.value)
    # the shard function splits a weight otherwise than unshard joins it: said first
    assert report.startswith("shard and unshard disagree: ") and "\n\nparity failed for case fla gdn2/tp2/seed64:" in report
    # O(1) off, located: the output by sequence and token, the write gate's weight gradient by row
    output = report_row(report, "fla gdn2/tp2/seed64 output")
    assert float(output.split()[4]) > 0.1 and "seq 1 token 6 (global 7), feature" in output
    write_gate = report_row(report, "w_proj.weight")
    assert float(write_gate.split()[1]) > 0.1 and "row " in write_gate


def test_state_not_passed_across_cp_ranks_is_caught(fla_on_cpu, spawn):
    # the convs get fla's CP context, the op only this rank's cu_seqlens: sequence 1 crosses the
    # rank boundary and restarts from zero state on rank 1
    from clients.gdn2 import fla_gdn2_client, fla_gdn2_layer, replicated_gdn2

    layer = replicated_gdn2(fla_gdn2_layer(seed=67))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, fla_gdn2_client(op_gets_cp_context=False), layer, [Placement(cp=2)],
                              [0, 1, 12, 16], hidden_size=layer.hidden_size, seed=68, rtol=RTOL, name="fla gdn2")
    report = str(info.value)
    assert report.startswith("parity failed for case fla gdn2/cp2-contiguous/seed68:")
    output = report_row(report, "fla gdn2/cp2-contiguous/seed68 output")
    assert float(output.split()[3]) > 0.1 and "seq 1 token" in output and "on CP rank 1," in output
    dx = report_row(report, "fla gdn2/cp2-contiguous/seed68 dx")
    assert float(dx.split()[3]) > 0.1 and "seq 1 token" in dx  # the crossing sequence's gradient
