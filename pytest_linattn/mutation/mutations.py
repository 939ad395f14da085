"""The collective mutations, one table: what each does to a collective's result and the real bug
it stands for. Plain data; the code that applies them on a rank is `pytest_linattn.mutation.rank`.

A mutation applies to one kind of collective (`kind`, from `OP_KINDS`: the op a torch.distributed
entry point reaches at the dispatcher). `changes_calls`: it skips or repeats the collective, so
every rank of the group must apply it alike (the decision is keyed by the call site and the
per-rank count of calls there, the same on every rank of an SPMD program); the others let the
real collective run and change what it delivered, so a rank never waits for a peer that skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MUTATIONS", "Mutation", "NOT_COLLECTIVES", "OP_KINDS", "op_kind"]


@dataclass(frozen=True)
class Mutation:
    name: str
    kind: str  # the collective kind it applies to (a value of OP_KINDS)
    does: str  # what the mutant rank sees instead of the right result
    bug_class: str  # the real bug this stands for
    changes_calls: bool = False  # skips or repeats the call


MUTATIONS: dict[str, Mutation] = {m.name: m for m in (
    Mutation("all_reduce.skip", "all_reduce", "not reduced: each rank keeps its own partial value",
             "a missing reduction (a row-parallel partial sum, or a TP-replicated weight's gradient never "
             "summed: Megatron-LM #7452)", changes_calls=True),
    Mutation("all_reduce.twice", "all_reduce", "reduced twice: the sum summed again",
             "a double count (the layer and the trainer both reduce the same gradient)", changes_calls=True),
    Mutation("all_reduce.average", "all_reduce", "averaged instead of summed (SUM reductions only)",
             "a mean for a sum (a gradient or loss scaled by 1/group size)"),
    Mutation("all_gather.reversed", "all_gather", "the gathered chunks in reverse rank order",
             "a wrong rank order (a rank-to-chunk mapping inverted, a TP x CP layout transposed)"),
    Mutation("all_gather.own_chunk", "all_gather", "every gathered chunk is this rank's own",
             "a missing gather (a rank computes with its own shard only: the other ranks' tokens or heads lost)"),
    Mutation("reduce_scatter.unreduced", "reduce_scatter", "each rank keeps its own part of its own input, unsummed",
             "a missing reduction in a reduce-scatter (sequence parallel's partial sums never added)"),
    Mutation("all_to_all.rotated", "all_to_all", "the received chunks rotated by one (chunk i from rank i+1; "
             "equal splits only)", "a wrong relayout (heads or tokens sent to the wrong peer)"),
    Mutation("recv.zeroed", "recv", "the received buffer zeroed",
             "a missing halo or state (the message never arrived: a zero-initialised buffer used)"),
    Mutation("recv.stale", "recv", "the previous receive's data at the same call site (same shape; "
             "not the first receive there)", "a stale halo or state (a buffer not refreshed, last call's data reused)"),
    Mutation("broadcast.skip", "broadcast", "not broadcast: each rank keeps its own buffer",
             "a missing broadcast (ranks start from different weights or a different seed)",
             changes_calls=True),
)}

# (namespace, op name) at the dispatcher -> the kind of collective. Ops not here (send, barrier,
# the coalesced ops, wait_tensor) are recorded when they are collectives, never mutated.
OP_KINDS: dict[tuple[str, str], str] = {
    ("c10d", "allreduce_"): "all_reduce",
    ("_c10d_functional", "all_reduce"): "all_reduce",
    ("_c10d_functional", "all_reduce_"): "all_reduce",
    ("c10d", "_allgather_base_"): "all_gather",
    ("c10d", "allgather_"): "all_gather",
    ("_c10d_functional", "all_gather_into_tensor"): "all_gather",
    ("c10d", "_reduce_scatter_base_"): "reduce_scatter",
    ("c10d", "reduce_scatter_"): "reduce_scatter",
    ("_c10d_functional", "reduce_scatter_tensor"): "reduce_scatter",
    ("c10d", "alltoall_base_"): "all_to_all",
    ("c10d", "alltoall_"): "all_to_all",
    ("_c10d_functional", "all_to_all_single"): "all_to_all",
    ("c10d", "broadcast_"): "broadcast",
    ("_c10d_functional", "broadcast"): "broadcast",
    ("c10d", "recv_"): "recv",
    ("c10d", "recv_any_source_"): "recv",
}

# Ops of those namespaces that are bookkeeping, not communication: not recorded.
NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def op_kind(namespace: str, name: str) -> str | None:
    return OP_KINDS.get((namespace, name))
