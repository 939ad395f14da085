"""CPU device shims: what megatron-core 0.19.2's GatedDeltaNet needs to run on a CPU over gloo.

Every shim is here, each with a comment saying why: TORCHDYNAMO_DISABLE (on import), the HAVE_FLA
check, `CPUBackend` (the spec without Transformer Engine), `install()` (torch.cuda.current_device
-> cpu and torch.cuda.current_stream -> None, once per rank process), `ready_for_finalizer()` (a
bare layer as finalize_model_grads' model chunk) and `cuda_tensors_on_cpu()` (the optimizer's
gradient norm, whose buffers are made with a literal device='cuda'). fla's kernels are not among
them: the layer's fla calls (`l2norm`, `causal_conv1d`, `chunk_gated_delta_rule`) run through
linattn.emulation's `fla_on_cpu`.
"""

from __future__ import annotations

import os

# @jit_fuser is torch.compile, applied when Megatron's modules are imported: run eagerly (inductor
# also works on a CPU, 8x slower); must be set before the first megatron import
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import contextlib  # noqa: E402

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import megatron.core.ssm.gated_delta_net.common as _gdn_common  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.backends import LocalSpecProvider  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # noqa: E402

__all__ = ["CPUBackend", "cuda_tensors_on_cpu", "install", "ready_for_finalizer"]

# fla 0.6.0 imports without a GPU, so Megatron's own HAVE_FLA guard passes; its kernels run only
# under fla_on_cpu
if not _gdn_common.HAVE_FLA:
    raise ImportError("megatron-core's GatedDeltaNet needs fla importable (fla-core 0.6.0, "
                      "flash-linear-attention 0.6.0); fla_on_cpu then computes its ops on a CPU")


class _RMSNormLikeTENorm:
    """torch RMSNorm whose weight carries `.sequence_parallel` as TENorm's does, so Megatron's
    gradient finalizer treats it exactly as on a GPU (WrappedTorchNorm refuses SP)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


class CPUBackend(LocalSpecProvider):
    """The GDN spec without Transformer Engine: pass as `backend=` to get_gated_delta_net_module_spec."""

    def column_parallel_layer_norm_linear(self):
        # TE fuses the block's input RMSNorm into in_proj; LocalSpecProvider gives None here.
        # A plain ColumnParallelLinear is that module without the fused norm (not GDN's concern)
        return ColumnParallelLinear

    def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
        return _RMSNormLikeTENorm


def ready_for_finalizer(module) -> None:
    """Lets Megatron's finalize_model_grads take the bare layer as a model chunk (no DDP wrapper)."""
    # the finalizer reads model_chunk.ddp_config, which the DDP wrapper sets: its defaults
    module.ddp_config = DistributedDataParallelConfig()
    # DDP's data x context all-reduce: the harness sums the CP ranks' gradients itself
    module.finish_grad_sync = _no_grad_sync


def _no_grad_sync(*args, **kwargs):
    pass


def install() -> None:
    """Once per rank process, before Megatron builds or runs the layer (its backward too)."""
    if torch.cuda.is_available():
        raise RuntimeError("these shims are for CPU-only ranks; on a GPU run Megatron as it is")
    # conv1d, dt_bias, A_log, the CP head permutation and SP's all-gather / reduce-scatter buffers
    # are allocated on torch.cuda.current_device(); process-wide, as the backward needs it too
    torch.cuda.current_device = _cpu
    # DistributedDataParallel's grad sync (param_and_grad_buffer.start_grad_sync) takes
    # torch.cuda.current_stream() only to wait on CUDA-graph replay events: no layer here sets
    # one, so the stream is never used (a method call on None would say so)
    torch.cuda.current_stream = _no_stream


def _cpu():
    return torch.device("cpu")


def _no_stream(*args, **kwargs):
    return None


class _CudaFactoriesOnCPU(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_tensors_on_cpu():
    """While active, tensors made with device='cuda' are made on the CPU.

    megatron.core.optimizer's gradient norm allocates its buffers with a literal device='cuda'
    (get_grad_norm_fp32's total_norm and dummy_overflow_buf, utils.local_multi_tensor_l2_norm's
    result, FP32Optimizer's _scale), not torch.cuda.current_device(), so install() cannot reach
    them; scoped to those calls, not process-wide."""
    with _CudaFactoriesOnCPU():
        yield
