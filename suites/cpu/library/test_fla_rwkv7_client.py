"""fla's RWKV7Attention sharded as a team would (suites/clients/rwkv7.py) under fla_on_cpu and the
sharded-parity harness, against the same layer replicated, float64, <= 1e-10: TP 2, CP 2
(contiguous; the token shift's previous token across the rank boundary) and TP 2 x CP 2 (fla's
zigzag), on a packing with sequences across every interval edge. That replicated layer against
fla's own RWKV7Attention: <= 1e-12 (fla's layer has no float32 cast on its forward path).

Two plants, each caught with a located report: the a-adapter's up-projection rows sharded
strided (rank r gets rows r, r+tp, ...: other heads' channels) instead of by head block, and the
op given this rank's cu_seqlens instead of the CP context (no state crosses the ranks).
"""

import pytest
import torch

from cases.layer_parity import report_row, run_layer_tensors
from pytest_linattn import Placement, assert_parity, assert_sharded_parity
from pytest_linattn.parity import capture_records

RTOL = 1e-10


def strided_rows(t, tp, tp_rank):
    """The plant: rows dealt out round-robin, ignoring that each head owns a contiguous block."""
    return t[tp_rank::tp]


def test_every_parameter_has_a_tp_rule(fla_on_cpu):
    from clients.rwkv7 import HEAD_ROWS, REPLICATED, fla_rwkv7_layer

    names = {n for n, _ in fla_rwkv7_layer(seed=60).named_parameters()}
    assert names == HEAD_ROWS | REPLICATED | {"o_proj.weight"} and len(names) == 26


def test_fla_rwkv7_sharded_matches_replicated(fla_on_cpu, spawn, packed_seqlens):
    from clients.rwkv7 import fla_rwkv7_client, fla_rwkv7_layer, replicated_rwkv7

    layer = replicated_rwkv7(fla_rwkv7_layer(seed=61))
    cu = packed_seqlens(32, 5, cp_size=2, layout="fla-zigzag", seed=6)
    placements = [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2, cp_layout="fla-zigzag")]
    assert_sharded_parity(spawn, fla_rwkv7_client(), layer, placements, cu, hidden_size=layer.hidden_size,
                          seed=62, rtol=RTOL, world_size=4, name="fla rwkv7")


def test_replicated_client_matches_fla_s_own_layer(fla_on_cpu):
    from clients.rwkv7 import fla_forward, fla_rwkv7_layer, replicated_rwkv7

    fla_layer = fla_rwkv7_layer(seed=63)
    client = replicated_rwkv7(fla_layer)
    cu = torch.tensor([0, 1, 9, 16, 24])
    gen = torch.Generator().manual_seed(64)
    x, dy = (torch.randn(1, 24, fla_layer.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    results = [run_layer_tensors(fla_layer, x, dy, cu, fla_forward), run_layer_tensors(client, x, dy, cu)]
    assert len(results[0]) == len(results[1]) == 28
    assert_parity(results[1], results[0], rtol=1e-12, name="client vs fla RWKV7Attention", cu_seqlens=cu)


def test_adapter_rows_sharded_strided_are_caught(fla_on_cpu, spawn):
    from clients.rwkv7 import fla_rwkv7_client, fla_rwkv7_layer, replicated_rwkv7

    layer = replicated_rwkv7(fla_rwkv7_layer(seed=65))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, fla_rwkv7_client(shard_lora=strided_rows), layer, [Placement(tp=2)],
                              [0, 1, 9, 16], hidden_size=layer.hidden_size, seed=66, rtol=RTOL, name="fla rwkv7")
    report = str(info.value)
    # the shard function splits a weight otherwise than unshard joins it: said first
    assert report.startswith("shard and unshard disagree: ") and "\n\nparity failed for case fla rwkv7/tp2/seed66:" in report
    output = report_row(report, "fla rwkv7/tp2/seed66 output")
    assert float(output.split()[4]) > 0.1 and "seq 2 token 2 (global 11), feature" in output
    adapter = report_row(report, "a_lora.lora.2.weight")
    assert float(adapter.split()[1]) > 0.1 and "row " in adapter


def test_state_not_passed_across_cp_ranks_is_caught(fla_on_cpu, spawn):
    # the token shift gets fla's CP context, the op only this rank's cu_seqlens: sequence 1 crosses
    # the rank boundary and restarts from zero state on rank 1
    from clients.rwkv7 import fla_rwkv7_client, fla_rwkv7_layer, replicated_rwkv7

    layer = replicated_rwkv7(fla_rwkv7_layer(seed=67))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, fla_rwkv7_client(op_gets_cp_context=False), layer, [Placement(cp=2)],
                              [0, 1, 12, 16], hidden_size=layer.hidden_size, seed=68, rtol=RTOL, name="fla rwkv7")
    report = str(info.value)
    assert report.startswith("parity failed for case fla rwkv7/cp2-contiguous/seed68:")
    output = report_row(report, "fla rwkv7/cp2-contiguous/seed68 output")
    assert float(output.split()[3]) > 1e-3 and "seq 1 token" in output and "on CP rank 1," in output
    dx = report_row(report, "fla rwkv7/cp2-contiguous/seed68 dx")
    assert "seq 1 token" in dx and "on CP rank 0," in dx  # dS never goes back to the rank before
