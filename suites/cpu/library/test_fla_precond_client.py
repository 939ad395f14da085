"""fla's PrecondGatedDeltaNet and PrecondKDA sharded as a team would (suites/clients/precond.py)
under fla_on_cpu and the sharded-parity harness, against the same layer replicated, float64,
<= 1e-10: TP 2, CP 2 (contiguous) and TP 2 x CP 2 (fla's zigzag), on a packing with sequences
across every interval edge. fla 0.6.0's preconditioned ops refuse `cp_context`; the clients pass
the recurrent and ATK states across the CP ranks themselves (initial_state / initial_A_state in,
both final states out, their gradients back). Each replicated layer against fla's own layer:
<= 1e-6, the floor of fla's float32 casts in the decay gates (the clients compute them in float64).

Plants, each caught with a located report: PrecondGatedDeltaNet's ATK decay-gate rows (a_atk_proj,
one per key head) and PrecondKDA's per-channel decay up-projection rows (f_proj.1, head_k_dim rows
per value head) dealt to the TP ranks in reverse head order; and under CP the recurrent state
passed but the ATK state not (every rank starts its preconditioner from zero).
"""

import pytest
import torch

from cases.layer_parity import report_row, run_layer_tensors
from pytest_linattn import Placement, assert_parity, assert_sharded_parity
from pytest_linattn.parity import capture_records

RTOL = 1e-10
FLA_FLOAT32_GATE_RTOL = 1e-6  # fla's layers compute the decay gates in float32
PLACEMENTS = [Placement(tp=2), Placement(cp=2), Placement(tp=2, cp=2, cp_layout="fla-zigzag")]
FAMILIES = ["precond_gdn", "precond_kda"]


def reversed_key_heads(t, tp, tp_rank):
    """The plant: TP rank r gets rank tp-1-r's block of heads."""
    return t.chunk(tp, 0)[tp - 1 - tp_rank]


@pytest.mark.parametrize("family", FAMILIES)
def test_fla_precond_sharded_matches_replicated(fla_on_cpu, spawn, packed_seqlens, family):
    from cases.fla_families import cpu_family

    layer, client = cpu_family(family, seed=71)
    cu = packed_seqlens(32, 5, cp_size=2, layout="fla-zigzag", seed=6)
    assert_sharded_parity(spawn, client, layer, PLACEMENTS, cu, hidden_size=layer.hidden_size, seed=72, rtol=RTOL,
                          world_size=4, name=f"fla {family}")


@pytest.mark.parametrize("family, parameters", [("precond_gdn", 18), ("precond_kda", 21)], ids=FAMILIES)
def test_replicated_client_matches_fla_s_own_layer(fla_on_cpu, family, parameters):
    import importlib

    from clients.fla_layers import fla_forward
    from cases.fla_families import CLIENTS

    module, make_fla_layer, make_replicated, _ = CLIENTS[family]
    clients = importlib.import_module(module)
    fla_layer = getattr(clients, make_fla_layer)(seed=75)
    client = getattr(clients, make_replicated)(fla_layer)
    cu = torch.tensor([0, 1, 9, 16, 24])
    gen = torch.Generator().manual_seed(76)
    x, dy = (torch.randn(1, 24, fla_layer.hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    results = [run_layer_tensors(fla_layer, x, dy, cu, fla_forward), run_layer_tensors(client, x, dy, cu)]
    assert len(results[0]) == len(results[1]) == parameters + 2  # y, dx and every parameter, the ATK ones included
    assert_parity(results[1], results[0], rtol=FLA_FLOAT32_GATE_RTOL, name=f"client vs fla {type(fla_layer).__name__}",
                  cu_seqlens=cu)


def test_fla_refuses_cp_context_so_the_clients_pass_the_states():
    # the reason the clients carry the states across CP ranks themselves: fla's own ops refuse a context
    from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule
    from fla.ops.precond_kda import chunk_precond_kda

    gen = torch.Generator().manual_seed(77)
    q, k = (torch.randn(1, 8, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 8, 2, 6, generator=gen, dtype=torch.float64)
    gate, beta = -torch.rand(1, 8, 2, generator=gen, dtype=torch.float64), torch.rand(1, 8, 2, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="Context parallelism is not yet supported for "
                                                  "chunk_precond_gated_delta_rule"):
        chunk_precond_gated_delta_rule(q, k, v, gate, gate, beta, beta, cp_context=object())
    with pytest.raises(NotImplementedError, match="Context parallelism is not yet supported for chunk_precond_kda"):
        chunk_precond_kda(q, k, v, gate[..., None].expand_as(q), gate, beta, beta, cp_context=object())


@pytest.mark.parametrize("family, weight, output_error, output_at", [
    # the ATK gate only reshapes the keys' preconditioner: the output is off by ~1e-2
    ("precond_gdn", "a_atk_proj.weight", 1e-3, "seq 1 token 5 (global 6), feature 19"),
    # the per-channel decay of the other rank's heads: O(1)
    ("precond_kda", "f_proj.1.weight", 0.1, "seq 2 token 6 (global 15), feature 7"),
], ids=["precond_gdn-atk_gate", "precond_kda-decay"])
def test_head_sharded_weight_in_reversed_head_order_is_caught(fla_on_cpu, spawn, family, weight, output_error,
                                                              output_at):
    from cases.fla_families import cpu_family
    from clients.precond import fla_precond_client, fla_precond_kda_client

    layer, _ = cpu_family(family, seed=73)
    client = (fla_precond_client(shard_atk_gate=reversed_key_heads) if family == "precond_gdn"
              else fla_precond_kda_client(shard_decay=reversed_key_heads))
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, client, layer, [Placement(tp=2)], [0, 1, 9, 16], hidden_size=layer.hidden_size,
                              seed=74, rtol=RTOL, name=f"fla {family}")
    report = str(info.value)
    # the shard function splits a weight otherwise than unshard joins it: said first
    assert report.startswith("shard and unshard disagree: ") and f"\n\nparity failed for case fla {family}/tp2/seed74:" in report
    # the output located by sequence and token; the planted weight's own gradient O(1) off, by row
    output = report_row(report, f"fla {family}/tp2/seed74 output tp_rank0")
    assert float(output.split()[4]) > output_error and output_at in output
    planted = report_row(report, weight)
    assert float(planted.split()[1]) > 0.5 and "row " in planted


@pytest.mark.parametrize("family, output_at, dx_rank", [
    ("precond_gdn", "seq 1 token 7 (global 8) on CP rank 1,", "on CP rank 0,"),
    ("precond_kda", "seq 1 token 9 (global 10) on CP rank 1,", "on CP rank 1,"),
], ids=FAMILIES)
def test_atk_state_not_passed_across_cp_ranks_is_caught(fla_on_cpu, spawn, family, output_at, dx_rank):
    # the recurrent state crosses the CP boundary, the ATK state does not: sequence 1 crosses it
    # and its preconditioner restarts from zero on rank 1
    from clients import precond
    from cases.fla_families import cpu_family

    layer, _ = cpu_family(family, seed=78)
    make = precond.fla_precond_client if family == "precond_gdn" else precond.fla_precond_kda_client
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, make(passes_preconditioner=False), layer, [Placement(cp=2)], [0, 1, 12, 16],
                              hidden_size=layer.hidden_size, seed=79, rtol=RTOL, name=f"fla {family}")
    report = str(info.value)
    assert report.startswith(f"parity failed for case fla {family}/cp2-contiguous/seed79: 3 failing check(s)")
    output = report_row(report, f"fla {family}/cp2-contiguous/seed79 output")
    assert float(output.split()[3]) > 1e-2 and output_at in output
    dx = report_row(report, f"fla {family}/cp2-contiguous/seed79 dx")
    assert float(dx.split()[3]) > 1e-2 and "seq 1 token" in dx and dx_rank in dx
    atk_gate = report_row(report, "A_log_atk")  # the ATK decay's gradient, the most off of the scalars
    assert float(atk_gate.split()[1]) > 0.1
