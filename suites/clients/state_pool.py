"""A slot-pool client of linattn's layer for `pytest_linattn.harness.assert_state_pool_parity`,
shared by the state-pool tests and the bug record: prefill and decode read and write the
scheduled slots of a pool in place, as a serving engine's layer call does.

The prefill takes the prefix mode's keywords too (`snapshot_slots`, `prefix_slots`): a prefix
hit reads its prefix block and writes its own slot. With inner snapshots (`inner_snapshot_slots`,
`inner_snapshot_offsets`) it runs each chunk in pieces split at its inner block boundaries, each
piece from the previous piece's state, and writes the state at each boundary to its slot.

`linattn_pool_path(config, prefill=..., decode=..., inner_snapshots=False)`: the harness's
StatePoolPath for a config; a planted bug replaces prefill or decode (module-level functions:
spawn pickles them by reference).
`linattn_captured_pool_path(config, capture=...)`: the same with captured decode steps (a CUDA-graph
runner's static buffers refilled per step; on CUDA a real torch.cuda.CUDAGraph replayed).
`linattn_block_pool_path(config, block_size)`: block tables (the prefill maps token counts to
blocks itself, vLLM's align mode); `linattn_load_back_path(config)`: admissions that load a
prefix hit's snapshot into the admitted slot (copy-on-write); `linattn_pool_path(config,
mixed_calls=True)`: decode rows in the prefill call (pool_prefill runs them as 1-token rows).
"""

from __future__ import annotations

import functools

import torch

from cases.layer_parity import linattn_layer
from linattn.layers import LayerState, shard_layer_state, unshard_layer_state
from pytest_linattn.harness import StatePoolPath

__all__ = ["block_of", "block_pool_prefill", "captured_buffers", "decode_step_on", "linattn_block_pool_path",
           "linattn_captured_pool_path", "linattn_load_back_path", "linattn_pool_path", "load_back_admit",
           "load_back_prefill", "pool_capture", "pool_decode", "pool_prefill", "prefill_in_pieces", "published",
           "replayed", "restored_slots"]


def _rows(mask, rows):
    return mask.view(-1, *[1] * (rows.dim() - 1))


def pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots=None, prefix_slots=None,
                 inner_snapshot_slots=None, inner_snapshot_offsets=None, decode_rows=None):
    """Each sequence from its slot (zero when fresh; a prefix hit from its prefix slot), its final
    state written back to the slot, and to its snapshot slot where it has one; with inner
    snapshots, the chunk in pieces (`prefill_in_pieces`), each inner boundary's state to its slot.
    A mixed call's decode rows (`decode_rows`) are 1-token rows like the others."""
    read = slots if prefix_slots is None else torch.where(prefix_slots >= 0, prefix_slots, slots)
    state = LayerState(*(torch.where(_rows(fresh, f[read]), torch.zeros_like(f[read]), f[read]) for f in pool))
    if inner_snapshot_slots is not None and bool((inner_snapshot_slots >= 0).any()):
        y, new = prefill_in_pieces(module, x, cu_seqlens, state, pool, inner_snapshot_slots, inner_snapshot_offsets)
    else:
        y, new = module(x, cu_seqlens, state, output_final_state=True)
    for f, n in zip(pool, new):  # in the pool's dtype (fla's chunk kernels return a float32 state)
        f[slots] = n.to(f.dtype)
    if snapshot_slots is not None:
        taken = snapshot_slots >= 0
        for f, n in zip(pool, new):
            f[snapshot_slots[taken]] = n[taken].to(f.dtype)
    return y


def prefill_in_pieces(module, x, cu_seqlens, state, pool, inner_slots, inner_offsets):
    """The chunks of a prefill call cut at their inner block boundaries (the offsets whose slot is
    >= 0): round r runs the r-th piece of every sequence that has one, packed, from the state the
    round before left (the first from `state`); the state at each inner boundary goes to its slot.
    Returns the outputs of every token and each sequence's state at its chunk's end."""
    starts, lengths = cu_seqlens[:-1].tolist(), cu_seqlens.diff().tolist()
    cuts = [[(o, s) for s, o in zip(row_slots, row_offsets) if s >= 0]
            for row_slots, row_offsets in zip(inner_slots.tolist(), inner_offsets.tolist())]
    edges = [[0] + [o for o, _ in c] + [n] for c, n in zip(cuts, lengths)]
    y, current = torch.empty_like(x), list(state)
    for r in range(max(len(e) for e in edges) - 1):
        rows = [n for n, e in enumerate(edges) if r + 1 < len(e)]
        pieces = [torch.arange(starts[n] + edges[n][r], starts[n] + edges[n][r + 1]) for n in rows]
        at = torch.tensor(rows, device=current[0].device)
        cu = torch.tensor([0] + [len(p) for p in pieces]).cumsum(0).to(cu_seqlens)
        index = torch.cat(pieces).to(x.device)
        y_piece, new = module(x[:, index], cu, LayerState(*(f[at] for f in current)), output_final_state=True)
        y[:, index] = y_piece
        current = [f.index_copy(0, at, n.to(f.dtype)) for f, n in zip(current, new)]
        for k, n in enumerate(rows):
            if r < len(cuts[n]):  # the piece ends on an inner boundary: its snapshot
                for f, piece_state in zip(pool, new):
                    f[cuts[n][r][1]] = piece_state[k].to(f.dtype)
    return y, LayerState(*current)


def pool_decode(module, x, pool, slots, num_valid, placement):
    """The valid rows only (a captured graph runs every row; its padding writes must go nowhere)."""
    valid = slots[:num_valid]
    y, new = module.step(x[:, :num_valid], LayerState(*(f[valid] for f in pool)))
    for f, n in zip(pool, new):
        f[valid] = n.to(f.dtype)
    return torch.cat([y, torch.zeros_like(x[:, num_valid:])], dim=1)


# ---- captured steps: a CUDA-graph runner's decode (StatePoolPath.capture) ----

MAX_CAPTURED_ROWS = 4  # the runner's static buffers, sized for its largest captured batch
NULL_SLOT = 0  # the captured runner's padding rows read and write this reserved slot (vLLM's null block)


def captured_buffers(module, hidden_size, pool):
    """The runner's static input and slot buffers (MAX_CAPTURED_ROWS rows), allocated once and shared
    by the graphs of every batch size, each graph using the rows it was captured on."""
    buffers = module.__dict__.setdefault("captured_buffers", {})
    if not buffers:
        weight = next(module.parameters())
        buffers["x"] = torch.zeros(1, MAX_CAPTURED_ROWS, hidden_size, dtype=weight.dtype, device=weight.device)
        buffers["slots"] = torch.full((MAX_CAPTURED_ROWS,), NULL_SLOT, dtype=torch.int64, device=pool[0].device)
    return buffers["x"], buffers["slots"]


def decode_step_on(module, pool, x_rows, slot_rows, out, write_rows=None):
    """The captured step: every row of the batch (padding rows too: a graph runs the whole padded
    batch) from its slot, its state written back to the slot (or to `write_rows`' slots, a separate
    destination buffer); the outputs into `out`."""
    y, new = module.step(x_rows, LayerState(*(f[slot_rows] for f in pool)))
    for f, n in zip(pool, new):
        f.index_copy_(0, slot_rows if write_rows is None else write_rows, n.to(f.dtype))
    out["y"] = y


def replayed(step, pool, refill, x_rows):
    """A replay of `step` after `refill(x, slots)` fills its static buffers (`x_rows`: the rows of
    the input buffer it runs on). On CUDA `step` is captured once into a torch.cuda.CUDAGraph and
    each replay runs the graph: first a warm-up run on a side stream with every row refilled to
    the null slot (it runs for real: fla's kernels compile there, and its writes land in the
    reserved slot), then the capture. On a CPU the step runs on the buffers, as the graph would."""
    out = {}
    if pool[0].is_cuda:
        refill(x_rows.clone(), torch.full((x_rows.shape[1],), NULL_SLOT, dtype=torch.int64, device=pool[0].device))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():  # a decode step: fla's fused_recurrent kernels, forward only
            with torch.cuda.stream(side):
                step(out)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of the rank's other threads (its watchdog) do not void the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step(out)  # out["y"]: the graph's static output

        def replay(x, slots, num_valid):
            refill(x, slots)
            graph.replay()
            return out["y"]
        return replay

    def replay(x, slots, num_valid):
        refill(x, slots)
        step(out)
        return out["y"]
    return replay


def pool_capture(module, pool, batch_size, placement):
    """StatePoolPath.capture: the decode of `batch_size` rows on the first rows of the static
    buffers; replay refills those rows from the call (the padding rows at the null slot)."""
    x_buf, slot_buf = captured_buffers(module, module.config.hidden_size, pool)
    x_rows, slot_rows = x_buf[:, :batch_size], slot_buf[:batch_size]

    def refill(x, slots):
        x_rows.copy_(x)
        slot_rows.copy_(slots)

    return replayed(lambda out: decode_step_on(module, pool, x_rows, slot_rows, out), pool, refill, x_rows)


def linattn_captured_pool_path(config, capture=pool_capture) -> StatePoolPath:
    """linattn's layer through the slot-pool client with captured decode steps (`replayed`):
    padding rows at the null slot 0, reserved (a captured graph runs them, so their writes must
    land there)."""
    return StatePoolPath(linattn_layer(config), prefill=pool_prefill, decode=None, capture=capture,
                         padding_slot=NULL_SLOT, reserved_slots=(NULL_SLOT,),
                         shard_state=functools.partial(_shard, config), unshard_state=functools.partial(_unshard, config))


def _shard(config, state, placement, tp_rank):
    return shard_layer_state(state, config, tp_rank, placement.tp)


def _unshard(config, states, placement):
    return unshard_layer_state(states, config)


def linattn_pool_path(config, prefill=pool_prefill, decode=pool_decode, inner_snapshots=False,
                      **options) -> StatePoolPath:
    """linattn's layer for `config` through the slot-pool client, its state sharded over TP as
    its weights are; `inner_snapshots`: snapshots at the block boundaries inside a chunk too
    (StatePoolPath.inner_snapshots; the client's prefill cuts its chunks there); `options`: the
    path's other fields (mixed_calls, ...)."""
    return StatePoolPath(linattn_layer(config), prefill=prefill, decode=decode,
                         shard_state=functools.partial(_shard, config),
                         unshard_state=functools.partial(_unshard, config), inner_snapshots=inner_snapshots, **options)


# ---- block tables (StatePoolPath.block_tables): the client maps token counts to blocks ----

def block_of(num_computed_tokens, block_size):
    """The block column holding the state after `num_computed_tokens` tokens: (c - 1) // block_size
    (vLLM's align mode)."""
    return (num_computed_tokens - 1).div(block_size, rounding_mode="floor")


def restored_slots(block_table, column):
    """Each row's block at `column` where its table holds blocks (a prefix hit's first chunk), -1
    elsewhere and where the column lies past the table."""
    hit = (block_table >= 0).any(dim=1) & (column >= 0) & (column < block_table.shape[1])
    picked = block_table.gather(1, column.clamp(0, block_table.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return torch.where(hit, picked, -1)


def block_pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, block_table,
                       num_computed_tokens, decode_rows=None, *, block_size):
    """The slot-pool prefill whose prefix hit restores the block holding the state where the engine
    resumes (`block_of` num_computed_tokens, in the client's own block_size)."""
    prefix = restored_slots(block_table, block_of(num_computed_tokens, block_size))
    return pool_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots, prefix)


def linattn_block_pool_path(config, block_size, prefill=block_pool_prefill, **options) -> StatePoolPath:
    """The slot-pool client with block tables (StatePoolPath.block_tables) in blocks of `block_size`."""
    return linattn_pool_path(config, prefill=functools.partial(prefill, block_size=block_size), block_tables=True,
                             **options)


# ---- admissions (StatePoolPath.admit): a load-back at admission, copy-on-write ----

def published(module, pool):
    """Per slot: whether it holds a prefix its admission loaded, published for the slot's next
    chunk to start from (kept on the module, as an engine keeps it on the request)."""
    if getattr(module, "published", None) is None:
        module.published = torch.zeros(pool[0].shape[0], dtype=torch.bool, device=pool[0].device)
    return module.published


def load_back_admit(module, pool, slots, load_slots, loaded, placement):
    """Where the load goes through, the snapshot copied into the admitted slot, which is then
    published as holding the sequence's prefix; a rejected load publishes nothing."""
    go = (load_slots >= 0) & loaded
    for f in pool:
        f[slots[go]] = f[load_slots[go]]
    published(module, pool)[slots] = go


def load_back_prefill(module, x, cu_seqlens, pool, slots, fresh, placement, snapshot_slots=None, prefix_slots=None):
    """The slot-pool prefill on the admitted slots: a row starts from its slot where the slot holds
    a published prefix or the row continues, from zero where fresh; the first chunk consumes the
    publication."""
    marks = published(module, pool)
    y = pool_prefill(module, x, cu_seqlens, pool, slots, fresh & ~marks[slots], placement, snapshot_slots, None)
    marks[slots] = False
    return y


def linattn_load_back_path(config, admit=load_back_admit, prefill=load_back_prefill, **options) -> StatePoolPath:
    """The slot-pool client whose admissions load a prefix hit's snapshot into its slot (a host-cache
    load-back, copy-on-write): StatePoolPath.admit."""
    return linattn_pool_path(config, prefill=prefill, admit=admit, **options)
