"""TP beyond the key heads: tp_size a multiple of num_k_heads that divides num_v_heads, so each
key head is replicated over tp / H consecutive ranks, which split its value heads (as vLLM's
Mamba2 / GDN loaders replicate groups). Each family against the replicated layer in float64
(<= 1e-10): output, dx and every parameter gradient, the replicas' key-head gradients summed over
the replicas inside the layer, unsharded from the first replica.

    placement   key heads   value heads   replicas per key head
    TP 4        1           8             4
    TP 4        2           8             2
    TP 8        2           8             4

Three planted sharding bugs, each caught with the tensor and the place named: an output gate
not sliced among a key head's replicas; a value head given the wrong replicated key head; a
key-head gradient summed over the whole TP group instead of the key head's replicas.
"""

import dataclasses
import functools
import re

import pytest
import torch

from cases.layer_parity import FAMILIES, linattn_layer, make_case, random_state_dict
from linattn.layers import GatedDeltaNet, LinearAttentionConfig, build_layer, shard_state_dict
from linattn.parallel.mappings import copy_to_tensor_parallel_region
from pytest_linattn.harness import Placement, assert_parity_cases, assert_sharded_parity
from pytest_linattn.parity import capture_records

SEQLENS = (5, 1, 7, 3)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
RTOL = 1e-10
KDA_OPTIONS = {1: {"gate_lower_bound": -5.0, "output_gate_rank": 5}, 2: {}}  # both output gates, both decays


def make_config(family, key_heads):
    extra = KDA_OPTIONS[key_heads] if family == "kda" else {}
    return LinearAttentionConfig(family, hidden_size=20, num_k_heads=key_heads, num_v_heads=8, head_k_dim=8,
                                 head_v_dim=6, conv_size=4, norm_eps=1e-5, **extra)


def cases(tp, key_heads):
    return [make_case(make_config(family, key_heads), CU, seed=300 + 10 * FAMILIES.index(family) + key_heads, tp=tp,
                      name=f"k{key_heads}", rtol=RTOL) for family in FAMILIES]


def test_tp4_with_one_and_two_key_heads_matches_replicated(spawn):
    assert_parity_cases(spawn, cases(4, 1) + cases(4, 2), world_size=4)


def test_tp8_with_two_key_heads_matches_replicated(spawn):
    assert_parity_cases(spawn, cases(8, 2), world_size=8)


def test_sizes_beyond_the_key_heads_and_their_rules():
    config = make_config("qwen3_5", 2)
    assert [config.key_head_replicas(tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    local = config.local(8)
    assert (local.num_k_heads, local.num_v_heads) == (1, 1)
    rule = (r"tensor parallel size must divide num_k_heads: tp_size={tp}, num_k_heads=2, num_v_heads=8 \(or, "
            r"beyond the key heads, be a multiple of num_k_heads that divides num_v_heads")
    for tp in (3, 6, 16):  # neither a divisor nor a multiple; a multiple that does not divide the value heads
        with pytest.raises(ValueError, match=rule.format(tp=tp)):
            config.local(tp)
        with pytest.raises(ValueError, match=rule.format(tp=tp)):
            shard_state_dict(random_state_dict(config, 0), config, 0, tp)
    with pytest.raises(ValueError, match=r"^tp_size must be a positive int"):
        config.local(0)


# ---- plants -------------------------------------------------------------------------------------

PLANT_CONFIG = make_config("qwen3_5", 2)  # TP 4: key head 0 on ranks 0, 1; key head 1 on ranks 2, 3


def shard_gate_not_sliced_among_replicas(config, full, placement, tp_rank):
    """The output gate (in_proj_z) sliced by key head only: every replica of a key head gets the
    first replica's value heads' gate rows (the norm/gate shard does not follow the value heads)."""
    shard = shard_state_dict(full, config, tp_rank, placement.tp)
    first = tp_rank - tp_rank % config.key_head_replicas(placement.tp)
    shard["in_proj_z.weight"] = shard_state_dict(full, config, first, placement.tp)["in_proj_z.weight"]
    return shard


def shard_value_heads_on_the_wrong_key_head(config, full, placement, tp_rank):
    """Rank i given key head i % H (interleaved) instead of i // replicas: its value heads read
    another key head's q and k."""
    shard = shard_state_dict(full, config, tp_rank, placement.tp)
    wrong = shard_state_dict(full, config, (tp_rank % config.num_k_heads) * config.key_head_replicas(placement.tp),
                             placement.tp)
    q_k = 2 * config.head_k_dim  # one key head's q and k rows lead in_proj_qkv and conv1d
    for name in ("in_proj_qkv.weight", "conv1d.weight"):
        shard[name] = torch.cat([wrong[name][:q_k], shard[name][q_k:]])
    return shard


class KeyHeadGradientSummedOverTP(GatedDeltaNet):
    """The key-head weights' gradient all-reduced over the whole TP group (every key head's
    replicas together), not over the key head's replicas."""

    def _key_head(self, weight):
        return copy_to_tensor_parallel_region(weight, self.tp_group)


def _build_key_head_gradient_summed_over_tp(config, placement, groups, dtype, device):
    return KeyHeadGradientSummedOverTP(config, tp_group=groups[0], dtype=dtype, device=device)


@functools.lru_cache(maxsize=1)
def plant_reference():
    layer = build_layer(PLANT_CONFIG, dtype=torch.float64)
    layer.load_state_dict(random_state_dict(PLANT_CONFIG, 71))
    return layer


def report_of(spawn, **fields):
    layer = dataclasses.replace(linattn_layer(PLANT_CONFIG), **fields)
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, layer, plant_reference(), [Placement(tp=4)], CU,
                              hidden_size=PLANT_CONFIG.hidden_size, seed=71, rtol=RTOL, name="k2")
    return str(info.value)


def row(report, tensor):
    """The report table's line of `tensor` (its error and worst element), or ''."""
    found = re.search(rf"^\s+{re.escape(tensor)}\s.*$", report, re.M)
    return found.group(0) if found else ""


def test_gate_not_sliced_among_replicas_is_caught(spawn):
    report = report_of(spawn, shard=functools.partial(shard_gate_not_sliced_among_replicas, PLANT_CONFIG))
    assert row(report, "k2/tp4/seed71 output tp_rank0"), report
    # the second replica of each key head (TP ranks 1, 3: value heads 2, 3 and 6, 7) holds the wrong gate rows
    assert re.search(r"value head [2367], channel \d+, col \d+ \(TP rank [13]\)", row(report, "in_proj_z.weight")), report


def test_value_head_on_the_wrong_key_head_is_caught(spawn):
    report = report_of(spawn, shard=functools.partial(shard_value_heads_on_the_wrong_key_head, PLANT_CONFIG))
    assert re.search(r"seq \d+ token \d+ \(global \d+\)", row(report, "k2/tp4/seed71 output tp_rank0")), report
    assert re.search(r"[qk]: key head \d, .*\(TP ranks \d\.\.\d, its replicas\)", row(report, "in_proj_qkv.weight")), report


def test_key_head_gradient_summed_over_the_whole_tp_group_is_caught(spawn):
    report = report_of(spawn, build=functools.partial(_build_key_head_gradient_summed_over_tp, PLANT_CONFIG))
    assert not row(report, "k2/tp4/seed71 output tp_rank0"), report  # forward untouched: only key-head gradients
    for name in ("in_proj_qkv.weight", "conv1d.weight"):
        assert re.search(r"[qk]: key head \d, .*\(TP ranks \d\.\.\d, its replicas\)", row(report, name)), report
    assert not row(report, "in_proj_z.weight"), report  # value-head weights right
