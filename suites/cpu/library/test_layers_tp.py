"""Head-sharded layers at TP = tp_size (gloo, CPU) against the replicated layer on the same weights.

Each family runs, in one spawn call per (family, tp_size): value heads 1x, 2x and 3x the key heads,
sequence parallel on and off, in float64 (<= 1e-10) and float32 (<= 1e-5; a sharding bug is an
O(1) error in either). Compared:
the output, the input gradient and every parameter gradient (the ranks' gradients unsharded with
unshard_state_dict). Inputs are packed sequences, one of them a single token. Cases are
suites/cases/layer_parity.py's, shared with the CP and GPU layer tests; the checks are the public
harness's (pytest_linattn.harness).

Coverage, at TP 2 and 4 (variant: cases.layer_parity.make_config's ratio, KDA options by ratio):

    variant                                          cases
    GVA 1 (KDA: bounded gate, low-rank out gate)     SP off (float64), SP on (float32)
    GVA 2 (KDA: bounded gate, full-rank out gate)    SP off, SP on (float64)
    GVA 3 (KDA: unbounded gate, low-rank out gate)   SP off, SP on (float64)
"""

import pytest
import torch
import torch.distributed as dist

from cases.layer_parity import FAMILIES, assert_rules, error_of, make_case, make_config
from linattn.layers import LinearAttentionConfig, build_layer
from linattn.parallel import new_groups
from pytest_linattn.harness import assert_parity_cases

SEQLENS = (5, 1, 7, 3)  # 16 tokens: divisible by TP = 2 and 4 for sequence parallel
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_cases(family, tp_size):
    specs = [(1, False, torch.float64)] + [(ratio, sp, torch.float64) for ratio in (2, 3) for sp in (False, True)]
    specs.append((1, True, torch.float32))
    cu = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
    return [
        make_case(make_config(family, ratio), cu, seed=100 * FAMILIES.index(family) + i, tp=tp_size, sp=sp,
                  dtype=dtype, name=f"gva{ratio}", rtol=RTOL)
        for i, (ratio, sp, dtype) in enumerate(specs)
    ]


@pytest.mark.tp_sizes(2, 4)  # the configs have 4 key heads: other sizes are deselected
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_layer_matches_replicated(spawn, tp_size, family):
    cases = make_cases(family, tp_size)
    # also checks that every TP rank holds the same (TP-summed) replicated-weight gradient, bitwise
    assert_parity_cases(spawn, cases, world_size=tp_size)


# ---- rules that need a process group ---------------------------------------------------------



def run_group_rules():
    world = dist.get_world_size()
    tp_group, _ = new_groups(world)
    config = make_config("qwen3_5", 2)
    errors = {}
    odd_heads = LinearAttentionConfig("kda", hidden_size=8, num_k_heads=3, num_v_heads=6, head_k_dim=4, head_v_dim=4)
    errors["tp_heads"] = error_of(lambda: build_layer(odd_heads, tp_group=tp_group))
    layer = build_layer(config, tp_group=tp_group, sequence_parallel=True, dtype=torch.float64)
    x = torch.randn(1, 3, config.hidden_size, dtype=torch.float64)
    errors["sp_divisible"] = error_of(lambda: layer(x, torch.tensor([0, 2, 3 * world + 1], dtype=torch.int32)))
    errors["sp_tokens"] = error_of(lambda: layer(x, torch.tensor([0, 4 * world], dtype=torch.int32)))
    errors["tile"] = error_of(lambda: new_groups(world + 1))
    return errors


def test_rules_with_process_groups(spawn):
    per_rank = spawn(run_group_rules, 2)
    rules = {
        "tp_heads": "tensor parallel size must divide num_k_heads",
        "sp_divisible": "sequence parallel needs the total token count divisible by the TP size",
        "sp_tokens": "hidden_states must hold cu_seqlens\\[-1\\] / tp_size = 4 tokens under sequence parallel, got 3",
        "tile": "tp_size \\* cp_size must tile the world",
    }
    assert_rules(per_rank, rules)
