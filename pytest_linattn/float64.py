"""Float64 CPU reference run of any nn.Module: output and every gradient, original untouched.

    ref = float64_reference(layer, x, cu_seqlens)      # forward + backward in float64 on CPU
    y = layer(x_actual, cu_seqlens)
    y.backward(ref.grad_output.to(y))                   # same upstream gradient for the real run
    assert_parity(y, ref.output, rtol=1e-2)

The module is deep-copied and the copy converted to float64 on the CPU, so the caller's module
keeps its dtype, device and parameters' `.grad`. Floating tensor inputs are cloned to float64
CPU leaves; other tensors (cu_seqlens, indices) go to the CPU unchanged; anything else is
passed as is. This module imports no pytest.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

# A fixed seed for the random upstream gradient: reproducible, and random rather than ones
# (ones hide errors that cancel across a row) or zeros (they hide everything).
GRAD_OUTPUT_SEED = 1729


@dataclass
class Float64Result:
    """What `float64_reference` computed, all float64 on the CPU.

    output: the differentiated output (detached).
    input_grads: one entry per positional input, in order: the gradient for floating tensors
        (zeros where the output does not depend on it), None for everything else.
    param_grads: gradient per parameter name (`named_parameters()`), for parameters with
        requires_grad; zeros where unused.
    grad_output: the upstream gradient used; reuse it for the run being checked.
    """

    output: torch.Tensor
    input_grads: tuple
    param_grads: dict = field(default_factory=dict)
    grad_output: torch.Tensor | None = None


def _to_cpu64(x, *, leaf: bool):
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach()
    if x.is_floating_point():
        x = x.to(device="cpu", dtype=torch.float64).clone()
        return x.requires_grad_(True) if leaf else x
    return x.to("cpu").clone()


def float64_reference(module: nn.Module, *inputs, grad_output=None, forward_kwargs: dict | None = None,
                      seed: int = GRAD_OUTPUT_SEED) -> Float64Result:
    """Run a float64 CPU copy of `module` on `inputs`, forward and backward.

    module: any nn.Module; its forward must return a tensor, or a tuple/list whose first
        element is the tensor to differentiate (the rest is ignored).
    inputs: positional forward arguments.
    grad_output: upstream gradient for the output (any dtype/device, same shape). None draws
        a standard normal one from `seed` (a private generator: global RNG state untouched);
        it is returned as `result.grad_output` so the run being checked can use the same one.
    forward_kwargs: keyword arguments for forward (tensors go to the CPU, floats to float64,
        but get no gradients reported).
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if forward_kwargs is not None and not isinstance(forward_kwargs, dict):
        raise ValueError(f"forward_kwargs must be a dict or None, got {type(forward_kwargs).__name__}")
    ref = copy.deepcopy(module)
    ref.to(device="cpu", dtype=torch.float64)
    for p in ref.parameters():
        p.grad = None  # deepcopy carries the original's .grad along; the copy starts clean
    params = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]

    args = [_to_cpu64(x, leaf=True) for x in inputs]
    kwargs = {k: _to_cpu64(v, leaf=False) for k, v in (forward_kwargs or {}).items()}
    with torch.enable_grad():
        out = ref(*args, **kwargs)
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ValueError(f"module forward must return a floating tensor or a tuple starting with one, "
                             f"got {type(out).__name__}")
        if grad_output is None:
            gen = torch.Generator().manual_seed(int(seed))
            grad_output = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        else:
            if not isinstance(grad_output, torch.Tensor) or tuple(grad_output.shape) != tuple(out.shape):
                raise ValueError(f"grad_output must be a tensor of the output's shape {tuple(out.shape)}, got "
                                 f"{tuple(grad_output.shape) if isinstance(grad_output, torch.Tensor) else type(grad_output).__name__}")
            grad_output = grad_output.detach().to(device="cpu", dtype=torch.float64)
        float_args = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]
        wrt = float_args + [p for _, p in params]
        # autograd.grad rather than backward: nothing accumulates into any .grad.
        grads = torch.autograd.grad(out, wrt, grad_outputs=grad_output, allow_unused=True) if (
            wrt and out.requires_grad) else [None] * len(wrt)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt)]
    it = iter(grads[:len(float_args)])
    input_grads = tuple(next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in args)
    param_grads = {n: g for (n, _), g in zip(params, grads[len(float_args):])}
    return Float64Result(output=out.detach(), input_grads=input_grads, param_grads=param_grads,
                         grad_output=grad_output)
