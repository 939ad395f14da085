"""The switch behind `fla_on_cpu`: swap fla's public entry points for the emulation and back.

Each emulation module (gated_delta_rule, kda, conv, norm, cp, ...) declares ``PATCHES``: a dict from
``"fla.module.path:name"`` (a function) or ``"fla.module.path:Class.method"`` (a method) to its
replacement. Swapping the attribute where fla defines it is not enough: ``from fla.ops.kda
import chunk_kda`` in fla's layers, in transformers or in a user's module binds the function
object at import time, and transformers keeps it in a closure. So while active, every module in
``sys.modules`` that holds an original (as a global, or in the closure of one of its functions)
holds the replacement instead; on exit every such place, including those of modules imported
while active, gets the original back.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

FLA_VERSION = "0.6.0"
EMULATION_MODULES = ("gated_delta_rule", "kda", "delta_product", "dplr", "rwkv7", "gdn2", "precond", "serving",
                     "conv", "norm", "cp")
COMPUTE_DTYPES = (torch.float64, torch.float32)

_active: list[torch.dtype] = []  # one entry per nested activation
_INHERITED = object()  # a patched method the class did not define itself


def active_compute_dtype() -> torch.dtype | None:
    """The compute dtype of the active emulation, or None when it is off."""
    return _active[-1] if _active else None


def compute_dtype() -> torch.dtype:
    """What the emulated ops compute in: the active emulation's dtype, float64 when off (direct calls)."""
    return _active[-1] if _active else torch.float64


def patch_table() -> dict[str, object]:
    table = {}
    for name in EMULATION_MODULES:
        table.update(importlib.import_module(f"linattn.emulation.{name}").PATCHES)
    return table


def _import_fla():
    try:
        import fla
    except ImportError as exc:
        raise ImportError(
            f"fla_on_cpu needs fla installed (pip install 'flash-linear-attention=={FLA_VERSION}' "
            f"'fla-core=={FLA_VERSION}' triton): {exc}"
        ) from exc
    version = getattr(fla, "__version__", None)
    if version != FLA_VERSION:
        raise ImportError(f"fla_on_cpu emulates fla {FLA_VERSION}, found fla {version}")
    return fla


def _owner_and_attr(key: str):
    module_name, _, qualname = key.partition(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _closure_cells(fn, depth: int = 3):
    """Cells of fn's closure and of the functions it wraps (functools.wraps' __wrapped__)."""
    seen = set()
    stack = [(fn, 0)]
    while stack:
        f, d = stack.pop()
        if id(f) in seen or d > depth:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            yield cell
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(inner, types.FunctionType):
                stack.append((inner, d + 1))
        wrapped = getattr(f, "__wrapped__", None)
        if isinstance(wrapped, types.FunctionType):
            stack.append((wrapped, d + 1))


def _rebind(mapping: dict[int, tuple[object, object]]) -> list:
    """Replace, in every loaded module, each global or closure cell holding a key object of
    `mapping` (id -> (old, new)) by the new one. Returns undo records."""
    undo, get, function = [], mapping.get, types.FunctionType
    for name, module in list(sys.modules.items()):
        if name.startswith(__package__ + "."):
            continue  # the emulation's own modules keep their names bound to the emulation
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for name, value in list(namespace.items()):
            hit = get(id(value))
            if hit is not None and hit[0] is value:
                namespace[name] = hit[1]
                undo.append((namespace, name, value))
            # type(), not isinstance: no __class__ lookups on proxies; most functions have neither a
            # closure nor a __wrapped__ (nothing for _closure_cells to walk): skipped without a generator
            elif type(value) is function and (value.__closure__ is not None or hasattr(value, "__wrapped__")):
                for cell in _closure_cells(value):
                    try:
                        inner = cell.cell_contents
                    except ValueError:
                        continue
                    hit = mapping.get(id(inner))
                    if hit is not None and hit[0] is inner:
                        cell.cell_contents = hit[1]
                        undo.append((cell, None, inner))
    return undo


def _undo(records) -> None:
    for place, name, value in reversed(records):
        if name is None:
            place.cell_contents = value
        else:
            place[name] = value


@contextlib.contextmanager
def fla_on_cpu(compute_dtype: torch.dtype = torch.float64):
    """While active, fla's public linear-attention ops compute with linattn's references.

    compute_dtype: torch.float64 (default) or torch.float32. Outputs come back in the input's
    dtype, as fla returns them. Nested activations must use the same compute dtype.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be torch.float64 or torch.float32, got {compute_dtype!r}")
    if _active:
        if _active[-1] != compute_dtype:
            raise ValueError(f"compute_dtype must match the active fla_on_cpu's {_active[-1]} when nested, got {compute_dtype}")
        _active.append(compute_dtype)
        try:
            yield
        finally:
            _active.pop()
        return
    _import_fla()
    swaps = []  # (owner, attr, original, replacement)
    for key, replacement in patch_table().items():
        owner, attr = _owner_and_attr(key)
        # a class's own entry (not an inherited one, and staticmethods unwrapped by nothing)
        original = owner.__dict__.get(attr, _INHERITED) if isinstance(owner, type) else getattr(owner, attr)
        swaps.append((owner, attr, original, replacement))
    for owner, attr, _, replacement in swaps:
        setattr(owner, attr, replacement)
    forward = {id(orig): (orig, new) for owner, _, orig, new in swaps if not isinstance(owner, type)}
    undo = _rebind(forward)
    _active.append(compute_dtype)
    try:
        yield
    finally:
        _active.pop()
        _undo(undo)
        for owner, attr, original, _ in swaps:
            if original is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        # modules imported while active bound the replacements: give them the originals
        _rebind({id(new): (new, orig) for owner, _, orig, new in swaps if not isinstance(owner, type)})


def refuse(function: str, argument: str, value, why: str = "is not emulated") -> None:
    """Raise NotImplementedError for an argument value the emulation does not implement."""
    raise NotImplementedError(f"fla_on_cpu: {function}({argument}={value!r}) {why}")


def check_packing(function: str, x: torch.Tensor, cu_seqlens, name: str = "x") -> None:
    """ValueError unless `cu_seqlens` packs `x` `[1, T, ...]`: cu_seqlens[-1] == T (fla's varlen
    layout: every sequence on the token dim of one batch row). None packs nothing: no check."""
    if cu_seqlens is None:
        return
    T = x.shape[1]
    end = int(cu_seqlens[-1])
    if x.shape[0] != 1:
        raise ValueError(f"fla_on_cpu: {function}: cu_seqlens needs {name} packed as one batch row [1, T, ...], "
                         f"got {name} of shape {tuple(x.shape)}")
    if end != T:
        raise ValueError(f"fla_on_cpu: {function}: cu_seqlens[-1] = {end} must equal T = {T}, the token count of "
                         f"{name} {tuple(x.shape)} (cu_seqlens = {cu_seqlens.tolist()})")
