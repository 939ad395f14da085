"""Long decodes (`assert_long_decode_parity`) on linattn's layer, one float32 rank (a collective per step at TP would cost more than
it shows here: TP is covered by the short checks) against the
float64 serial run: 256 decode steps after a short prefill, the returned state's dtype held to
float32 and each step's error to rtol * max(1, t/16)^0.5.

The correct client passes; a decode that stores its recurrent state in bf16 every step
(TensorRT-Model-Connect #725: a persistent DeltaNet state written back in the storage dtype)
fails the dtype contract at the first decode step and the error bound within a few steps. A
decode that updates the state it was given in place and returns the same tensors (as a serving
engine's pool is updated) passes: the check keeps a copy of every call's state.
"""


import pytest
import torch

from cases.layer_parity import linattn_state_path, make_config, replicated_layer
from linattn.layers import LayerState
from pytest_linattn.harness import Placement
from pytest_linattn.harness.long_decode import assert_long_decode_parity, decode_error_bound
from pytest_linattn.parity import capture_records

CONFIG = make_config("qwen3_5", 1)


def reference(seed=41):
    return replicated_layer(CONFIG, seed)


def decode_storing_bf16_state(module, x, state, placement):
    """The recurrent state written back in bf16 after every token (read back as float32)."""
    y, new = module.step(x, LayerState(state.conv, state.recurrent.float()))
    return y, LayerState(new.conv, new.recurrent.to(torch.bfloat16))


def decode_in_place(module, x, state, placement):
    """The state it was given updated in place, and returned: the same tensors every step."""
    y, new = module.step(x, state)
    for old, n in zip(state, new):
        old.copy_(n)
    return y, state


def check(spawn, steps=256, **fields):
    with capture_records():
        assert_long_decode_parity(spawn, linattn_state_path(CONFIG, **fields), reference(), [Placement(tp=1)],
                                  num_sequences=2, prefill=5, steps=steps, hidden_size=CONFIG.hidden_size, seed=42,
                                  name="qwen3_5")


def test_error_bound_grows_as_a_random_walk_after_warmup():
    assert decode_error_bound(1, 1e-5, 0.5, 16) == decode_error_bound(16, 1e-5, 0.5, 16) == 1e-5
    assert decode_error_bound(256, 1e-5, 0.5, 16) == pytest.approx(4e-5)


def test_long_decode_float32_and_a_bf16_state(spawn):
    check(spawn)  # the correct client passes
    with pytest.raises(AssertionError) as info:
        check(spawn, decode=decode_storing_bf16_state)
    report = str(info.value)
    assert ("state dtype: decode step 1 returned field recurrent in torch.bfloat16, below the contract "
            "torch.float32 (256 such field(s) over the calls; rank 0)") in report, report
    assert "error growth: state field recurrent first exceeds the bound at decode step 1: error" in report, report


def test_decode_updating_its_state_in_place_passes(spawn):
    # the prefill's returned state is the tensors every later step updates: kept by reference,
    # the prefill call would be blamed for the last step's state
    check(spawn, steps=32, decode=decode_in_place)


def test_bad_input_names_the_parameter_and_the_rule():
    with pytest.raises(ValueError, match=r"growth must be a number in \[0, 1\]"):
        assert_long_decode_parity(None, linattn_state_path(CONFIG), reference(), [Placement(tp=2)], num_sequences=2,
                                  prefill=5, hidden_size=20, seed=0, growth=2)
    with pytest.raises(ValueError, match=r"state_dtype must be a floating-point torch.dtype"):
        assert_long_decode_parity(None, linattn_state_path(CONFIG), reference(), [Placement(tp=2)], num_sequences=2,
                                  prefill=5, hidden_size=20, seed=0, state_dtype=torch.int32)
