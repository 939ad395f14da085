"""Input validation shared by every package of linattn: references, kernels, layers, CP (and the plugin).

Every rule raises ValueError whose message starts with the argument's name, so a caller (and a
test's `match=`) can tell which argument broke which rule.
"""

import numbers

import torch

COMPUTE_DTYPES = (torch.float32, torch.float64)


def require(condition: bool, name: str, rule: str) -> None:
    """Raise ValueError('<name> <rule>') unless `condition` holds."""
    if not condition:
        fail(name, rule)


def fail(name: str, rule: str):
    """Raise ValueError('<name> <rule>'). Per-call checks of the kernel entries write
    `if not condition: fail(name, f"...")`, so the message is formatted only on failure (formatting
    every message of a call cost ~30 us of CPU per delta-rule call, which a launch-bound step pays)."""
    raise ValueError(f"{name} {rule}")


def wants_grad(*tensors) -> bool:
    """Whether autograd will want gradients of any of `tensors` (None entries skipped): the kernels
    and the layers' decode step pick a differentiable path by it."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def positive_int(value, name: str) -> int:
    """value as an int, unless it is not an integer >= 1 (a bool is not): ValueError naming `name`."""
    __tracebackhide__ = True
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        fail(name, f"must be a positive int, got {value!r}")
    return int(value)


def validate_floating(x: torch.Tensor, name: str) -> None:
    require(isinstance(x, torch.Tensor), name, f"must be a torch.Tensor, got {type(x).__name__}")
    require(x.is_floating_point(), name, f"must be a floating-point tensor, got {x.dtype}")


def validate_compute_dtype(compute_dtype: torch.dtype, name: str = "compute_dtype") -> None:
    require(compute_dtype in COMPUTE_DTYPES, name, f"must be torch.float32 or torch.float64, got {compute_dtype}")


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int, name: str = "cu_seqlens") -> list[int]:
    """Check packed-sequence boundaries and return them as a list of Python ints.

    Rules: an integer torch tensor, 1-D, at least two entries (one sequence), starting at 0,
    never decreasing (empty sequences are allowed), ending at `total_tokens`.
    """
    require(isinstance(cu_seqlens, torch.Tensor), name, f"must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    require(not cu_seqlens.is_floating_point() and not cu_seqlens.is_complex() and cu_seqlens.dtype != torch.bool,
            name, f"must be an integer tensor, got {cu_seqlens.dtype}")
    require(cu_seqlens.dim() == 1, name, f"must be 1-D, got shape {tuple(cu_seqlens.shape)}")
    require(cu_seqlens.numel() >= 2, name, f"must hold at least 2 entries (one sequence), got {cu_seqlens.numel()}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    require(bounds[0] == 0, name, f"must start at 0, got {bounds[0]}")
    steps = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    require(min(steps) >= 0, name, f"must be non-decreasing, got {bounds}")
    require(bounds[-1] == total_tokens, name, f"must end at the number of tokens {total_tokens}, got {bounds[-1]}")
    return bounds


def sequence_bounds(batch: int, tokens: int, cu_seqlens: torch.Tensor | None, name: str = "x") -> list[int]:
    """Boundaries of the sequences held by a `[B, T, ...]` tensor named `name`.

    With cu_seqlens, B must be 1 and the sequences are packed along T; without it, each of the
    B rows is one sequence of T tokens.
    """
    if cu_seqlens is None:
        return [b * tokens for b in range(batch + 1)]
    require(batch == 1, name, f"must have batch size 1 when cu_seqlens is given, got {batch}")
    return validate_cu_seqlens(cu_seqlens, tokens)


def validate_shape(x: torch.Tensor, shape: tuple, name: str) -> None:
    require(tuple(x.shape) == tuple(shape), name, f"must have shape {tuple(shape)}, got {tuple(x.shape)}")
