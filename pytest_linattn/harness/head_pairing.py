"""The head-pairing check: which key head each value head of a client's layer reads, observed on
the ranks, against the convention its config names (`LinearAttentionConfig.head_pairing`,
linattn.heads: "grouped", value head j reads key head j // (HV / H); "tiled", j % H).

With more value heads than key heads two conventions exist, and a TP split or a decode kernel
that assumes the other one pairs about half the value heads with the wrong key head: the text
still reads well, the perplexity does not. Parity sees that as an O(1) error somewhere; this
check says which pairs are wrong. Per placement (TP, no CP), the ranks run one prefill call from
zero state and one decode step from the reference's state after it, first with the reference's
weights, then once per key head k with key head k's q and k rows redrawn. A value head's
recurrent state moves with key head k's weights exactly when it reads key head k, so each phase
(prefill, decode step) gives the observed pairing, compared with the config's; the unperturbed run
is also compared with the reference (outputs and every state field, relative error per tensor).
A failure names the phase, the first value head that read another key head ("value head 1 read
key head 1, not key head 0"), every such head, and the convention the reads match.

The path is a `StatePath` whose state has linattn's recurrent field `[N, HV, K, V]` (a field named
`recurrent`, else the last one). This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from linattn.heads import HEAD_PAIRINGS, key_head_of

from ..parity import assert_parity, check_rtol
from .cases import StatePath
from .continuation_rank import decode_in_layout, default_decode, default_prefill, rank_coordinates
from .placement import Placement, as_cu_seqlens, check_placements, check_seed
from .sharded_parity_rank import load_shard, run_device

__all__ = ["assert_head_pairing", "key_head_rows", "run_pairing_on_rank"]

PHASES = ("prefill", "decode step")
# a value head's state row "moved" with a key head's weights when it changed by more than this
# fraction of its norm (the rows of value heads reading another key head do not change at all)
MOVED = 1e-6


@dataclasses.dataclass(frozen=True)
class RankPairing:
    """What every rank gets: the path, the placement, the weights of each run (the reference's,
    then key head k's q and k rows redrawn, k = 0, 1, ...), the prefill input and boundaries, the
    decode step's input `[1, N, hidden]` and initial state (the replicated layer's layout)."""

    path: StatePath
    placement: Placement
    variants: list
    x: torch.Tensor
    cu_seqlens: torch.Tensor
    x_step: torch.Tensor
    state: tuple
    dtype: torch.dtype


def assert_head_pairing(spawn, path: StatePath, reference: torch.nn.Module, placements: Sequence[Placement],
                        *, seed: int, rtol: float, lengths: Sequence[int] = (5, 3), config=None,
                        dtype: torch.dtype = torch.float64, name: str = "") -> None:
    """The key head each value head of `path`'s layer reads, in a prefill call and a decode step
    at every placement, against `config.head_pairing` (default `reference.config`); and that run
    against `reference` (the replicated layer, float64: `reference(x, cu_seqlens, None,
    output_final_state=True)` and `reference.step(x, state)`) within `rtol`. AssertionError
    naming the placement, the phase and the value heads paired otherwise.

    lengths: the prefill's packed sequences (each then takes one decode step). x, the decode
    tokens and the redrawn key-head rows are seeded by `seed`. Placements: TP only (cp 1, no SP).
    """
    __tracebackhide__ = True
    from linattn.layers import LinearAttentionConfig

    if not isinstance(path, StatePath):
        raise ValueError(f"path must be a StatePath, got {type(path).__name__}")
    config = getattr(reference, "config", None) if config is None else config
    if not isinstance(config, LinearAttentionConfig):
        raise ValueError(f"config must be the layer's LinearAttentionConfig (given, or the reference's .config), got "
                         f"{type(config).__name__}")
    if config.num_v_heads == config.num_k_heads:
        raise ValueError(f"config must have more value heads than key heads (num_v_heads={config.num_v_heads}, "
                         f"num_k_heads={config.num_k_heads}): with as many of each every pairing is the identity")
    rtol = check_rtol(rtol)
    check_seed(seed)
    placements = check_placements(placements)
    for p in placements:
        if p.cp > 1 or p.sequence_parallel:
            raise ValueError(f"placement {p.name}: the head-pairing check runs TP placements (cp 1, no sequence "
                             "parallel)")
        if p.tp > 1 and path.shard_state is None:
            raise ValueError(f"placement {p.name}: tp > 1 needs StatePath.shard_state and unshard_state")
    cu = as_cu_seqlens(torch.tensor([0, *lengths]).cumsum(0))
    gen = torch.Generator().manual_seed(seed)
    hidden, N = config.hidden_size, len(lengths)
    x = torch.randn(1, int(cu[-1]), hidden, generator=gen, dtype=torch.float64)
    x_step = torch.randn(1, N, hidden, generator=gen, dtype=torch.float64)
    base = {n: t.detach() for n, t in reference.named_parameters()}
    variants = [base] + [_redraw_key_head(base, config, k, gen) for k in range(config.num_k_heads)]
    ref_dtype = next(reference.parameters()).dtype
    with torch.no_grad():
        y_ref, state_ref = reference(x.to(ref_dtype), cu, None, output_final_state=True)
        y_step_ref, state_step_ref = reference.step(x_step.to(ref_dtype), state_ref)
    expected = (y_ref, state_ref, y_step_ref, state_step_ref)
    label = f"{name}/" if name else ""
    reports = []
    for p in placements:
        state = _rebuild(state_ref, [t.detach() for t in state_ref])
        case = RankPairing(path, p, variants, x, cu, x_step, state, dtype)
        per_rank = spawn(run_pairing_on_rank, p.size, case)
        report = _check_placement(f"{label}{p.name}/seed{seed}", p, path, config, cu, per_rank, expected, rtol)
        if report:
            reports.append(report)
    if reports:
        raise AssertionError("\n\n".join(reports))


def key_head_rows(config, name: str, key_head: int) -> list[int]:
    """The rows (dim 0) of parameter `name` of `config`'s replicated layer that belong to key head
    `key_head` (its q and k projection rows and conv channels); [] for a parameter without key heads."""
    from linattn.layers import parameter_layouts

    layout = parameter_layouts(config)[name]
    if layout.split not in ("rows", "row_blocks") or not any(layout.key_blocks):
        return []
    H = config.num_k_heads
    if layout.groups > 1:  # grouped per key head: the key parts of group `key_head`
        per_group = sum(layout.blocks)
        rows, offset = [], key_head * per_group
        for size, key in zip(layout.blocks, layout.key_blocks):
            if key:
                rows += range(offset, offset + size)
            offset += size
        return rows
    blocks = layout.blocks or (layout.shape[0],)
    rows, offset = [], 0
    for size, key in zip(blocks, layout.key_blocks):
        if key:
            per_head = size // H
            rows += range(offset + key_head * per_head, offset + (key_head + 1) * per_head)
        offset += size
    return rows


def _redraw_key_head(weights, config, key_head, gen):
    out = {}
    for n, w in weights.items():
        rows = key_head_rows(config, n, key_head)
        if rows:
            w = w.clone()
            w[rows] = torch.randn(w[rows].shape, generator=gen, dtype=torch.float64).to(w.dtype) / w.shape[-1] ** 0.5
        out[n] = w
    return out


def run_pairing_on_rank(case: RankPairing):
    """Rank function (for spawn): per weights variant, (prefill output, state, decode output,
    state) of this rank, the states in its own (sharded) layout."""
    p, path = case.placement, case.path
    tp_rank, _ = rank_coordinates(p)
    device = run_device()
    groups = path.layer.process_groups(p)
    prefill, decode = path.prefill or default_prefill, path.decode or default_decode
    state = case.state if p.tp == 1 else path.shard_state(case.state, p, tp_rank)
    state_in = _rebuild(case.state, [t.to(device=device, dtype=case.dtype) for t in state])
    cu, x, x_step = case.cu_seqlens.to(device), case.x.to(device, case.dtype), case.x_step.to(device, case.dtype)
    results = []
    for weights in case.variants:
        module = path.layer.build(p, groups, case.dtype, device)
        if path.layer.shard is not None:
            load_shard(module, path.layer.shard(weights, p, tp_rank))
        with torch.no_grad():
            y, st = prefill(module, x, cu, None, p)
            y_step, st_step = decode_in_layout(decode, module, x_step, state_in, p, path.decode_layout)
        results.append((y, tuple(st), y_step, tuple(st_step)))
    return results


def _rebuild(like, fields):
    return type(like)(*fields) if hasattr(like, "_fields") else type(like)(fields)


def _recurrent_index(state) -> int:
    fields = getattr(state, "_fields", None)
    return fields.index("recurrent") if fields and "recurrent" in fields else len(state) - 1


def _check_placement(label, p, path, config, cu, per_rank, expected, rtol) -> str:
    y_ref, state_ref, y_step_ref, state_step_ref = expected
    names = getattr(state_ref, "_fields", None) or [f"field {i}" for i in range(len(state_ref))]
    variants = len(per_rank[0])

    def whole(v, k):  # variant v's state k (1: prefill, 3: decode step), unsharded
        states = [r[v][k] for r in per_rank[:p.tp]]
        if p.tp == 1:
            return [t.double().cpu() for t in states[0]]
        return [t.double().cpu() for t in path.unshard_state([_rebuild(state_ref, s) for s in states], p)]

    failures = []
    for phase, k, rk, y_expected, st_expected in (("prefill", 0, 1, y_ref, state_ref),
                                                  ("decode step", 2, 3, y_step_ref, state_step_ref)):
        rec = _recurrent_index(st_expected)
        base = whole(0, rk)
        heads = config.num_v_heads
        if tuple(base[rec].shape[:2]) != (len(cu) - 1, heads):
            raise ValueError(f"the path's state field {names[rec]!r} must be [N, num_v_heads={heads}, ...] (the "
                             f"recurrent state, value heads on dim 1), got {tuple(base[rec].shape)}")
        reads = [set() for _ in range(heads)]
        for v in range(1, variants):
            moved = _moved_rows(whole(v, rk)[rec], base[rec])
            for j in moved:
                reads[j].add(v - 1)
        line = _pairing_line(label, phase, config, reads)
        if line:
            failures.append(line)
        for t in range(p.tp):
            suffix = f" tp_rank{t}" if p.tp > 1 else ""
            try:
                assert_parity(per_rank[t][0][k], y_expected, rtol=rtol, name=f"{label} {phase} output{suffix}",
                              cu_seqlens=cu if phase == "prefill" else None)
            except AssertionError as exc:
                failures.append(str(exc))
        try:
            assert_parity(dict(zip(names, base)), dict(zip(names, st_expected)), rtol=rtol,
                          name=f"{label} {phase} final state", activations=False)
        except AssertionError as exc:
            failures.append(str(exc))
    if not failures:
        return ""
    return f"head pairing check failed for {label}: {len(failures)} failing check(s)\n\n" + "\n\n".join(failures)


def _moved_rows(variant: torch.Tensor, base: torch.Tensor) -> list[int]:
    """Value heads (dim 1) whose rows differ between the two states by more than MOVED of their norm
    (over every sequence); NaN always counts as moved."""
    diff = (variant - base).transpose(0, 1).reshape(base.shape[1], -1)
    norm = base.transpose(0, 1).reshape(base.shape[1], -1)
    moved = torch.linalg.vector_norm(diff, dim=1) > MOVED * torch.linalg.vector_norm(norm, dim=1)
    moved |= torch.isnan(diff).any(dim=1)
    return [j for j, m in enumerate(moved.tolist()) if m]


def _pairing_line(label, phase, config, reads) -> str:
    """'' when every value head read exactly its own key head, else the line naming them."""
    H, HV, pairing = config.num_k_heads, config.num_v_heads, config.head_pairing
    want = [config.key_head_of(j) for j in range(HV)]
    wrong = [j for j in range(HV) if reads[j] != {want[j]}]
    if not wrong:
        return ""

    def read(j):
        got = sorted(reads[j])
        return "no key head" if not got else f"key head {got[0]}" if len(got) == 1 else f"key heads {got}"

    first = wrong[0]
    observed = [next(iter(r)) if len(r) == 1 else None for r in reads]
    matches = [name for name in HEAD_PAIRINGS if name != pairing
               and observed == [key_head_of(j, H, HV, name) for j in range(HV)]]
    tail = (f"; the reads are the {matches[0]!r} pairing's ({HEAD_PAIRINGS[matches[0]]})" if matches else "")
    return (f"head pairing off at {label}, {phase}: value head {first} read {read(first)}, not key head {want[first]} "
            f"({pairing!r}: {HEAD_PAIRINGS[pairing]}); {len(wrong)} of {HV} value heads read another key head: "
            + ", ".join(f"value head {j} read {read(j)} (not {want[j]})" for j in wrong) + tail)
