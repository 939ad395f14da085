"""On a rank: the interceptor that sees every collective a call of fn issues, records each one
(op, group size, call site, forward or backward) and applies at most one mutant.

Every torch.distributed entry point reaches the dispatcher as an op of the ``c10d`` (eager:
`dist.all_reduce`, DDP's reducer, autograd functions that reduce in backward) or
``_c10d_functional`` (functional collectives, DTensor) namespace, so an interceptor of those ops
sees them whoever calls them, aliases bound at import included. Two interceptors do it:

- a TorchDispatchMode, which sees every op issued below autograd, collectives included, at the
  cost of a Python call for every op the ranks run (about doubling a small layer's step);
- kernels of this module registered at the Autograd key of the collective ops only (the
  ``library``), which cost nothing for the other ops but would miss a collective issued where
  autograd is already excluded (inside another op's kernel).

A test's clean run records with both and compares what they saw, spawn call by spawn call; its
mutant reruns use the library alone where it saw every call the mode saw, the mode elsewhere.

The mutant is named by its call site, op and occurrence (the per-rank count of calls of that op
at that site in this call of fn): the same on every rank of an SPMD program, so the ranks never
disagree on what to do. The worker (pytest_linattn.ranks.worker) enters `intercepting(plan)`
around fn and sends `take_calls()` back with the reply.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .applied import APPLY, Call, LazyWork
from .mutations import MUTATIONS, NOT_COLLECTIVES, op_kind
from .sites import call_site, is_handover

__all__ = ["CollectiveInterceptor", "INTERCEPTORS", "InterceptingMode", "intercepting", "take_calls"]

NAMESPACES = ("c10d", "_c10d_functional")
# plan["interceptor"]: "both" (a clean run: record with each, compare), "library", "mode"
INTERCEPTORS = ("both", "library", "mode")
_C = torch._C._distributed_c10d
_LAST_CALLS: list[dict] | None = None  # the calls of the last intercepted call of fn on this rank


@contextlib.contextmanager
def intercepting(plan: dict):
    """Record every collective of the block; `plan["target"]`: None, or the mutant to apply,
    ``{"site", "op", "occurrence", "mutation"}`` (as a recorded call names them);
    `plan["interceptor"]`: which interceptor records and applies it (INTERCEPTORS; "both" by
    default, which records with each and applies nothing)."""
    global _LAST_CALLS
    kind = plan.get("interceptor", "both")
    if kind not in INTERCEPTORS:
        raise ValueError(f"plan['interceptor'] must be one of {INTERCEPTORS}, got {kind!r}")
    target = plan.get("target")
    if kind == "both" and target is not None:
        raise ValueError("plan['interceptor'] 'both' records only: a mutant needs 'library' or 'mode'")
    library = CollectiveInterceptor(target) if kind != "mode" else None
    mode = InterceptingMode(CollectiveInterceptor(target)) if kind != "library" else None
    with contextlib.ExitStack() as stack:
        if library is not None:
            stack.enter_context(_library_active(library))
        if mode is not None:
            stack.enter_context(mode)
        try:
            yield library if mode is None else mode.interceptor
        finally:
            if mode is None:
                _LAST_CALLS = library.calls
            else:
                _LAST_CALLS = mode.interceptor.calls
                if library is not None:  # the clean run: does the library alone see every call?
                    seen_alike = _signature(library.calls) == _signature(_LAST_CALLS)
                    for rec in _LAST_CALLS:
                        rec["library_sees_all"] = seen_alike
            for interceptor in (library, mode and mode.interceptor):
                if interceptor is not None:
                    interceptor.keep.clear()


def _signature(calls: list[dict]) -> list[tuple]:
    return [(c["site"], c["op"], c["occurrence"], c["phase"], c["group_size"], tuple(c["mutations"])) for c in calls]


def take_calls() -> list[dict] | None:
    """The calls recorded by the last `intercepting` block (None if none ran since the last take)."""
    global _LAST_CALLS
    calls, _LAST_CALLS = _LAST_CALLS, None
    return calls


# -- the library: kernels of this module at the Autograd key of every collective op (at
# ADInplaceOrView, just below it, for the ops torch gives an autograd kernel of their own, which
# must stay theirs), registered once per process; each passes the call on below its key.

_LIBRARY_ACTIVE = None  # the CollectiveInterceptor the library kernels hand calls to, or None
_LIBRARIES: list = []
_BELOW = {"Autograd": torch._C._after_autograd_keyset, "ADInplaceOrView": torch._C._after_ADInplaceOrView_keyset}


class _Nesting(threading.local):
    depth = 0  # > 0 while this thread runs an intercepted collective (the ops it issues pass)


_NESTING = _Nesting()


@contextlib.contextmanager
def _library_active(interceptor):
    global _LIBRARY_ACTIVE
    _register_library()
    outer, _LIBRARY_ACTIVE = _LIBRARY_ACTIVE, interceptor
    try:
        yield
    finally:
        _LIBRARY_ACTIVE = outer


def _register_library() -> None:
    if _LIBRARIES:
        return
    # torch registers the functional collectives' autograd kernels in Python when this module is
    # first imported (Dynamo imports it too); a kernel of ours registered before would make that
    # import fail, and which key each op takes depends on them
    import torch.distributed._functional_collectives  # noqa: F401

    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for namespace in NAMESPACES:
        library = torch.library.Library(namespace, "IMPL")
        for qualified in torch._C._dispatch_get_all_op_names():
            ns, _, name = qualified.partition("::")
            base, _, overload = name.partition(".")
            if ns != namespace or base in NOT_COLLECTIVES:
                continue
            key = "ADInplaceOrView" if has_kernel(qualified, "Autograd") else "Autograd"
            if has_kernel(qualified, key):
                continue  # never replace torch's kernel: the library does not see this op (the mode does)
            op = getattr(getattr(getattr(torch.ops, ns), base), overload or "default")
            library.impl(name, functools.partial(_library_kernel, op, _BELOW[key]), key, with_keyset=True)
        _LIBRARIES.append(library)


def _library_kernel(op, below, keyset, *args, **kwargs):
    interceptor = _LIBRARY_ACTIVE
    if interceptor is None or _NESTING.depth:
        return op.redispatch(keyset & below, *args, **kwargs)
    _NESTING.depth += 1
    try:
        return interceptor.intercept(op, args, kwargs, sys._getframe(1))
    finally:
        _NESTING.depth -= 1




@functools.lru_cache(maxsize=None)
def _is_collective(func) -> bool:
    return func.namespace in NAMESPACES and func._schema.name.split("::", 1)[1] not in NOT_COLLECTIVES


class CollectiveInterceptor:
    """Records each collective handed to `intercept` and applies `target` (None: record only)."""

    def __init__(self, target: dict | None = None):
        self.target = target
        self.calls: list[dict] = []
        self.counts: dict[tuple, int] = {}
        self.recv_shapes: dict[tuple, list] = {}  # (site, op) -> shapes of the last receive there
        self.previous_recv: list = []  # a copy of the last receive's data, for recv.stale
        self.keep: list = []  # the Python Works handed out (alive while the call runs)

    def lazy(self, work, after):
        lazy = LazyWork(_C.Work.unbox(work), after)
        self.keep.append(lazy)
        return _C.Work.boxed(lazy)

    def intercept(self, func, args, kwargs, frame):
        """Run the collective `func` (called from `frame`), recorded, maybe mutated."""
        call = Call(func, args, kwargs)
        site, function, caller = call_site(frame)
        op = f"{call.namespace}.{call.name}"
        key = (site, op)
        occurrence = self.counts.get(key, 0)
        self.counts[key] = occurrence + 1
        kind = op_kind(call.namespace, call.name)
        self.calls.append({
            "op": op, "kind": kind, "site": site, "function": function, "caller": caller,
            "phase": "backward" if torch._C._current_graph_task_id() != -1 else "forward",
            "group_size": call.size, "occurrence": occurrence,
            "mutations": [] if is_handover(function) else self._applicable(call, kind, key, occurrence),
        })
        t = self.target
        mutation = None
        if t is not None and t["site"] == site and t["op"] == op:
            if t["occurrence"] == occurrence:
                mutation = t["mutation"]
            elif t["mutation"] == "recv.stale" and t["occurrence"] == occurrence + 1:
                tensors, store = call.tensors, self.previous_recv
                return self.lazy(func(*args, **kwargs), lambda: store.extend(x.clone() for x in tensors))
        if mutation is None:
            return func(*args, **kwargs)
        self.calls[-1]["mutated"] = True
        return APPLY[mutation](self, call)

    def _applicable(self, call, kind, key, occurrence) -> list[str]:
        if kind == "recv":
            shapes = [tuple(t.shape) for t in call.tensors]
            same = occurrence >= 1 and self.recv_shapes.get(key) == shapes
            self.recv_shapes[key] = shapes
            return ["recv.zeroed"] + (["recv.stale"] if same else [])
        if kind is None or call.size <= 1:
            return []
        names = [m.name for m in MUTATIONS.values() if m.kind == kind]
        if kind == "all_reduce":
            floating = all(t.is_floating_point() or t.is_complex() for t in (
                call.tensors if call.eager else [call.bound["input"]]))
            if not (call.is_sum() and floating):
                names.remove("all_reduce.average")
        if kind == "all_to_all" and not call.equal_splits():
            names.remove("all_to_all.rotated")
        return names


class InterceptingMode(TorchDispatchMode):
    """The mode: every op of the ranks passes here; the collectives go to its interceptor."""

    def __init__(self, interceptor: CollectiveInterceptor):
        super().__init__()
        self.interceptor = interceptor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_collective(func):  # one cached lookup
            return func(*args, **kwargs)
        return self.interceptor.intercept(func, args, kwargs, sys._getframe(1))
