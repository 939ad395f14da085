"""The fla modes a process has active, as a value another process can enter (spawn's ranks).

``active_modes()`` in the test process, sent with each call; ``modes_context(value)`` in the
rank, around the call: fla's kernels interpreted (`interpreted.fla_interpreted`) outermost, then
fla's ops emulated (`patching.fla_on_cpu`) with the test's compute dtype.
"""

from __future__ import annotations

import contextlib

import torch

from . import interpreted, patching

__all__ = ["active_modes", "modes_context"]


def active_modes() -> dict | None:
    """None when no fla mode is active here, else ``{"interpreted": bool, "fla_on_cpu": dtype or None}``."""
    dtype = patching.active_compute_dtype()
    if dtype is None and not interpreted.active():
        return None
    return {"interpreted": interpreted.active(), "fla_on_cpu": dtype}


@contextlib.contextmanager
def modes_context(modes):
    """Enter what `active_modes` returned (a bare dtype means fla_on_cpu with that dtype)."""
    if isinstance(modes, torch.dtype):
        modes = {"interpreted": False, "fla_on_cpu": modes}
    with contextlib.ExitStack() as stack:
        if modes and modes.get("interpreted"):
            stack.enter_context(interpreted.fla_interpreted())
        if modes and modes.get("fla_on_cpu") is not None:
            stack.enter_context(patching.fla_on_cpu(modes["fla_on_cpu"]))
        yield
