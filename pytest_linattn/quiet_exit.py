"""A quiet interpreter exit after Triton left sys.modules: no `nanobind: leaked ...` screens.

pytester's in-process runs (`pytester.runpytest`, `inline_run`) put sys.modules back as it was
after each run, so a Triton first imported inside one (the plugin's autotune patch imports
`triton.runtime.autotuner`; a test file imports fla) is dropped from sys.modules while `typing`,
imported before, keeps references to it: its subscript caches (`typing._cleanups`: e.g.
`Optional[Allocator]`, `Generic[...]` of Triton's classes) and its `@overload` registry
(`typing._overload_registry`: `triton.jit`'s overloads). A module outside sys.modules is not
cleared by the interpreter's teardown, so Triton's classes, functions and, through them, its
nanobind objects (`triton._C.libtriton`) are still alive when nanobind checks for leaks at exit,
and it prints a screen of "leaked instances / types / functions" after pytest's summary.

Emptying those two caches at exit, before the interpreter's teardown, leaves the dropped modules
unreachable, and the teardown's own garbage collection frees them. Nothing is hidden: nanobind
still reports any object that something else keeps alive. Triton 3.9 exposes no
`set_leak_warnings` for its module, and an interpreter at its exit needs neither cache.
"""
from __future__ import annotations

import atexit

__all__ = ["clear_typing_caches"]


def clear_typing_caches() -> None:
    """Empty typing's module-level caches: its subscript caches and its `@overload` registry."""
    import typing

    for cache_clear in list(getattr(typing, "_cleanups", ())):
        cache_clear()
    registry = getattr(typing, "_overload_registry", None)  # Python 3.11+
    if registry is not None:
        registry.clear()


# Registered once, when the plugin is imported: atexit runs it before the interpreter's teardown.
atexit.register(clear_typing_caches)
