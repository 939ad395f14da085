"""The project's layer as the harness's client (cases/layer_parity.py, `linattn_layer`): the words its
`describe_grad_element` gives the element of a parameter gradient that a failure report names, by
head, channel and TP rank, from `parameter_layouts`' table. (The toy client's: test_harness.py.)
"""

import pytest

from cases.layer_parity import linattn_layer, make_config
from pytest_linattn.harness import Placement


# linattn's layer (4 key heads of dk 8, value heads 2 per key head of dv 6) at TP = 2: the worst
# element of a parameter gradient by head and channel, from parameter_layouts' table
LAYER_GRAD_ELEMENTS = [
    ("qwen3_5", "A_log", (5,), "value head 5 (TP rank 1)"),
    ("qwen3_5", "in_proj_qkv.weight", (19, 6), "q: key head 2, channel 3, col 6 (TP rank 1)"),
    ("qwen3_5", "in_proj_qkv.weight", (77, 0), "v: value head 2, channel 1, col 0 (TP rank 0)"),  # 77 = 2 * 32 + 13
    ("qwen3_5", "conv1d.weight", (20, 0, 3), "q: key head 2, channel 4, tap 3 (TP rank 1)"),
    ("qwen3_5", "out_proj.weight", (1, 35), "value head 5, channel 5, row 1 (TP rank 1)"),
    ("qwen3_5", "norm.weight", (5,), None),  # replicated: the default words
    # grouped per key head: 40 rows each (q 8, k 8, v 12, z 12); row 63 is key head 1's v, row 7
    ("qwen3_next", "in_proj_qkvz.weight", (63, 0), "v: value head 3, channel 1, col 0 (TP rank 0)"),
    ("qwen3_next", "in_proj_ba.weight", (11, 4), "a: value head 5, col 4 (TP rank 1)"),
    ("qwen3_next", "dt_bias", (2,), "value head 2 (TP rank 0)"),
    ("kda", "dt_bias", (43,), "value head 5, channel 3 (TP rank 1)"),
    ("kda", "q_conv1d.weight", (9, 0, 2), "key head 1, channel 1, tap 2 (TP rank 0)"),
    ("kda", "f_b_proj.weight", (63, 2), "value head 7, channel 7, col 2 (TP rank 1)"),
    ("kda", "f_a_proj.weight", (1, 2), None),
]


@pytest.mark.parametrize("family, name, index, words", LAYER_GRAD_ELEMENTS)
def test_layer_client_locates_gradient_elements_by_head(family, name, index, words):
    describe = linattn_layer(make_config(family, 2)).describe_grad_element
    assert describe(name, index, Placement(tp=2)) == words
