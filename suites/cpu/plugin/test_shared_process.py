"""assert_layers_share_a_process: its input rules (the check itself runs in the bug record's
shared-process check, on the project's layers and on a plant that shares a head count process-wide)."""

import dataclasses

import pytest
import torch

from cases.layer_parity import make_case, make_config
from pytest_linattn.harness import assert_layers_share_a_process

CU = torch.tensor([0, 3, 8], dtype=torch.int32)


def test_cases_sharing_a_process_rules():
    first = make_case(make_config("qwen3_5", 2), CU, seed=1, tp=2, rtol=1e-10, name="first")
    second = make_case(make_config("kda", 2), CU, seed=2, tp=2, rtol=1e-10, name="second")
    with pytest.raises(ValueError, match="cases must be a sequence of at least two ParityCase"):
        assert_layers_share_a_process(None, [first])
    with pytest.raises(ValueError, match=r"cases must span one world size \(tp \* cp\), got \[2, 4\]"):
        assert_layers_share_a_process(None, [first, make_case(make_config("kda", 2), CU, seed=3, tp=4, rtol=1e-10)])
    with pytest.raises(ValueError, match="cases must have distinct names"):
        assert_layers_share_a_process(None, [first, dataclasses.replace(second, name=first.name)])
    with pytest.raises(ValueError, match="cases sharing a process run without recompute"):
        assert_layers_share_a_process(None, [first, dataclasses.replace(second, recompute="non-reentrant")])
