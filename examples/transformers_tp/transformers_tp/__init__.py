"""transformers' own tensor-parallel plan (DTensor, `distributed_config=DistributedConfig(tp_size=2,
tp_plan="auto")`) on tiny Qwen3-Next, Qwen3.5 and Kimi Linear checkpoints, checked on a CPU over
gloo with pytest-linattn's public surface.

Importing this package decides, once per process, which linear-attention kernels transformers
uses. transformers binds them when a model's modeling module is imported (its
`use_kernel_func_from_hub_with_fallback` decorators import fla, or fall back to transformers'
own torch functions), so the choice has to be made before that import, in the test process and
in every rank process (the rank functions live in `transformers_tp.client`, which imports this
package first when spawn's ranks unpickle them):

    fla absent (default)     `sys.modules["fla"] = None`: fla cannot be imported, transformers
                             runs its torch fallbacks (`torch_chunk_gated_delta_rule`, ...).
    fla emulated             environment variable TRANSFORMERS_TP_FLA=emulated (conftest.py sets
                             it for `--linattn-fla-on-cpu`): fla stays importable, transformers
                             binds fla's kernels and pytest-linattn's `fla_on_cpu` computes them
                             on float64 references on the CPU (fla's Triton kernels need a GPU).

A process keeps its mode: the rank processes of spawn's pool live for the whole pytest session,
so one session runs one mode (two runs for the two modes: README).
"""

from __future__ import annotations

import os
import sys

__all__ = ["FLA_ENV", "FLA_MODES", "fla_mode"]

FLA_ENV = "TRANSFORMERS_TP_FLA"
FLA_MODES = ("absent", "emulated")
# the modeling modules that bind fla's kernels (or the torch fallbacks) at import
_MODELING = ("transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5",
             "transformers.models.kimi_linear.modeling_kimi_linear")


def fla_mode() -> str:
    """This process's mode, "absent" or "emulated" (from TRANSFORMERS_TP_FLA; default absent)."""
    mode = os.environ.get(FLA_ENV, "absent").strip().lower() or "absent"
    if mode not in FLA_MODES:
        raise ValueError(f"{FLA_ENV} must be one of {', '.join(FLA_MODES)}, got {mode!r}")
    return mode


def _apply(mode: str) -> None:
    fla_blocked = "fla" in sys.modules and sys.modules["fla"] is None
    if mode == "absent" and not fla_blocked:
        bound = [m for m in _MODELING if m in sys.modules]
        if bound:  # too late: these modules hold fla's kernels already
            raise RuntimeError(f"transformers_tp: fla must be blocked before transformers imports {bound[0]}; "
                               f"import transformers_tp first")
        sys.modules["fla"] = None  # `import fla` now raises ImportError: transformers falls back to torch
    elif mode == "emulated" and fla_blocked:
        raise RuntimeError(f"transformers_tp: {FLA_ENV}=emulated, but fla was blocked in this process earlier")


_apply(fla_mode())
