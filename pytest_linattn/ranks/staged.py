"""The staged transport: a process group for ranks that share a GPU. A test transport.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"; NCCL < 2.30
has no way around it), and gloo's own CUDA paths abort on send/recv and crash on the coalesced
all-gather that functional collectives and DTensor use (pytorch #152645). `StagedGroup` is a
`torch.distributed.ProcessGroup` registered as backend "staged": every op copies its tensors to
host memory, runs on an inner CPU gloo group and copies the results back. So several ranks can run
a layer's real CUDA kernels on one GPU and still talk through every torch.distributed entry point:
eager collectives, send/recv and batch_isend_irecv, the coalescing manager, functional
collectives and DTensor. What it does not test: NCCL itself, overlap of communication with
compute (every collective completes where it is issued), CUDA graph capture (a host copy cannot
be captured). Results equal NCCL's up to the order of a sum.

The inner group is a ProcessGroup with a gloo backend, so its calls pass torch's dispatcher
(`c10d::allreduce_`, ...), where tools that watch collectives see them. On CPU tensors the
staging copies too, so the CPU tests exercise the same code. An op the transport cannot carry
raises NotImplementedError naming it.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed import distributed_c10d as c10d

__all__ = ["BACKEND", "StagedGroup", "register"]

BACKEND = "staged"
_SUM, _AVG, _PREMUL_SUM = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM
# gloo carries no float8: moved as bytes, never reduced
_BYTE_MOVED = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))


def register() -> None:
    """Make backend "staged" known to torch.distributed (idempotent): `init_process_group("staged")`,
    `new_group(backend="staged")`; a default group of it makes every `new_group()` staged too."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _create(store, rank, size, timeout):
    return StagedGroup(store, rank, size, timeout)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of t, always a new buffer (so the copy back is the same on every device)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _wire(h: torch.Tensor) -> torch.Tensor:
    """What gloo moves for a host tensor: its bytes where gloo has no such dtype."""
    return h.view(torch.uint8) if h.dtype in _BYTE_MOVED else h


def _copy_back(devices, hosts) -> None:
    for d, h in zip(devices, hosts):
        d.copy_(h)


def _done(result) -> dist.Work:
    """A finished Work whose future holds `result` (DDP's communication hook reads it)."""
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _Deferred(dist._Work):
    """A point-to-point op's Work: the inner gloo op completes in wait(), then the received tensors
    are copied back. (Completing at issue deadlocks a ring: every rank sends first.)"""

    def __init__(self, inner, finish=None, result=None, any_source=False):
        super().__init__()
        self._inner, self._finish, self._result = inner, finish, result
        self._any_source, self._source = any_source, None
        self._future = None

    def wait(self, timeout=None):
        if self._inner is not None:
            self._inner.wait()
            if self._any_source:
                self._source = self._inner._source_rank()
            if self._finish is not None:
                self._finish()
            self._inner = self._finish = None
        return True

    def is_completed(self):
        return self._inner is None

    def _source_rank(self):  # recv from any source: who sent
        self.wait()
        return self._source

    def get_future(self):
        self.wait()
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._result)
        return self._future


def _each_pair(op, outputs, inputs, opts) -> dist.Work:
    """A coalesced op as its single op on each (output, input) pair, one after another."""
    for output, input in zip(outputs, inputs):
        op(output, input, opts)
    return _done(outputs)


def _options(opts, kind):
    return kind() if opts is None else opts


class StagedGroup(dist.ProcessGroup):
    """A process group whose ops stage every tensor through host memory and run on CPU gloo."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name = self._desc = ""
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("staged-gloo/", store), rank, size, timeout)
        self._inner = dist.ProcessGroup(store, rank, size)
        self._inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)

    # -- identity (functional collectives and DTensor find a group by its name)

    def getBackendName(self):
        return BACKEND

    def setGroupName(self, name):
        self._name = name
        self._inner._set_group_name(f"{name}:staged-gloo")

    def getGroupName(self):
        return self._name

    def setGroupDesc(self, desc):
        self._desc = desc

    def getGroupDesc(self):
        return self._desc

    def __repr__(self):
        return f"StagedGroup(rank={self._rank}, size={self._size}, name={self._name!r})"

    # -- reductions

    def _sum_op(self, op_name: str, reduce_op, tensors) -> bool:
        """Whether the op is AVG (done as SUM, then divided); raises for what gloo cannot reduce."""
        if reduce_op == _PREMUL_SUM:
            raise NotImplementedError(f"staged transport: {op_name} with ReduceOp.PREMUL_SUM: gloo has no "
                                      f"pre-multiplied sum")
        for t in tensors:
            if t.dtype in _BYTE_MOVED:
                raise NotImplementedError(f"staged transport: {op_name} of {t.dtype}: gloo cannot reduce float8")
        avg = reduce_op == _AVG
        if avg and any(not (t.is_floating_point() or t.is_complex()) for t in tensors):
            raise NotImplementedError(f"staged transport: {op_name} with ReduceOp.AVG of an integer tensor")
        return avg

    def _allreduce_hosts(self, op_name, hosts, reduce_op, timeout=None):
        avg = self._sum_op(op_name, reduce_op, hosts)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = _SUM if avg else reduce_op
        if timeout is not None:
            opts.timeout = timeout
        self._inner.allreduce(hosts, opts).wait()
        if avg:
            for h in hosts:
                h.div_(self._size)

    def allreduce(self, tensors, opts=None):
        opts = _options(opts, c10d.AllreduceOptions)
        hosts = [_host(t) for t in tensors]
        self._allreduce_hosts("all_reduce", hosts, opts.reduceOp, opts.timeout)
        _copy_back(tensors, hosts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = _options(opts, c10d.AllreduceCoalescedOptions)
        hosts = [_host(t) for t in tensors]
        for h in hosts:
            self._allreduce_hosts("all_reduce_coalesced", [h], opts.reduceOp, opts.timeout)
        _copy_back(tensors, hosts)
        return _done(tensors)

    def reduce(self, tensors, opts=None):
        opts = _options(opts, c10d.ReduceOptions)
        avg = self._sum_op("reduce", opts.reduceOp, tensors)
        hosts = [_host(t) for t in tensors]
        inner = c10d.ReduceOptions()
        inner.reduceOp = _SUM if avg else opts.reduceOp
        inner.rootRank, inner.rootTensor = opts.rootRank, opts.rootTensor
        self._inner.reduce(hosts, inner).wait()
        if self._rank == opts.rootRank:
            if avg:
                hosts[opts.rootTensor].div_(self._size)
            _copy_back(tensors, hosts)
        return _done(tensors)

    def _reduce_scatter_hosts(self, op_name, out, inp, reduce_op):
        # an all-reduce of the whole input, then this rank's part: gloo's own reduce-scatter
        # ignored the reduce op in some torch versions
        whole = _host(inp)
        self._allreduce_hosts(op_name, [whole], reduce_op)
        part = whole.reshape(self._size, -1)[self._rank]
        out.copy_(part.reshape(out.shape))

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = _options(opts, c10d.ReduceScatterOptions)
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"staged transport: reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"expected output's {output.numel()} x {self._size} ranks")
        self._reduce_scatter_hosts("reduce_scatter_tensor", output, input, opts.reduceOp)
        return _done([output])

    reduce_scatter_single = _reduce_scatter_base  # torch >= 2.13's name

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return _each_pair(self._reduce_scatter_base, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = _options(opts, c10d.ReduceScatterOptions)
        for output, inputs in zip(output_tensors, input_tensors):
            if len(inputs) != self._size or any(i.numel() != output.numel() for i in inputs):
                raise ValueError(f"staged transport: reduce_scatter: needs {self._size} inputs of the output's "
                                 f"{output.numel()} elements each")
            flat = torch.cat([i.reshape(-1) for i in inputs])
            self._reduce_scatter_hosts("reduce_scatter", output, flat, opts.reduceOp)
        return _done(output_tensors)

    # -- data movement

    def broadcast(self, tensors, opts=None):
        opts = _options(opts, c10d.BroadcastOptions)
        hosts = [_host(t) for t in tensors]
        self._inner.broadcast([_wire(h) for h in hosts], opts).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    def _into_lists(self, inner_op, output_tensors, input_tensors, opts):
        """all_gather and gather: each input staged, gathered into host lists, copied back."""
        ins = [_host(t) for t in input_tensors]
        outs = [[_host_like(o) for o in outputs] for outputs in output_tensors]
        inner_op([[_wire(o) for o in outputs] for outputs in outs], [_wire(i) for i in ins], opts).wait()
        for outputs, hosts in zip(output_tensors, outs):
            _copy_back(outputs, hosts)
        return _done(output_tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._into_lists(self._inner.allgather, output_tensors, input_tensors,
                                _options(opts, c10d.AllgatherOptions))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output, input, opts=None):
        opts = _options(opts, c10d.AllgatherOptions)
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"staged transport: all_gather_into_tensor: output has {output.numel()} elements, "
                             f"expected input's {input.numel()} x {self._size} ranks")
        out, inp = _host_like(output), _host(input)
        # flat: NCCL takes any shapes of matching sizes (fla's CP gathers [1, n, d] into [W, n, d]),
        # gloo wants the output in chunks of the input's shape
        self._inner._allgather_base(_wire(out).reshape(-1), _wire(inp).reshape(-1), opts).wait()
        output.copy_(out)
        return _done([output])

    all_gather_single = _allgather_base  # torch >= 2.13's name

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return _each_pair(self._allgather_base, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = _options(opts, c10d.AllToAllOptions)
        out, inp = _host_like(output), _host(input)
        self._inner.alltoall_base(_wire(out), _wire(inp), list(output_split_sizes), list(input_split_sizes),
                                  opts).wait()
        output.copy_(out)
        return _done([output])

    all_to_all_single = alltoall_base  # torch >= 2.13's name

    def alltoall(self, output_tensors, input_tensors, opts=None):
        # the list form as one all_to_all_single of the flattened tensors (gloo lacks it in 2.11)
        if len({t.dtype for t in (*output_tensors, *input_tensors)}) > 1:
            raise NotImplementedError("staged transport: all_to_all of tensors of different dtypes")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype, device=flat_in.device)
        self.alltoall_base(flat_out, flat_in, [t.numel() for t in output_tensors],
                           [t.numel() for t in input_tensors], opts)
        for t, part in zip(output_tensors, flat_out.split([t.numel() for t in output_tensors])):
            t.copy_(part.reshape(t.shape))
        return _done(output_tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        return self._into_lists(self._inner.gather, output_tensors, input_tensors, _options(opts, c10d.GatherOptions))

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = _options(opts, c10d.ScatterOptions)
        outs = [_host_like(o) for o in output_tensors]
        ins = [[_host(i) for i in inputs] for inputs in input_tensors]
        self._inner.scatter([_wire(o) for o in outs], [[_wire(i) for i in inputs] for inputs in ins], opts).wait()
        _copy_back(output_tensors, outs)
        return _done(output_tensors)

    def barrier(self, opts=None):
        self._inner.barrier(c10d.BarrierOptions()).wait()
        return _done([])

    # -- point to point: completed in wait()

    def send(self, tensors, dst, tag=0):
        hosts = [_host(t) for t in tensors]  # the data as it is now, as NCCL would send it
        return _Deferred(self._inner.send([_wire(h) for h in hosts], dst, tag), result=tensors)

    def recv(self, tensors, src, tag=0):
        hosts = [_host_like(t) for t in tensors]
        return _Deferred(self._inner.recv([_wire(h) for h in hosts], src, tag),
                         finish=lambda: _copy_back(tensors, hosts), result=tensors)

    def recv_anysource(self, tensors, tag=0):
        hosts = [_host_like(t) for t in tensors]
        return _Deferred(self._inner.recv_anysource([_wire(h) for h in hosts], tag),
                         finish=lambda: _copy_back(tensors, hosts), result=tensors, any_source=True)

    # -- the coalescing manager's old style: every op completes where it is issued

    def _start_coalescing(self, device):
        pass

    def _end_coalescing(self, device):
        return _done([])
