"""The state-pool check's serving options beyond one prefill and one decode call per step
(`pytest_linattn.harness.state_pool`): their rules and the checks that refuse a plan they would
not exercise. This module imports no pytest.

Block tables (`StatePoolPath.block_tables`, prefix mode): an engine whose layer maps token counts
to blocks itself (vLLM's align mode: the state of a prefix of c tokens in block (c - 1) //
block_size of the sequence's block table). The prefill gets, instead of `prefix_slots`,
`block_table` `[N, M]` int64 (for a prefix hit's first chunk the slots of the blocks its layer
group has cached, the snapshot of the other sequence at block boundary (k + 1) * block_size in
column k, -1 where none was taken or for a sequence that continues from its own slot; rows padded
with -1) and `num_computed_tokens` `[N]` int64 (the sequence's tokens before the chunk: where the
engine resumes). It still gets `snapshot_slots`: where its chunk-end state goes.

Per-group hit lengths (`group_hits={n: tokens}`, block tables only): an engine with several layer
groups (attention, the recurrent one under test) finds a prefix hit per group; it resumes at the
shortest (`prefix_hits[n]`'s tokens), while the recurrent group has cached more of the other
sequence's blocks (up to `tokens`, longer: a group that kept a block another dropped). Its block
table then holds blocks past the resume point; the layer must restore the state where the engine
resumes, which the check compares with the serial run (a restore at the group's own, longer hit
counts tokens twice).

Mixed calls (`StatePoolPath.mixed_calls`): an engine that runs its decode rows inside the step's
prefill call (sglang's mixed chunk): each live sequence in its decode phase joins the prefill call
as a 1-token row after the prefill rows (no decode call runs that step), and the prefill gets
`decode_rows` `[N]` bool (True: the row is a sequence's next decode token). Every rule of the
pool check holds for those rows too; snapshots are taken for the prefill rows only. Plans where no
prefill call runs beside a decode row are refused (the option would check nothing).

Admissions (`StatePoolPath.admit`): before the prefill call that runs a sequence's first chunk,
`admit(module, pool, slots, load_slots, loaded, placement)` is called for the sequences the call
admits: their slots `[A]`, the snapshot each admission loads (`[A]` int64, -1 for none: a prefix
hit loads its snapshot, as a host-cache load-back does) and `loaded` `[A]` bool, whether the load
goes through. A rejected load (`rejected_hits={n: (m, tokens)}`: the admission of sequence n
tried to load the snapshot of sequence m at `tokens` and the load was aborted) is rolled back: the
sequence runs from its first token, fresh, and its plan covers every token (its first `tokens`
inputs are m's, as a hit's are). `admit` may change the admitted slots only; the call's rules
hold after it (a rejected load that leaves the slot seen as loaded shows in the outputs).
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_group_hits", "check_pool_options", "check_rejected_hits", "restored_blocks"]


def check_pool_options(path, block_size, group_hits, rejected_hits, placements) -> None:
    """ValueError naming the rule where the path's serving options and the check's arguments do
    not fit together."""
    if path.block_tables and not block_size:
        raise ValueError("StatePoolPath.block_tables needs block_size (the prefix mode: blocks of block_size tokens)")
    if path.block_tables and path.inner_snapshots:
        raise ValueError("StatePoolPath.block_tables and inner_snapshots are not combined (block tables are vLLM's "
                         "align mode, whose chunks end on block boundaries)")
    if group_hits and not path.block_tables:
        raise ValueError("group_hits needs StatePoolPath.block_tables (a layer group's own hit is the blocks its "
                         "block table holds)")
    if rejected_hits and not block_size:
        raise ValueError("rejected_hits needs block_size (a rejected load is of a snapshot at a block boundary)")
    if rejected_hits and path.admit is None:
        raise ValueError("rejected_hits needs StatePoolPath.admit (a rejected load is rolled back at admission)")
    if path.mixed_calls and path.inner_snapshots:
        raise ValueError("StatePoolPath.mixed_calls and inner_snapshots are not combined")
    if (path.block_tables or path.admit is not None) and any(p.cp > 1 for p in placements):
        raise ValueError(f"StatePoolPath.block_tables and admit run at cp 1 only; got "
                         f"{[p.name for p in placements if p.cp > 1]}")


def check_group_hits(group_hits, hits, plans, block_size) -> dict:
    """group_hits as {n: tokens}: each a prefix hit's recurrent group's own hit length, longer than
    the hit the engine resumes at, on a snapshot the other sequence takes (a chunk of it ending on
    a block boundary)."""
    checked = {}
    for n, tokens in dict(group_hits or {}).items():
        if n not in hits:
            raise ValueError(f"group_hits[{n}]: sequence {n} is not a prefix hit (prefix_hits: {sorted(hits)})")
        m, resume = hits[n]
        ends = [sum(plans[m].chunks[:k + 1]) for k in range(len(plans[m].chunks))]
        if not (isinstance(tokens, int) and not isinstance(tokens, bool)):
            raise ValueError(f"group_hits[{n}] must be an int (the layer group's hit length), got {tokens!r}")
        if tokens <= resume:
            raise ValueError(f"group_hits[{n}] = {tokens}: the layer group's own hit must be longer than the hit the "
                             f"engine resumes at (prefix_hits[{n}] = ({m}, {resume})); an equal one checks nothing "
                             f"prefix_hits does not")
        if tokens % block_size or tokens not in ends:
            raise ValueError(f"group_hits[{n}] = {tokens}: must be where a prefill chunk of sequence {m} ends on a "
                             f"multiple of block_size {block_size} (its chunks end at {ends})")
        checked[n] = tokens
    return checked


def check_rejected_hits(rejected_hits, hits, plans, bounds, block_size) -> dict:
    """rejected_hits as {n: (m, tokens)}: sequence n's admission tries to load the snapshot of an
    earlier sequence m (not a hit, not itself rejected) at `tokens`, where a chunk of m ends on a
    block boundary, and the load is rejected; n is not a prefix hit, its plan covers all its tokens."""
    checked = {}
    for n, hit in dict(rejected_hits or {}).items():
        if not (isinstance(hit, tuple) and len(hit) == 2 and all(isinstance(v, int) for v in hit)):
            raise ValueError(f"rejected_hits[{n}] must be (sequence, tokens), got {hit!r}")
        m, tokens = hit
        if not (isinstance(n, int) and 0 <= m < n < len(plans)) or n in hits or m in hits or m in dict(rejected_hits):
            raise ValueError(f"rejected_hits: sequence {n} may try an earlier sequence's snapshot only (0 <= m < n < "
                             f"{len(plans)}), neither of them a prefix hit nor m a rejected one; got {n}: {hit}")
        ends = [sum(plans[m].chunks[:k + 1]) for k in range(len(plans[m].chunks))]
        if tokens not in ends or tokens % block_size or tokens >= bounds[n + 1] - bounds[n]:
            raise ValueError(f"rejected_hits[{n}] = ({m}, {tokens}): tokens must be where a prefill chunk of sequence "
                             f"{m} ends on a multiple of block_size {block_size} (its chunks end at {ends}), shorter "
                             f"than sequence {n}")
        checked[n] = (m, tokens)
    return checked


def restored_blocks(calls, hits, bounds, block_size, y, y_ref, rtol, state_at, run_from, x) -> list[str]:
    """Block tables: for each prefix hit whose first computed token is off (TP rank 0's view), the
    block of its table whose state gives that output (`run_from(tokens, state)`: the reference's
    output from a state), where one does: a restore from another block than where the engine
    resumes."""
    scale = float(torch.linalg.vector_norm(y_ref)) / math.sqrt(y_ref.shape[1]) or 1.0
    lines = []
    for n, (m, resume) in sorted(hits.items()):
        i, call = next((i, c) for i, c in enumerate(calls) if c.kind == "prefill" and n in c.sequences)
        t = bounds[n] + resume
        if float(torch.linalg.vector_norm(y[0, t] - y_ref[0, t])) / scale <= rtol:
            continue
        for column, slot in enumerate(call.block_table[call.sequences.index(n)]):
            u = (column + 1) * block_size
            if slot < 0 or u == resume:
                continue
            with torch.no_grad():
                out = run_from(x[:, t:t + 1], state_at(m, u))
            if float(torch.linalg.vector_norm(out[0, 0].double() - y[0, t].double())) / scale <= rtol:
                lines.append(f"call {i}: sequence {n} resumes at token {resume}, but its first computed token's output "
                             f"is the one from the block at token {u} (column {column} of its block table, slot "
                             f"{slot}" + (", past where it resumes)" if u > resume else ")"))
                break
    return lines
