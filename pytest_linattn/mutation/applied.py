"""On a rank: one intercepted collective (`Call`: its op, arguments by name, group) and what
each mutation of the table (pytest_linattn.mutation.mutations) does to it: `APPLY[name](interceptor,
call)` returns what the op returns, the mutation applied. The interceptor
(pytest_linattn.mutation.rank) decides which call to mutate."""
from __future__ import annotations

import torch

from .mutations import MUTATIONS

__all__ = ["APPLY", "Call", "LazyWork"]

_C = torch._C._distributed_c10d


class Call:
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


def _wait(call: Call, result):
    """The op's result, waited for (eager: its Work; functional: wait_tensor)."""
    if call.eager:
        work = result[1] if isinstance(result, (tuple, list)) else result
        _C.Work.unbox(work).wait()
        return result
    return torch.ops._c10d_functional.wait_tensor(result)


def _eager_result(call: Call, value):
    """What the eager op returns, the Work already complete."""
    done = _completed_work(call.tensors)
    return done if call.name == "alltoall_base_" else (value, done)


class LazyWork(_C.Work):
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
