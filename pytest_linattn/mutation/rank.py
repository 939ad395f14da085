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

from .mutations import MUTATIONS, NOT_COLLECTIVES, op_kind
from .sites import HANDOVER_FUNCTION, call_site

__all__ = ["CollectiveInterceptor", "HANDOVER_FUNCTION", "INTERCEPTORS", "InterceptingMode", "intercepting", "take_calls"]

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


class _Call:
    """One intercepted collective: the op, its arguments by name, its group."""

    def __init__(self, func, args, kwargs):
        self.func = func
        self.namespace = func.namespace
        self.name = func._schema.name.split("::", 1)[1]
        self.schema_names = [a.name for a in func._schema.arguments]
        self.bound = dict(zip(self.schema_names, args))
        self.bound.update(kwargs)
        self.eager = self.namespace == "c10d"
        self.size, self.rank = self._group()

    def _group(self) -> tuple[int, int]:
        if self.eager:
            pg = self.bound.get("process_group")
            if pg is None:
                return 1, 0
            pg = _C.ProcessGroup.unbox(pg)
        else:
            from torch.distributed.distributed_c10d import _resolve_process_group

            name = self.bound.get("group_name")
            if name is None:
                return 1, 0
            pg = _resolve_process_group(name)
        return pg.size(), pg.rank()

    def run(self, **replace):
        """The real op, with some arguments replaced."""
        bound = {**self.bound, **replace}
        args = []
        for name in self.schema_names:
            if name not in bound:
                break
            args.append(bound[name])
        return self.func(*args)

    @property
    def tensors(self) -> list:
        """The buffers an eager op fills in place (flattened)."""
        b = self.bound
        for key in ("tensors", "output_tensor", "output", "output_tensors"):
            if key in b:
                value = b[key]
                if isinstance(value, torch.Tensor):
                    return [value]
                return [t for v in value for t in (v if isinstance(v, (list, tuple)) else [v])]
        return []

    def is_sum(self) -> bool:
        op = self.bound.get("reduce_op")
        if op is None:
            return True  # the op's default
        if isinstance(op, str):
            return op.lower() == "sum"
        try:
            return int(op.op()) == int(torch.distributed.ReduceOp.SUM)
        except Exception:  # noqa: BLE001 - a reduce op this torch boxes otherwise: not a SUM we know
            return False

    def equal_splits(self) -> bool:
        if self.name == "alltoall_":
            shapes = {tuple(t.shape) for t in self.bound["output_tensors"]} | {
                tuple(t.shape) for t in self.bound["input_tensors"]}
            return len(shapes) == 1
        out = self.bound.get("output_split_sizes") or []
        inp = self.bound.get("input_split_sizes") or []
        if not out and not inp:
            source = self.bound.get("output", self.bound.get("input"))
            return source is not None and source.shape[0] % self.size == 0
        return len(set(out)) <= 1 and len(set(inp)) <= 1


def _completed_work(value):
    # A finished Work whose future holds the tensors: DDP's reducer reads the future.
    fut = torch.futures.Future()
    fut.set_result(value)
    return _C.Work.boxed(_C._create_work_from_future(fut))


def _wait(call: _Call, result):
    """The op's result, waited for (eager: its Work; functional: wait_tensor)."""
    if call.eager:
        work = result[1] if isinstance(result, (tuple, list)) else result
        _C.Work.unbox(work).wait()
        return result
    return torch.ops._c10d_functional.wait_tensor(result)


def _eager_result(call: _Call, value):
    """What the eager op returns, the Work already complete."""
    done = _completed_work(call.tensors)
    return done if call.name == "alltoall_base_" else (value, done)


class _LazyWork(_C.Work):
    """A receive's Work that changes the buffer once the data is in (at wait): a receive is
    often posted before the matching send, so waiting for it inside the op could deadlock."""

    def __init__(self, inner, after):
        super().__init__()
        self.inner, self.after, self.done = inner, after, False

    def wait(self, timeout=None):
        self.inner.wait() if timeout is None else self.inner.wait(timeout)
        if not self.done:
            self.done = True
            self.after()
        return True

    def is_completed(self):
        return self.done


def _rotate(chunks):
    chunks = [c.clone() for c in chunks]
    return chunks[1:] + chunks[:1]


# -- the mutations: (interceptor, call) -> the op's result


def _all_reduce_skip(mode, call):
    if call.eager:
        return _eager_result(call, call.bound["tensors"])
    return call.bound["input"] if call.name == "all_reduce_" else call.bound["input"].clone()


def _all_reduce_twice(mode, call):
    first = _wait(call, call.run())
    if call.eager or call.name == "all_reduce_":
        return call.run()
    return call.run(input=first)


def _all_reduce_average(mode, call):
    out = _wait(call, call.run())
    if call.eager:
        for t in call.tensors:
            t.div_(call.size)
        return _eager_result(call, call.bound["tensors"])
    return out.div_(call.size) if call.name == "all_reduce_" else out / call.size


def _all_gather_reversed(mode, call):
    out = _wait(call, call.run())
    n = call.size
    if not call.eager:
        return torch.cat(list(reversed(out.chunk(n))))
    if call.name == "_allgather_base_":
        o = call.bound["output_tensor"]
        o.copy_(torch.cat(list(reversed(o.chunk(n)))).view_as(o))
        return _eager_result(call, o)
    for chunks in call.bound["output_tensors"]:
        values = [t.clone() for t in chunks]
        for t, v in zip(chunks, reversed(values)):
            t.copy_(v)
    return _eager_result(call, call.bound["output_tensors"])


def _all_gather_own_chunk(mode, call):
    out = _wait(call, call.run())
    n = call.size
    if not call.eager:
        own = call.bound["input"]
        return torch.cat([own.reshape(c.shape) for c in out.chunk(n)])
    if call.name == "_allgather_base_":
        o, own = call.bound["output_tensor"], call.bound["input_tensor"]
        for c in o.chunk(n):
            c.copy_(own.reshape(c.shape))
        return _eager_result(call, o)
    for chunks, own in zip(call.bound["output_tensors"], call.bound["input_tensors"]):
        for t in chunks:
            t.copy_(own)
    return _eager_result(call, call.bound["output_tensors"])


def _reduce_scatter_unreduced(mode, call):
    _wait(call, call.run())
    n, r = call.size, call.rank
    if not call.eager:
        return call.bound["input"].chunk(n)[r].clone()
    if call.name == "_reduce_scatter_base_":
        o = call.bound["output_tensor"]
        o.copy_(call.bound["input_tensor"].chunk(n)[r].reshape(o.shape))
        return _eager_result(call, o)
    for o, parts in zip(call.bound["output_tensors"], call.bound["input_tensors"]):
        o.copy_(parts[r])
    return _eager_result(call, call.bound["output_tensors"])


def _all_to_all_rotated(mode, call):
    out = _wait(call, call.run())
    n = call.size
    if not call.eager:
        return torch.cat(_rotate(out.chunk(n)))
    if call.name == "alltoall_base_":
        o = call.bound["output"]
        o.copy_(torch.cat(_rotate(o.chunk(n))))
        return _eager_result(call, o)
    outs = call.bound["output_tensors"]
    for t, v in zip(outs, _rotate(outs)):
        t.copy_(v)
    return _eager_result(call, outs)


def _recv_zeroed(mode, call):
    tensors = call.tensors
    return mode.lazy(call.run(), lambda: [t.zero_() for t in tensors])


def _recv_stale(mode, call):
    tensors, previous = call.tensors, mode.previous_recv
    return mode.lazy(call.run(), lambda: [t.copy_(p) for t, p in zip(tensors, previous)])


def _broadcast_skip(mode, call):
    if call.eager:
        return _eager_result(call, call.bound["tensors"])
    return call.bound["input"].clone()


APPLY = {
    "all_reduce.skip": _all_reduce_skip, "all_reduce.twice": _all_reduce_twice,
    "all_reduce.average": _all_reduce_average, "all_gather.reversed": _all_gather_reversed,
    "all_gather.own_chunk": _all_gather_own_chunk, "reduce_scatter.unreduced": _reduce_scatter_unreduced,
    "all_to_all.rotated": _all_to_all_rotated, "recv.zeroed": _recv_zeroed, "recv.stale": _recv_stale,
    "broadcast.skip": _broadcast_skip,
}
assert set(APPLY) == set(MUTATIONS), "every mutation in the table has its code here"


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
        lazy = _LazyWork(_C.Work.unbox(work), after)
        self.keep.append(lazy)
        return _C.Work.boxed(lazy)

    def intercept(self, func, args, kwargs, frame):
        """Run the collective `func` (called from `frame`), recorded, maybe mutated."""
        call = _Call(func, args, kwargs)
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
            "mutations": [] if function == HANDOVER_FUNCTION else self._applicable(call, kind, key, occurrence),
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
