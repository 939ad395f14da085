"""Kernel choice per architecture: pure functions over injected facts, plus cached wrappers.

The `choose_*` functions take a `Facts` and return a `Choice` (the value and a human reason);
they read nothing from the machine, so every branch is testable on a CPU. The wrappers
`short_conv_backend()`, `gate_norm_backend()`, `kda_tilelang_setting()` and `gdn_route()` read the real facts once
per process, log the choice at INFO on the "linattn.selection" logger, and cache it.

Everything here mirrors fla 0.6.0; the comments cite the file that each rule copies.
Nothing here imports fla or triton (importing fla takes seconds and wants a GPU).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("linattn.selection")

CONV_BACKENDS = ("triton", "mix", "cuda")
GDN_ROUTES = ("gated_delta_rule", "kda")

# The only environment variables the choices depend on; `read_facts` keeps just these so a
# Facts never carries (or prints) the rest of the environment.
RELEVANT_ENV = ("FLA_CONV_BACKEND", "FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH")

# fla/ops/common/chunk_o.py, chunk_bwd_dqkwg: the gated backward raises on Hopper when
# TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 (fla issue #640).
TRITON_BAD_HOPPER_BWD = ((3, 4, 0), (3, 7, 1))


@dataclass(frozen=True)
class Facts:
    """What the kernel choice depends on, gathered by `read_facts` or written by a test."""

    env: Mapping[str, str] = field(default_factory=dict)
    cuda_available: bool = False
    capability: tuple[int, int] | None = None  # (major, minor) of the current CUDA device
    triton_version: str | None = None
    causal_conv1d_bwd_importable: bool = False  # causal_conv1d.cpp_functions.causal_conv1d_bwd_function
    tilelang_usable: bool = False  # tilelang installed and an nvcc for its JIT found
    fla_installed: bool = False  # flash-linear-attention / fla-core importable (not imported)


@dataclass(frozen=True)
class Choice:
    value: str | None
    reason: str


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: '3.6.0+git1234' -> (3, 6, 0)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"version must start with a numeric release like '3.6.0', got {version!r}")
    numbers = tuple(int(part) for part in match.group(1).split("."))
    return numbers + (0,) * (3 - len(numbers))


def is_hopper(facts: Facts) -> bool:
    # fla/utils/hardware.py IS_NVIDIA_HOPPER: capability major 9 (or an 'NVIDIA H' device name,
    # which in practice is also sm_90).
    return facts.cuda_available and facts.capability is not None and facts.capability[0] == 9


def triton_in_bad_hopper_band(facts: Facts) -> bool:
    if facts.triton_version is None:
        return False
    low, high = TRITON_BAD_HOPPER_BWD
    return low <= version_tuple(facts.triton_version) < high


def tilelang_dispatch_active(facts: Facts) -> bool:
    """Whether fla would send chunk_bwd_dqkwg to its TileLang backend on Hopper.

    fla/backends.py: TileLangBackend.is_available = tilelang importable and has_usable_nvcc();
    is_enabled = FLA_TILELANG != "0", and when unset the backend's default_enable, which for
    fla/ops/common/backends/tilelang is IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 (true in the
    band we ask about). FLA_DISABLE_BACKEND_DISPATCH=1 bypasses every backend.
    """
    if facts.env.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    return facts.tilelang_usable and facts.env.get("FLA_TILELANG", "1") != "0"


def choose_short_conv_backend(facts: Facts) -> Choice:
    """`triton`, `mix` (Triton forward, causal-conv1d CUDA backward), `cuda`, or `torch` on a CPU.

    fla/modules/causal_conv1d/ops.py causal_conv1d(backend=...) takes the three names; `mix`
    is FastCausalConv1dFn in backends/cuda/ops.py and needs causal_conv1d_bwd_function.
    ShortConvolution reads FLA_CONV_BACKEND the same way: the variable wins over the default.
    """
    explicit = facts.env.get("FLA_CONV_BACKEND")
    if explicit is not None:
        if explicit not in CONV_BACKENDS:
            raise ValueError(
                f"FLA_CONV_BACKEND must be one of {', '.join(CONV_BACKENDS)}, got {explicit!r}"
            )
        return Choice(explicit, f"FLA_CONV_BACKEND={explicit} is set")
    if facts.cuda_available and facts.causal_conv1d_bwd_importable:
        # the fastest at the production layers' shapes (docs/results.md, kernel selection)
        return Choice("cuda", "CUDA present and causal-conv1d's CUDA kernels import: CUDA forward and backward")
    if facts.cuda_available:
        return Choice("triton", "CUDA present but causal-conv1d's CUDA backward does not import")
    return Choice("torch", "no CUDA: torch kernels on the CPU")


def choose_gate_norm_backend(facts: Facts) -> Choice:
    """`fla` (fla's fused pieces) or `torch` for the elementwise math around the kernels.

    fla fuses the decay gate and the beta sigmoid into its chunk kernels (chunk_kda and
    chunk_gated_delta_rule with use_gate_in_kernel / use_beta_sigmoid_in_kernel, fla/ops/kda/gate.py,
    fla/ops/common/gate.py) and the gated RMSNorm into one Triton kernel
    (fla/modules/norm/fused_norm_gate.py); all compute in float32, the same precision as the torch
    path. On a CPU fla cannot run.
    """
    fused = facts.cuda_available and facts.fla_installed
    where = "CUDA and fla present" if fused else "fla not installed" if facts.cuda_available else "no CUDA"
    how = "in fla's kernels" if fused else "in torch ops"
    return Choice("fla" if fused else "torch", f"{where}: gate, beta sigmoid and gated norm {how}")


def choose_kda_tilelang(facts: Facts) -> Choice:
    """The FLA_TILELANG value to be in force for KDA's backward (None: unset, fla's default).

    fla's KDA TileLang backend (fla/ops/kda/backends/tilelang) has default_enable=True, so with
    tilelang installed it takes chunk_kda_bwd_wy_dqkg_fused everywhere; on Blackwell
    (capability >= 10) we keep KDA's backward on Triton by setting FLA_TILELANG=0.
    """
    explicit = facts.env.get("FLA_TILELANG")
    if explicit is not None:
        return Choice(explicit, f"FLA_TILELANG={explicit} was set explicitly")
    if facts.cuda_available and facts.capability is not None and facts.capability[0] >= 10:
        major, minor = facts.capability
        return Choice("0", f"compute capability {major}.{minor} >= 10: KDA backward stays on Triton")
    return Choice(None, "Hopper or older (or no CUDA): FLA_TILELANG left unset, fla's default applies")


def choose_gdn_route(facts: Facts, needs_backward: bool = True) -> Choice:
    """`kda` where fla refuses the gated delta rule backward and the call needs one, else
    `gated_delta_rule` (fla's forward is allowed everywhere).

    The refusal (fla/ops/common/chunk_o.py chunk_bwd_dqkwg, reached from
    fla/ops/gated_delta_rule/chunk.py chunk_gated_delta_rule_bwd) needs Hopper, Triton in
    [3.4.0, 3.7.1) and the call not dispatched to TileLang. FlashQLA (fla/ops/gated_delta_rule/
    backends/flash_qla.py) would also avoid it, but only for K = V = 128, so it is not counted.
    """
    if not facts.cuda_available:
        return Choice("gated_delta_rule", "no CUDA: the torch reference runs gated delta rule directly")
    if not needs_backward:
        return Choice("gated_delta_rule", "forward only (no gradient recorded): fla's forward is allowed")
    if not is_hopper(facts):
        return Choice("gated_delta_rule", f"capability {facts.capability} is not Hopper: fla's backward is allowed")
    if not triton_in_bad_hopper_band(facts):
        return Choice("gated_delta_rule", f"Triton {facts.triton_version} is outside [3.4.0, 3.7.1): fla's backward is allowed")
    if tilelang_dispatch_active(facts):
        return Choice("gated_delta_rule", "Hopper with Triton in [3.4.0, 3.7.1) but TileLang takes the backward")
    return Choice(
        "kda",
        f"fla refuses gated chunk_bwd_dqkwg on Hopper with Triton {facts.triton_version} "
        "and no usable TileLang: run it as chunk_kda with the gate broadcast over key channels",
    )


def _installed_version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has_usable_nvcc() -> bool:
    # The same guesses as fla/utils/env.py has_usable_nvcc (TileLang's JIT needs nvcc).
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home is not None and (Path(cuda_home) / "bin" / "nvcc").exists():
        return True
    if shutil.which("nvcc") is not None:
        return True
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    if any(f.name in ("nvcc", "nvcc.exe") for f in files):
        return True
    return (Path("/usr/local/cuda") / "bin" / "nvcc").exists()


def _causal_conv1d_bwd_importable() -> bool:
    try:
        from causal_conv1d.cpp_functions import causal_conv1d_bwd_function  # noqa: F401
    except Exception:  # ImportError, or OSError from a CUDA extension built for another torch
        return False
    return True


def read_facts() -> Facts:
    """The real facts of this process, without importing fla or triton."""
    import torch

    cuda = torch.cuda.is_available()
    capability = tuple(torch.cuda.get_device_capability(torch.cuda.current_device())) if cuda else None
    return Facts(
        env={name: os.environ[name] for name in RELEVANT_ENV if name in os.environ},
        cuda_available=cuda,
        capability=capability,
        triton_version=_installed_version("triton", "pytorch-triton", "triton-windows"),
        # importing causal_conv1d loads its CUDA extension: only try where CUDA exists.
        causal_conv1d_bwd_importable=cuda and _causal_conv1d_bwd_importable(),
        tilelang_usable=importlib.util.find_spec("tilelang") is not None and _has_usable_nvcc(),
        fla_installed=importlib.util.find_spec("fla") is not None,
    )


@functools.cache
def short_conv_backend() -> str:
    choice = choose_short_conv_backend(read_facts())
    logger.info("short conv backend: %s (%s)", choice.value, choice.reason)
    return choice.value


@functools.cache
def gate_norm_backend() -> str:
    choice = choose_gate_norm_backend(read_facts())
    logger.info("gate / beta / gated norm: %s (%s)", choice.value, choice.reason)
    return choice.value


@functools.cache
def kda_tilelang_setting() -> str | None:
    """Apply the FLA_TILELANG choice to os.environ (only when unset) and return the value in force.

    fla reads FLA_TILELANG on every dispatch (fla/backends.py is_enabled), so setting it before
    the first KDA call is enough.
    """
    facts = read_facts()
    choice = choose_kda_tilelang(facts)
    if choice.value is not None and "FLA_TILELANG" not in facts.env:
        os.environ["FLA_TILELANG"] = choice.value
    logger.info("KDA FLA_TILELANG: %s (%s)", "unset" if choice.value is None else choice.value, choice.reason)
    return choice.value


@functools.cache
def gdn_route(needs_backward: bool = True) -> str:
    choice = choose_gdn_route(read_facts(), needs_backward)
    logger.info("gated delta rule route%s: %s (%s)", "" if needs_backward else " (forward only)", choice.value, choice.reason)
    return choice.value
