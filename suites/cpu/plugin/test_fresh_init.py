"""`assert_fresh_init_is_finite`: linattn's layers (GDN in both weight layouts, KDA) freshly built in
float32 and bf16 have every parameter finite over 64 seeds (the CPU suites' small layers; the
record's check builds 32 value heads); transformers #47842's
init (A drawn from uniform_(0, 16) in bf16, then log) is the record's `transformers-47842`. Bad input
names the parameter."""

import pytest
import torch

from cases.layer_parity import make_config
from linattn.layers import build_layer
from pytest_linattn.harness import assert_fresh_init_is_finite


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kda"])
def test_linattn_layers_initialise_finite_in_bf16_and_float32(family):
    config = make_config(family, 2)
    assert_fresh_init_is_finite(lambda dtype: build_layer(config, dtype=dtype), seeds=range(64), name=family)


def test_a_non_finite_parameter_is_named_with_its_head_and_seed():
    def build(dtype):
        module = torch.nn.Module()
        module.A_log = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
        module.A_log.data[2] = float("-inf")
        return module

    with pytest.raises(AssertionError, match=r"torch\.float32, seed 0: A_log head 2 is -inf \(1 of 4 elements"):
        assert_fresh_init_is_finite(build, dtypes=[torch.float32], seeds=[0])


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="build must be callable"):
        assert_fresh_init_is_finite(None)
    with pytest.raises(ValueError, match="dtypes must be a non-empty sequence of floating torch dtypes"):
        assert_fresh_init_is_finite(lambda dtype: torch.nn.Linear(2, 2), dtypes=[torch.int32])
    with pytest.raises(ValueError, match="seeds must be a non-empty sequence of ints"):
        assert_fresh_init_is_finite(lambda dtype: torch.nn.Linear(2, 2), seeds=[])
