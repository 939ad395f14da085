"""A layer's fresh initialisation, in the dtypes users initialise in: every parameter finite.

A decay parameter drawn in bf16 can round to zero, and its log to -inf: transformers' Qwen3-Next /
Qwen3.5 `A = torch.empty(heads).uniform_(0, 16)` in bf16 lands on exactly 0 for about 1 draw in
500 (bf16's uniform draws are multiples of 1/16 on [0, 16)), `A_log = log(A)` is -inf, and that
head never decays and gets no gradient: a dead head that no parity check sees (the sharded and the
replicated layer load the same weights). The check builds the client's layer several times (seeds)
in each dtype and reports every non-finite parameter element, by name, index and head where the
parameter is per head. No ranks, no pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["assert_fresh_init_is_finite"]

MAX_LISTED = 8


def assert_fresh_init_is_finite(build: Callable, *, dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                                seeds: Sequence[int] = range(8), name: str = "") -> None:
    """`build(dtype)` -> a freshly initialised module, called under torch.manual_seed(seed) for every
    seed in `seeds` and dtype in `dtypes`: AssertionError listing each parameter with a non-finite
    element (NaN, +-inf): the dtype, the seed, the parameter, its first bad index and value, and the
    head where the parameter is a vector (one value per head)."""
    __tracebackhide__ = True
    if not callable(build):
        raise ValueError(f"build must be callable (dtype -> a freshly initialised module), got {build!r}")
    dtypes, seeds = list(dtypes), list(seeds)
    if not dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        raise ValueError(f"dtypes must be a non-empty sequence of floating torch dtypes, got {dtypes!r}")
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"seeds must be a non-empty sequence of ints, got {seeds!r}")
    found, checked = [], 0
    for dtype in dtypes:
        for seed in seeds:
            torch.manual_seed(seed)
            module = build(dtype)
            if not isinstance(module, torch.nn.Module):
                raise ValueError(f"build({dtype}) must return a torch.nn.Module, got {type(module).__name__}")
            for pname, param in module.named_parameters():
                checked += 1
                bad = ~torch.isfinite(param.detach())
                if bad.any():
                    index = tuple(int(i) for i in torch.nonzero(bad)[0])
                    value = float(param.detach()[index])
                    where = f"head {index[0]}" if param.dim() == 1 else f"index {index}"
                    found.append(f"{dtype}, seed {seed}: {pname} {where} is {value} ({int(bad.sum())} of "
                                 f"{param.numel()} elements not finite)")
    if found:
        label = f" for {name}" if name else ""
        listed = "\n".join(f"  {f}" for f in found[:MAX_LISTED])
        more = f"\n  ... and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
        raise AssertionError(f"fresh initialisation{label}: {len(found)} of {checked} parameter(s) built not finite "
                             f"({len(dtypes)} dtype(s) x {len(seeds)} seed(s)):\n{listed}{more}")
