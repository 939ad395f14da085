"""Import single kernel modules of a pinned vLLM or sglang release from the files `fetch`
unpacked, without the engines' package `__init__`s and without their compiled extensions.

    from clients.engines import loader
    fused_recurrent = loader.load_vllm("vllm.third_party.flash_linear_attention.ops.fused_recurrent")

Two kinds of stand-ins, nothing else:

- bare packages: each package on the way to a kernel module is registered as an empty module
  whose `__path__` is the real folder, so `import vllm.x.y` finds the real `vllm/x/y.py` but
  never runs `vllm/__init__.py` (which imports the whole engine and its compiled extensions);
- stub modules for a few incidental imports (and one CUDA fast path that the clients' shapes never
  take): platform probes (CUDA and the device's capability
  where the kernels are compiled for a GPU, no CUDA under the interpreter; no ROCm; never
  `is_cpu()`: vLLM's causal_conv1d.py:1131-1137 swaps its Triton functions for vllm._C CPU ops
  when it is), re-exports of triton, and constants copied from modules that import the engine.

Before the first import the files are checked against the hashes `fetch` recorded from the
wheel: a missing or changed file raises `EngineFilesError`, naming the file and the release.
On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before they are
defined): linattn's interpreter patches (`linattn.emulation.interpreted`) and one more here
(`_replaced_grid_arguments`). With CUDA and without TRITON_INTERPRET=1 they are compiled: no
patches, the probes report the GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from pathlib import Path

from clients.engines.fetch import ENGINES_DIR, SGLANG, VLLM, Release, _sha256, read_manifest

__all__ = ["EngineFilesError", "check_files", "load_sglang", "load_vllm", "missing_reason"]

FETCH_COMMAND = "python suites/clients/engines/fetch.py"


class EngineFilesError(RuntimeError):
    """A pinned release's kernel file is missing or not the release's."""


def check_files(release: Release, base: Path = ENGINES_DIR) -> Path:
    """The release's folder, its carried files all there and as the wheel recorded them; else
    EngineFilesError naming the first file that is not."""
    folder = release.folder(base)
    recorded = read_manifest(folder)
    if not recorded:
        raise EngineFilesError(f"{release.name}: its kernel files were not fetched (no {folder}/files.sha256); "
                               f"run `{FETCH_COMMAND}`")
    for path in release.carried:
        file = folder / path
        if path not in recorded or not file.is_file():
            raise EngineFilesError(f"{release.name}: kernel file {path} is missing from {folder}; "
                                   f"run `{FETCH_COMMAND}`")
        if _sha256(file) != recorded[path]:
            raise EngineFilesError(f"{release.name}: kernel file {path} was changed: its sha256 is not the "
                                   f"{release.wheel}'s; run `{FETCH_COMMAND}` to restore it")
    return folder


def missing_reason(release: Release, base: Path = ENGINES_DIR) -> str | None:
    """Why the release's files cannot be loaded (for a skip), or None."""
    try:
        check_files(release, base)
    except EngineFilesError as exc:
        return str(exc)
    return None


def _on_gpu() -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1" and _cuda_available()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _bare_package(folder: Path, name: str) -> None:
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__path__ = [str(folder.joinpath(*name.split(".")))]
    module.__package__ = name
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def _stub(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


def _packages(carried) -> list:
    """Every package on the way to a carried file whose `__init__.py` is not carried, parents first."""
    names = set()
    for path in carried:
        parts = path[:-len(".py")].split("/")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    real = {path[:-len("/__init__.py")].replace("/", ".") for path in carried if path.endswith("/__init__.py")}
    return sorted(names - real, key=lambda n: (n.count("."), n))


def _device_capability(device_id=None):
    """The CUDA device's (major, minor), as torch reports it."""
    import torch

    return torch.cuda.get_device_capability(device_id)


class _VllmPlatform:
    """vllm.platforms.current_platform, as far as the carried kernels ask: CUDA where the kernels
    are compiled for a GPU, its capability the device's (vllm/platforms/cuda.py: capability
    major * 10 + minor; kda/chunk_intra.py:571-574 picks tf32 for solve_tril from it,
    fused_recurrent.py:445-446 a Blackwell path), none on a CPU; never `is_cpu()` (which swaps
    the conv kernels for vllm._C ops); no PDL."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def is_cuda(self):
        return self.cuda

    def is_cuda_alike(self):
        return self.cuda

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def is_arch_support_pdl(self):
        return False

    def get_device_capability(self, device_id=0):
        if not self.cuda:
            return None
        major, minor = _device_capability(device_id)
        return types.SimpleNamespace(major=major, minor=minor, to_int=lambda: major * 10 + minor,
                                     as_version_str=lambda: f"{major}.{minor}")

    def has_device_capability(self, capability, device_id=0):
        found = self.get_device_capability(device_id)
        if found is None:
            return False
        return found.to_int() >= (capability if isinstance(capability, int) else capability[0] * 10 + capability[1])

    def is_device_capability(self, capability, device_id=0):
        found = self.get_device_capability(device_id)
        if found is None:
            return False
        return found.to_int() == (capability if isinstance(capability, int) else capability[0] * 10 + capability[1])

    def is_device_capability_family(self, capability, device_id=0):
        found = self.get_device_capability(device_id)
        return found is not None and found.to_int() // 10 == capability // 10

    def is_pin_memory_available(self):
        return False


_ready = set()


def _prepare(release: Release) -> None:
    if release.engine in _ready:
        return
    folder = check_files(release)
    if os.environ.get("TRITON_INTERPRET") == "1" or not _cuda_available():
        _prepare_interpreter()
    for name in _packages(release.carried):
        _bare_package(folder, name)
    import triton
    import triton.language as tl

    cuda = _on_gpu()
    if release is VLLM:
        import triton.language.extra.libdevice as tldevice

        _stub("vllm.platforms", current_platform=_VllmPlatform(cuda))
        _stub("vllm.triton_utils", triton=triton, tl=tl, tldevice=tldevice, HAS_TRITON=True)
        # vllm/v1/attention/backends/utils.py:54-55 (that module imports vllm.config)
        _stub("vllm.v1.attention.backends.utils", PAD_SLOT_ID=-1, NULL_BLOCK_ID=0)
    else:
        import torch
        from packaging import version

        major, minor = _device_capability() if cuda else (0, 0)
        sm = major * 10 + minor  # sglang/srt/utils/common.py get_device_sm
        _stub("sglang.kernels.jit.utils", is_arch_support_pdl=lambda: False,
              get_jit_cuda_arch=lambda: types.SimpleNamespace(major=major, minor=minor))
        _stub("sglang.srt")  # the parent of the two below (the real package imports the engine)
        _stub("sglang.srt.utils", is_cuda=lambda: cuda, is_hip=lambda: False, is_npu=lambda: False,
              is_xpu=lambda: False, is_cpu=lambda: False, is_gfx95_supported=lambda: False,
              is_sm90_supported=lambda: major == 9, get_device_sm=lambda: sm, cpu_has_amx_support=lambda: False,
              cdiv=lambda a, b: -(a // -b), next_power_of_2=lambda n: 1 if n <= 1 else 1 << (n - 1).bit_length())
        # sglang/srt/utils/common.py:120 computes this; that file imports 70 modules of the engine
        _stub("sglang.srt.utils.common", torch_release=version.parse(torch.__version__).release)
        # the KDA packed decode's CUDA fast path, a JIT-compiled extension (kernels/ops/attention/
        # kda_packed_decode.py): its `covered` takes only head dims of 128 and batches past a minimum,
        # which no client here has, so it answers what the real one would: the Triton kernel runs
        _stub("sglang.kernels.ops.attention.kda_packed_decode", covered=lambda *args, **kwargs: False)
    _ready.add(release.engine)


def _load(release: Release, name: str):
    _prepare(release)
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise EngineFilesError(f"{release.name}: importing {name} from {release.folder()} failed: {exc} (a file "
                               f"it imports is not among the fetched ones, or the release is not the pinned one)"
                               ) from exc
    fla_utils = sys.modules.get("sglang.kernels.ops.attention.fla.utils")
    if release is SGLANG and fla_utils is not None and not _on_gpu():
        # its input_guard enters torch.cpu.device(index) (fla/utils.py:326), which torch 2.13 lacks
        fla_utils.custom_device_ctx = lambda index: contextlib.nullcontext()
    return module


def load_vllm(name: str):
    """A module of the pinned vLLM's kernel files, e.g. "vllm.model_executor.layers.mamba.ops.causal_conv1d"."""
    return _load(VLLM, name)


def load_sglang(name: str):
    """A module of the pinned sglang's kernel files."""
    return _load(SGLANG, name)


# ----------------------------------------------------------------------------------------------
# Triton's interpreter


def _prepare_interpreter() -> None:
    from linattn.emulation import interpreted

    interpreted.prepare_process()  # TRITON_INTERPRET=1 and linattn's patches (bool masks, builtins bound by name, ...)
    from triton.runtime import interpreter

    if not hasattr(interpreter.GridExecutor.__init__, "_linattn_original"):
        interpreter.GridExecutor.__init__ = _replaced_grid_arguments(interpreter.GridExecutor.__init__, interpreter)


def _replaced_grid_arguments(original, interpreter):
    """Compiled Triton launches with the grid callback's META after the callback ran, so a callback
    that replaces an argument changes what the kernel gets (vLLM's causal_conv1d_fn:
    `META["batch_ptr"] = nums_dict[BLOCK_M]["batch_ptr"]`, causal_conv1d.py:562-566). The
    interpreter hands the callback converted arguments and runs the kernel with them: convert
    what the callback put in."""
    import torch

    def __init__(self, fn, arg_names, grid, *args, **kwargs):
        if callable(grid):
            callback = grid

            def grid(meta):
                result = callback(meta)
                for name, value in list(meta.items()):
                    if isinstance(value, torch.Tensor):
                        meta[name] = interpreter._implicit_cvt(value)
                return result
        original(self, fn, arg_names, grid, *args, **kwargs)

    __init__._linattn_original = original
    return __init__
