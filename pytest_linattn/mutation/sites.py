"""Where a collective was issued: the first frame outside torch, the standard library and this
package (its call site), and the line that called that code (its caller). Mutants and reports
name collectives by it (pytest_linattn.mutation.rank). A function registered with `hands_over`
(a check's hand-over of results to the test process) is named by its label and never mutated."""
from __future__ import annotations

import os
import sys
import sysconfig

import torch

__all__ = ["call_site", "hands_over", "is_handover"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
# Decorators torch wraps its entry points in (typing_extensions.deprecated): not a call site.
_WRAPPER_FILES = tuple(os.path.splitext(m.__file__)[0] for m in (
    sys.modules.get("typing_extensions"),) if m is not None and getattr(m, "__file__", None))
# code object -> label of each function registered with hands_over
_HANDOVERS: dict = {}
# The staged transport of ranks sharing a GPU: its inner gloo ops are the ones seen, called from there
_TRANSPORT_FILE = os.path.join(os.path.dirname(_OWN_DIR.rstrip(os.sep)), "ranks", "staged.py")


def hands_over(what: str):
    """Decorator: the function hands results over to the test process (`what` it hands over, for
    reports). Its collectives are part of the check, not of the code under test: recorded under
    the label "<name> (<what>: not mutated)", never mutated."""
    def register(fn):
        _HANDOVERS[fn.__code__] = f"{fn.__name__} ({what}: not mutated)"
        return fn
    return register


def is_handover(function: str) -> bool:
    """Whether `function`, as call_site names it, is a registered hand-over."""
    return function in _HANDOVERS.values()


def _shown_path(path: str) -> str:
    cwd = os.getcwd() + os.sep
    if path.startswith(cwd):
        return path[len(cwd):]
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def _outside(path: str) -> bool:
    return not (path.startswith((_TORCH_DIR, _OWN_DIR, _STDLIB_DIR, _TRANSPORT_FILE) + _WRAPPER_FILES)
                or path.startswith("<"))


def call_site(frame) -> tuple[str, str, str]:
    """(site ``path:line``, its function, the caller ``path:line function``): the first frame
    outside torch (and the standard library, and this package), and the next one outside them in
    another file or past torch's frames (a helper's caller, or the line that ran backward; ''
    when there is none)."""
    while frame is not None and not _outside(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?", "?", ""
    path = frame.f_code.co_filename
    handover = _HANDOVERS.get(frame.f_code)
    if handover is not None:
        return f"{_shown_path(path)}:{frame.f_lineno}", handover, ""
    site, function = f"{_shown_path(path)}:{frame.f_lineno}", frame.f_code.co_qualname
    caller, crossed = frame.f_back, False  # crossed: torch's frames lie between (autograd's apply, the engine)
    while caller is not None:
        name = caller.f_code.co_filename
        if _outside(name) and (name != path or crossed):
            break
        crossed = crossed or name.startswith(_TORCH_DIR)
        caller = caller.f_back
    where = "" if caller is None else (f"{_shown_path(caller.f_code.co_filename)}:{caller.f_lineno} "
                                       f"{caller.f_code.co_qualname}")
    return site, function, where
