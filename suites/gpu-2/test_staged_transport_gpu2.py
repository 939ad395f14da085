"""Every torch.distributed entry point on CUDA tensors of 2 ranks sharing one GPU (the staged
transport, --linattn-ranks-per-gpu 2): suites/cases/staged_ops.py's checks, which the cpu suite runs
on CPU tensors. Where each rank has a GPU of its own the ranks run NCCL, and this test skips."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from cases.staged_ops import check_ranks_sharing_a_gpu  # noqa: E402

pytestmark = pytest.mark.gpus(2)


def test_every_op_on_ranks_sharing_a_gpu(spawn):
    check_ranks_sharing_a_gpu(spawn, 2)
