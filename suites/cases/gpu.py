"""What every GPU test module shares: it skips where it cannot run, and the bf16 bound.

    from cases.gpu import BF16_RTOL, require_cuda_and_fla
    require_cuda_and_fla()  # before importing anything that imports fla
"""

import pytest
import torch

# bf16 kernels against the float64 reference on the same bf16 values (fla's own tests: 5e-3 to 2e-2)
BF16_RTOL = 2e-2


def require_cuda_and_fla() -> None:
    """Skip the calling test module without a CUDA device or without fla. CUDA is checked first:
    importing fla on a CPU costs seconds."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)
    pytest.importorskip("fla", reason="fla is not installed: the GPU kernels need it")
