"""The state handoff check, for prefill/decode disaggregated serving: the prefill runs at one TP
size, the decode at another, and every sequence's carried state (conv and recurrent) moves from
the prefill placement's ranks to the decode placement's.

The prefill placement (`source`) prefills every prompt of `cu_seqlens` whole, from zero, in one
call; each of its TP ranks keeps its final states, in its layout. For each decode placement of
`targets`, every target TP rank gets all of them, calls the client's `handoff` for itself, then
runs `decode_steps` decode steps of every sequence from what it got. The reference is the
replicated layer in float64: one forward of every whole sequence (prompt and decoded tokens)
from zero, and one of the prompts (the state each target rank must receive, sharded for it with
the path's `shard_state`). Checked, each within rtol:

  - the prefill itself: its outputs on every source TP rank and its final states (unsharded);
  - the handed-off state of every target rank, per sequence and field, before any decode step:
    this is what names a broken handoff: the target placement, the target TP rank, the sequence,
    the field and, with the path's `config` (linattn's state layout), where in the field: the
    conv state's section (q / k / v channels), key or value head and channel, the recurrent
    state's value heads;
  - every decoded token's output on every target TP rank (per token, of the tokens' RMS norm)
    and the state after the last step (unsharded with `unshard_state`).

Relative error per sequence and field (per tensor for the outputs); NaN never passes; inputs
random, seeded. TP placements only (no CP, no sequence parallel); no gradients (serving). This
module imports no pytest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import assert_parity, check_rtol
from .cases import DECODE_LAYOUTS, ShardedLayer, require_linattn_config, require_module_level
from .continuation_report import field_names
from .placement import Placement, as_cu_seqlens, check_one_stage, check_seed
from .state_handoff_rank import RankDecode, RankPrefill, run_decode_on_rank, run_prefill_on_rank
from .state_pool_rank import rebuild_state

__all__ = ["StateHandoffPath", "assert_state_handoff_parity"]


@dataclasses.dataclass(frozen=True)
class StateHandoffPath:
    """How a client's layer prefills at one TP size and decodes at another, for
    `assert_state_handoff_parity`. Callables module-level (spawn pickles them by reference).

    layer: the ShardedLayer (build, shard, process_groups; its unshard is not used).
    handoff(states, source, target, target_tp_rank) -> state
        On each target TP rank: `states` the prefill placement's final states, one per source TP
        rank in TP rank order, each in that rank's layout (on this rank's device); returns the
        state target rank `target_tp_rank` of placement `target` decodes from, in its layout.
    prefill(module, x, cu_seqlens, state, placement) -> (y, state): as StatePath's; state is None
        (every prompt starts from zero). Default `module(x, cu_seqlens, state, output_final_state=True)`.
    decode(module, x, state, placement) -> (y, state): as StatePath's, laid out as `decode_layout`
        ("packed" `[1, N, hidden]`, the default, or "batched" `[N, 1, hidden]`). Default `module.step(x, state)`.
    shard_state(state, placement, tp_rank), unshard_state(states, placement): as StatePath's; the
        check shards the reference's state with the first for each target rank (what it must
        receive) and unshards the final states with the second. Needed where a tp > 1.
    config: the layer's `linattn.layers.LinearAttentionConfig` when the state is linattn's
        (`LayerState`: conv `[N, q | k | v channels, W-1]`, recurrent `[N, HV, dk, dv]`, split over
        TP as `shard_layer_state` splits it): a report then names the conv section, head and
        channel, and the recurrent value heads. None: the worst element's index.
    """

    layer: ShardedLayer
    handoff: Callable
    prefill: Callable | None = None
    decode: Callable | None = None
    shard_state: Callable | None = None
    unshard_state: Callable | None = None
    decode_layout: str = "packed"
    config: object | None = None

    def __post_init__(self):
        if not isinstance(self.layer, ShardedLayer):
            raise ValueError(f"StateHandoffPath.layer must be a ShardedLayer, got {type(self.layer).__name__}")
        if not callable(self.handoff):
            raise ValueError(f"StateHandoffPath.handoff must be callable (handoff(states, source, target, "
                             f"target_tp_rank) -> state), got {self.handoff!r}")
        for field in ("prefill", "decode", "shard_state", "unshard_state"):
            if getattr(self, field) is not None and not callable(getattr(self, field)):
                raise ValueError(f"StateHandoffPath.{field} must be callable or None, got {getattr(self, field)!r}")
        if (self.shard_state is None) != (self.unshard_state is None):
            raise ValueError("StateHandoffPath.shard_state and unshard_state are given together (or neither: "
                             "tp = 1 only)")
        if self.decode_layout not in DECODE_LAYOUTS:
            raise ValueError(f"StateHandoffPath.decode_layout must be one of {sorted(DECODE_LAYOUTS)}, "
                             f"got {self.decode_layout!r}")
        require_linattn_config(self, "its state in linattn's layout")
        require_module_level(self)


def _check_tp_only(placement, what: str) -> None:
    __tracebackhide__ = True
    if not isinstance(placement, Placement):
        raise ValueError(f"{what} must be a Placement, got {type(placement).__name__}")
    check_one_stage(placement, "the state handoff check")
    if placement.cp > 1 or placement.sequence_parallel:
        raise NotImplementedError(f"{what}: not implemented: TP only (the handoff check moves states between TP "
                                  f"sizes: no CP, no sequence parallel), got {placement.name}")


def assert_state_handoff_parity(spawn, path: StateHandoffPath, reference: torch.nn.Module, source: Placement,
                                targets: Sequence[Placement], cu_seqlens, *, decode_steps: int, hidden_size: int,
                                seed: int, rtol: float, dtype: torch.dtype = torch.float64,
                                reference_forward: Callable | None = None, name: str = "") -> None:
    """Prefill every sequence of `cu_seqlens` whole at `source`, hand each TP rank's final state
    to every rank of each placement of `targets` (the path's `handoff`), decode `decode_steps`
    tokens of every sequence there, against the float64 replicated `reference` (the module
    docstring). reference_forward(reference, x, cu_seqlens, state) -> (y, final_state), default
    `reference(x, cu_seqlens, state, output_final_state=True)`; `dtype` the ranks'. AssertionError
    naming the failing targets, and for each the target TP rank, the sequence, the field and
    where in it (the path's `config`); ValueError (NotImplementedError: CP or SP) for bad input."""
    __tracebackhide__ = True
    if not isinstance(path, StateHandoffPath):
        raise ValueError(f"path must be a StateHandoffPath, got {type(path).__name__}")
    _check_tp_only(source, "source")
    if isinstance(targets, Placement) or not isinstance(targets, Sequence) or not targets:
        raise ValueError(f"targets must be a non-empty sequence of Placement (the decode placements; one equal to "
                         f"source is allowed), got {targets!r}")
    targets = list(targets)
    for i, target in enumerate(targets):
        _check_tp_only(target, f"targets[{i}]")
    for what, p in [("source", source)] + [(f"targets[{i}]", t) for i, t in enumerate(targets)]:
        if p.tp > 1 and path.shard_state is None:
            raise ValueError(f"{what} {p.name}: tp > 1 needs StateHandoffPath.shard_state and unshard_state")
    steps = positive_int(decode_steps, "decode_steps")
    positive_int(hidden_size, "hidden_size")
    rtol = check_rtol(rtol)
    check_seed(seed)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype (the ranks'), got {dtype!r}")
    cu = as_cu_seqlens(cu_seqlens)
    lengths = cu.diff().tolist()
    if min(lengths) < 1:
        raise ValueError(f"cu_seqlens must hold no empty sequence (each a prompt), got {cu.tolist()}")

    # every sequence: its prompt, then its decoded tokens; the reference runs them whole
    N = len(lengths)
    bounds = [0] + torch.tensor([n + steps for n in lengths]).cumsum(0).tolist()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, bounds[-1], hidden_size, generator=gen, dtype=torch.float64)
    prompt_tokens = torch.cat([torch.arange(bounds[n], bounds[n] + lengths[n]) for n in range(N)])
    decoded_tokens = torch.tensor([[bounds[n] + lengths[n] + j for n in range(N)] for j in range(steps)])  # [steps, N]
    forward = reference_forward or _default_reference_forward
    ref_dtype = next(reference.parameters()).dtype
    with torch.no_grad():
        y_prompt, at_prompt = forward(reference, x[:, prompt_tokens].to(ref_dtype), cu, None)
        y_whole, at_end = forward(reference, x.to(ref_dtype), torch.tensor(bounds, dtype=torch.int32), None)
    at_prompt, at_end = _double(at_prompt), _double(at_end)
    y_decoded = y_whole.double()[:, decoded_tokens.t().reshape(-1)]  # [1, N * steps, hidden], sequence-major
    weights = {k: t.detach() for k, t in reference.named_parameters()}

    label = f"{name}/" if name else ""
    run = _Run(path, source, lengths, steps, rtol)
    prefilled = spawn(run_prefill_on_rank, source.tp,
                      RankPrefill(path, source, weights, x[:, prompt_tokens], cu, dtype))
    prefill_failures = run.check_prefill(prefilled, y_prompt.double(), at_prompt, cu,
                                         f"{label}prefill at tp{source.tp}/seed{seed}")
    states = [r["state"] for r in prefilled]
    reports, passed = [], []
    for target in targets:
        expected = [_local(path, at_prompt, target, r) for r in range(target.tp)]
        shapes = [[tuple(t.shape) for t in e] for e in expected]
        results = spawn(run_decode_on_rank, target.tp, RankDecode(path, source, target, weights, states,
                                                                  x[0, decoded_tokens], shapes, dtype))
        failures = run.check_target(target, results, expected, y_decoded, at_end,
                                    f"{label}tp{source.tp}->tp{target.tp}/seed{seed}")
        (reports if failures else passed).append((f"tp{target.tp}", failures))
    if not reports and not prefill_failures:
        return
    text = (f"state-handoff parity failed for {label}seed{seed}: prefill at tp{source.tp} of {N} prompt(s) of "
            f"{lengths} tokens, then {steps} decode step(s) each at every target\n")
    if prefill_failures:
        text += (f"\nthe prefill at tp{source.tp} itself is wrong (before any handoff): {len(prefill_failures)} "
                 "failing check(s)\n" + "\n".join(prefill_failures) + "\n")
    if reports:
        text += (f"\n{len(reports)} of {len(targets)} target(s) fail: {', '.join(t for t, _ in reports)}"
                 + (f" (passed: {', '.join(t for t, _ in passed)})" if passed else "") + "\n")
    for target, failures in reports:
        text += (f"\n{label}tp{source.tp}->{target}/seed{seed}: {len(failures)} failing check(s)\n"
                 + "\n".join(failures) + "\n")
    raise AssertionError(text.rstrip())


def _default_reference_forward(reference, x, cu_seqlens, state):
    return reference(x, cu_seqlens, state, output_final_state=True)


def _double(state):
    return rebuild_state(state, [t.detach().double() for t in state])


def _local(path, state, placement, tp_rank):
    """TP rank `tp_rank`'s part of a replicated-layout state (the state itself at tp 1)."""
    return state if placement.tp == 1 else _double(path.shard_state(state, placement, tp_rank))


def _unshard(path, placement, states):
    return _double(states[0] if placement.tp == 1 else path.unshard_state(list(states), placement))


@dataclasses.dataclass(frozen=True)
class _Run:
    """The comparisons of one check, and their words."""

    path: StateHandoffPath
    source: Placement
    lengths: list
    steps: int
    rtol: float

    def describe(self, tensor_name, index):
        return f"sequence {index[0]} (a {self.lengths[index[0]]}-token prompt), element {tuple(index[1:])}"

    def compare_states(self, actual, expected, name, where) -> list[str]:
        """A whole state (replicated layout) against the reference's: the table, then one located line per field."""
        names = field_names(expected)
        try:
            assert_parity(dict(zip(names, actual)), dict(zip(names, expected)), rtol=self.rtol, name=name,
                          describe=self.describe, activations=False)
        except AssertionError as exc:
            located = state_lines(where, names, actual, expected, self.path.config, 1, 0, self.lengths, self.rtol)
            return ["\n".join([str(exc), *located])]
        return []

    def check_prefill(self, results, y_prompt, at_prompt, cu, label) -> list[str]:
        failures = []
        for r, result in enumerate(results):
            try:
                assert_parity(result["y"], y_prompt, rtol=self.rtol, name=f"{label} output tp_rank{r}", cu_seqlens=cu)
            except AssertionError as exc:
                failures.append(str(exc))
        got = _unshard(self.path, self.source, [r["state"] for r in results])
        return failures + self.compare_states(got, at_prompt, f"{label} final state (unsharded)",
                                              f"prefill at tp{self.source.tp}, final state (unsharded)")

    def check_target(self, target, results, expected, y_decoded, at_end, label) -> list[str]:
        """The handed-off states first (what locates a handoff bug), then the decoded outputs and the
        state after the last step."""
        T, N, steps, failures = target.tp, len(self.lengths), self.steps, []
        names = field_names(expected[0])
        for r, result in enumerate(results):
            where = f"handed-off state at tp{T}, tp_rank {r}"
            if result["problem"]:
                failures.append(f"{where}: {result['problem']}")
                continue
            try:  # its record (the run's summary, --linattn-report); judged per sequence below, located
                assert_parity(dict(zip(names, result["handed"])), dict(zip(names, expected[r])), rtol=self.rtol,
                              name=f"{label} handed-off state tp_rank{r}", describe=self.describe, activations=False)
            except AssertionError:
                pass
            failures += state_lines(where, names, result["handed"], expected[r], self.path.config, T, r,
                                    self.lengths, self.rtol)
        if any(r["problem"] for r in results):
            return failures + [f"no decode step ran at tp{T}: a target rank's handed-off state is unusable"]
        cu = torch.arange(N + 1, dtype=torch.int32) * steps
        for r, result in enumerate(results):
            y = result["y"].double().transpose(0, 1).reshape(1, N * steps, -1)  # sequence-major, as y_decoded
            try:
                assert_parity(y, y_decoded, rtol=self.rtol, cu_seqlens=cu,
                              name=f"{label} decoded outputs tp_rank{r} (token j: decode step j+1)")
            except AssertionError as exc:
                failures.append(f"{exc}\n{self.first_wrong_decoded(y, y_decoded, T, r)}")
        final = _unshard(self.path, target, [r["final"] for r in results])
        return failures + self.compare_states(final, at_end, f"{label} state after the last decode step (unsharded)",
                                              f"state after decode step {steps} at tp{T} (unsharded)")

    def first_wrong_decoded(self, y, expected, tp, tp_rank) -> str:
        """The earliest decode step holding a wrong token (the lowest sequence there)."""
        N, steps = len(self.lengths), self.steps
        scale = float(torch.linalg.vector_norm(expected)) / math.sqrt(N * steps) or 1.0
        errors = torch.linalg.vector_norm((y - expected)[0], dim=-1) / scale
        bad = [(j, n) for n in range(N) for j in range(steps) if not errors[n * steps + j] <= self.rtol]
        j, n = min(bad)
        return (f"first wrong decoded token at tp{tp}, tp_rank {tp_rank}: sequence {n} (a {self.lengths[n]}-token "
                f"prompt), decode step {j + 1} of {steps} (token {self.lengths[n] + j} of the sequence), error "
                f"{float(errors[n * steps + j]):.1e} of the tokens' RMS norm; sequences with a wrong token: "
                f"{sorted({b[1] for b in bad})}")


def state_lines(where, names, actual, expected, config, tp, tp_rank, lengths, rtol) -> list[str]:
    """One line per field with a sequence off by more than rtol (relative Frobenius error of its
    row): the first such sequence, where in the field (`config`'s layout of TP rank `tp_rank` of
    `tp`: conv section, head, channel; recurrent value heads), every wrong sequence."""
    lines = []
    for field, a, e in zip(names, actual, expected):
        a, e = a.double(), e.double()
        errors = [_relative(a[n], e[n]) for n in range(e.shape[0])]
        wrong = [n for n, err in enumerate(errors) if not err <= rtol]
        if wrong:
            n = wrong[0]
            lines.append(f"{where}, sequence {n} (a {lengths[n]}-token prompt), field {field}: error "
                         f"{errors[n]:.1e}; {_where_in_field(config, field, a[n], e[n], tp, tp_rank, rtol)}; "
                         f"sequences with a wrong {field}: {wrong}")
    return lines


def _relative(actual, expected) -> float:
    diff = float(torch.linalg.vector_norm(actual - expected))
    return diff / (float(torch.linalg.vector_norm(expected)) or 1.0)


def _units(config, field, shape, tp, tp_rank):
    """(unit, [(region, name) per row]) of one sequence's row of `field` at TP rank `tp_rank` of
    `tp` in linattn's layout (linattn.layers.state): conv rows are channels [q | k | v], each
    section by head (key heads: q, k; value heads: v), a region a section's head; recurrent rows
    are value heads, a region their key head. None where `config` is None or the row is not
    that layout."""
    if config is None:
        return None
    try:
        local, replicas = config.local(tp), config.key_head_replicas(tp)
    except ValueError:
        return None
    dk, dv = config.head_k_dim, config.head_v_dim
    key0 = tp_rank // replicas * local.num_k_heads  # this rank's first key head
    values = config.value_heads_of_rank(tp, tp_rank)  # its value heads, in its order (the config's head pairing)
    if field == "conv" and shape == (local.conv_dim, config.conv_size - 1):
        kd, words = local.key_dim, []
        for c in range(local.conv_dim):
            if c < 2 * kd:
                section, i = ("q", c) if c < kd else ("k", c - kd)
                region, channel = f"section {section} key head {key0 + i // dk}", i % dk
            else:
                region, channel = f"section v value head {values[(c - 2 * kd) // dv]}", (c - 2 * kd) % dv
            words.append((region, f"{region} channel {channel}"))
        return "channel", words
    if field == "recurrent" and shape == (local.num_v_heads, dk, dv):
        return "value head", [(f"key head {config.key_head_of(v)}", f"value head {v}") for v in values]
    return None


def _where_in_field(config, field, actual, expected, tp, tp_rank, rtol) -> str:
    """Which regions of one sequence's row are off (each unit's error of the units' RMS norm), and
    the worst unit; the worst element's index where the layout is not known."""
    diff = (actual - expected).nan_to_num(math.inf)
    found = _units(config, field, tuple(expected.shape), tp, tp_rank)
    if found is None:
        worst = _index_of(int(diff.abs().flatten().argmax()), tuple(expected.shape))
        return f"worst element {worst}"
    unit, words = found
    rows = expected.shape[0]
    scale = float(torch.linalg.vector_norm(expected)) / math.sqrt(rows) or 1.0
    errors = (torch.linalg.vector_norm(diff.reshape(rows, -1), dim=1) / scale).tolist()
    bad = {i for i in range(rows) if not errors[i] <= rtol}
    worst = max(range(rows), key=lambda i: errors[i])
    tail = f"worst: {words[worst][1]}, error {errors[worst]:.1e} of the {unit}s' RMS norm"
    if not bad:
        return f"no single {unit} off by more than rtol of the {unit}s' RMS norm; {tail}"
    members, wrong = {}, {}  # region -> its rows, its wrong rows (in row order)
    for i, (region, name) in enumerate(words):
        members.setdefault(region, []).append(name)
        if i in bad:
            wrong.setdefault(region, []).append(name)
    if unit == "value head":  # "value heads 4, 5 (key head 1)"
        regions = [f"value head{'s' * (len(names) > 1)} {', '.join(n.split()[-1] for n in names)} ({region})"
                   for region, names in wrong.items()]
    else:  # "section q key head 1 (8 of 8 channels)"
        regions = [f"{region} ({len(names)} of {len(members[region])} {unit}s)" for region, names in wrong.items()]
    return f"wrong in {', '.join(regions)}; {tail}"


def _index_of(flat: int, shape: tuple) -> tuple:
    """The multi-index of element `flat` of a tensor of `shape`."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))
