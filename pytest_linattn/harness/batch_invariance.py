"""Batch invariance of a pool client: N identical requests batched in one call must give one
answer. A serving engine that gets the same prompt N times (club-3090's case: N identical
requests at once) runs them as N rows of one batch; each row must come out bitwise identical to
every other (the same inputs in every row: no tolerance), and equal to the request run alone.

The check runs the client's `StatePoolPath` (the state-pool check's client) twice on a pool whose
every slot starts at `serving_plans.free_fill`'s distinctive values (never zero, never NaN):
`copies` identical sequences, each in a slot of its own (copy n in the n-th slot not reserved),
one prefill call of their `prompt` tokens (all fresh, packed), then `decode_steps` decode calls of
the same token in every row, padded to `capture_size` rows if given, the padding rows pointing
where the path's `padding_slot` says (the state-pool schedule's rule) with inputs at free_fill's
large values (a padding row whose input leaks into a valid row cannot hide as a zero: VeOmni's
padding); then the same with one copy (the single run, its decode calls padded the same way),
on a pool of the same size. Each pool keeps a spare slot, never held.

Judged per placement, on every rank:
- every copy's outputs and final state bitwise equal to copy 0's (the first differing copy, its
  call, token or field, max |diff| and rank reported);
- copy 0 against the float64 reference (one forward of the replicated `reference` over the prompt
  and decode tokens, as the state-pool check computes it) within rtol, per token and per field;
- the batched copy 0 against the single run within rtol, per token and per field (with both
  runs' errors against the reference, so the report says which side moved);
- every slot a call did not schedule bitwise unchanged (the path's reserved slots excepted).
A reference whose output or final state (or an input) is all zeros is refused before any rank
runs (TransformerEngine's guard: a degenerate reference makes every comparison pass).

What it cannot see: crosstalk between identical copies. A decode that reads row i's state from
row i+1's slot reads the same state (the copies are identical); the state-pool check, whose
sequences differ, sees that. A crosstalk that breaks the copies' symmetry (a later copy started
from an earlier one's slot, ik_llama.cpp's `-np > 1` symptom) shows here as a differing copy.

TP placements (cp = 1): under CP a packed prefill is cut over the CP ranks, each copy at another
place, so its rows are not one kernel's identical rows. No gradients (serving). No pytest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .continuation_plans import SequencePlan
from .continuation_report import field_names
from .placement import Placement
from .serving_plans import (check_pool_placements, check_state_dtype_names, describe_call, free_fill, pool_schedule,
                            rank_note)
from .state_pool import StatePoolPath
from .state_pool_rank import RankPool, rebuild_state, run_pool_on_rank

__all__ = ["assert_batch_invariance", "run_batch_runs_on_rank"]

SHOWN_COPIES = 3  # differing copies a report lists one by one


def assert_batch_invariance(spawn, path: StatePoolPath, reference: torch.nn.Module, placements: Sequence[Placement],
                            *, prompt: int, copies: int, decode_steps: int, hidden_size: int, seed: int, rtol: float,
                            dtype: torch.dtype = torch.float64, capture_size: int | None = None,
                            reference_forward: Callable | None = None, name: str = "") -> None:
    """`copies` identical requests of `prompt` tokens and `decode_steps` decode steps through the
    client's pool path, batched, then alone, at every TP placement (module docstring).
    capture_size: the decode batch's rows (the graph's size), the copies' and padding rows';
    default None: no padding rows. reference_forward(reference, x, cu_seqlens, state) ->
    (y, final_state), as the state-pool check's."""
    __tracebackhide__ = True
    if not isinstance(path, StatePoolPath):
        raise ValueError(f"path must be a StatePoolPath, got {type(path).__name__}")
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 2:
        raise ValueError(f"copies must be an int >= 2 (identical requests batched in one call), got {copies!r}")
    positive_int(prompt, "prompt")
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 0:
        raise ValueError(f"decode_steps must be an int >= 0, got {decode_steps!r}")
    if capture_size is not None and (isinstance(capture_size, bool) or not isinstance(capture_size, int)
                                     or capture_size < copies):
        raise ValueError(f"capture_size must be None or an int >= copies ({copies}): the decode batch's rows, the "
                         f"copies' and the padding rows'; got {capture_size!r}")
    positive_int(hidden_size, "hidden_size")
    rtol = check_rtol(rtol)
    placements = check_pool_placements(placements, path, "batch invariance")
    for p in placements:
        if p.cp > 1:
            raise ValueError(f"placements: batch invariance runs TP placements (cp = 1), got {p.name}: under CP a "
                             "packed prefill is cut over the CP ranks, each copy at another place")
    reserved = path.reserved_slots
    size = copies + 1 + len(reserved)  # the copies', a spare and the reserved slots
    if any(r >= size for r in reserved):
        raise ValueError(f"StatePoolPath.reserved_slots {list(reserved)}: a reserved slot must lie among the pool's "
                         f"first {size} slots (the reserved ones, the {copies} copies' and a spare)")

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, prompt + decode_steps, hidden_size, generator=gen, dtype=torch.float64)
    forward = reference_forward or (lambda ref, x_, cu_, s: ref(x_, cu_, s, output_final_state=True))
    ref_dtype = next(reference.parameters()).dtype
    with torch.no_grad():
        y_ref, probe = forward(reference, x.to(ref_dtype), torch.tensor([0, x.shape[1]], dtype=torch.int32), None)
    y_ref, ht_ref = y_ref.double(), [t.double() for t in probe]
    names = field_names(probe)
    refuse_degenerate(x, y_ref, names, ht_ref)
    check_state_dtype_names(path, names)
    runs = [_batch_run(n, x, probe, path, prompt, decode_steps, capture_size or n, size, gen) for n in (copies, 1)]
    weights = {k: t.detach() for k, t in reference.named_parameters()}
    label = f"{name}/" if name else ""
    reports = []
    for p in placements:
        cases = [RankPool(path, p, weights, run.x, run.pool, run.calls, dtype, names) for run in runs]
        results = spawn(run_batch_runs_on_rank, p.size, cases)  # per rank: [batched, single]
        report = _check(f"{label}{p.name}/seed{seed}", p, path, runs, results, y_ref, ht_ref, names, prompt, rtol)
        if report:
            reports.append(report)
    if reports:
        raise AssertionError("\n\n".join(reports))


def run_batch_runs_on_rank(cases) -> list[dict]:
    """Rank function (for spawn): the state-pool rank's run of each case, the batched then the
    single, each on a layer and pool of its own."""
    return [run_pool_on_rank(case) for case in cases]


def refuse_degenerate(x, y_ref, names, ht_ref) -> None:
    """AssertionError where the input, the reference's output or a field of its final state is all
    zeros: a client that returns zeros would match it, so no comparison with it means anything."""
    for what, t in [("the input", x), ("its output", y_ref)] + [(f"its final state's field {n}", f)
                                                                 for n, f in zip(names, ht_ref)]:
        if not bool(t.ne(0).any()):
            raise AssertionError(f"batch invariance: the reference is degenerate: {what} is all zeros, so a client "
                                 f"returning zeros would match it; give a reference (and reference_forward) whose "
                                 f"output and final state are not all zeros")


@dataclasses.dataclass(frozen=True)
class _BatchRun:
    """One run: `copies` identical sequences (copy n is sequence n), their packed input
    `[1, copies * L, hidden]`, the pool (replicated layout, float64), the calls, the copies' slots."""

    copies: int
    x: torch.Tensor
    pool: tuple
    calls: list
    slots: tuple

    def token_call(self, copy: int, t: int, length: int) -> int:
        """The index of the call that ran token t of `copy`."""
        return next(i for i, c in enumerate(self.calls) if copy * length + t in c.tokens.tolist())


def _batch_run(copies, x, probe, path, prompt, decode_steps, capture, size, gen) -> _BatchRun:
    """The state-pool schedule of `copies` sequences of one chunk each, admitted at once: one prefill
    call, then `decode_steps` decode calls padded to `capture` rows; padding inputs and every slot at
    free_fill's values."""
    L = x.shape[1]
    plans = [SequencePlan((prompt,), decode_steps)] * copies
    calls = pool_schedule(plans, [n * L for n in range(copies + 1)], copies, size, x.shape[2], gen, (capture,),
                          padding_slot=path.padding_slot, reserved_slots=path.reserved_slots)
    calls = [c if c.pad_x is None else dataclasses.replace(c, pad_x=free_fill(c.pad_x)) for c in calls]
    fields = [free_fill(torch.randn((size,) + tuple(t.shape[1:]), generator=gen, dtype=torch.float64)) for t in probe]
    return _BatchRun(copies, x.repeat(1, copies, 1), rebuild_state(probe, fields), calls, tuple(calls[0].slots))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers: equal where the values are bitwise equal (NaN and -0.0 included)."""
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().nan_to_num(float("inf")).max()) if a.numel() else 0.0


def _token_words(t: int, prompt: int) -> str:
    return f"token {t} (prompt token {t})" if t < prompt else f"token {t} (decode step {t - prompt})"


def _bitwise(results, run, names, prompt, L) -> list[str]:
    """The copies that differ from copy 0 bitwise, each on the lowest rank where it does: the
    headline the first one's first difference (an output token, else a final-state field), then
    a line per copy (the first few): its differing tokens and fields."""
    lines, first = [], None
    for n in range(1, run.copies):
        for r, result in enumerate(results):
            y, final = result[0]["y"][0], result[0]["final"]
            rows = (_bits(y[n * L:(n + 1) * L]) != _bits(y[:L])).any(-1).nonzero().flatten().tolist()
            fields = [(name, _max_diff(f[n], f[0])) for name, f in zip(names, final)
                      if not torch.equal(_bits(f[n]), _bits(f[0]))]
            if not (rows or fields):
                continue
            words = []
            if rows:
                t, i = rows[0], run.token_call(n, rows[0], L)
                diff = _max_diff(y[n * L + t], y[t])
                first = first or (f"copy {n} (slot {run.slots[n]}): output {_token_words(t, prompt)}, "
                                  f"{describe_call(i, run.calls[i])}, max |diff| {diff:.2e} (rank {r})")
                words.append(f"{len(rows)} output token(s), the first {_token_words(t, prompt)} in call {i}, max "
                             f"|diff| {diff:.2e}")
            first = first or (f"copy {n} (slot {run.slots[n]}): final state field {fields[0][0]}, max |diff| "
                              f"{fields[0][1]:.2e} (rank {r})")
            if fields:
                words.append("final state " + ", ".join(f"{name} {d:.2e}" for name, d in fields))
            lines.append(f"  copy {n} (slot {run.slots[n]}, rank {r}): " + "; ".join(words))
            break
    if not lines:
        return []
    shown = lines[:SHOWN_COPIES] + ([f"  ... and {len(lines) - SHOWN_COPIES} more copies"]
                                    if len(lines) > SHOWN_COPIES else [])
    return [f"copies differ bitwise from copy 0 (the same input in every row): {len(lines)} of {run.copies - 1}; "
            f"first differing {first}\n" + "\n".join(shown)]


def _against(y, want, scale, rtol):
    """Per-token errors of y against want (of the reference tokens' RMS norm) and the tokens off."""
    err = torch.linalg.vector_norm((y - want)[0], dim=-1) / scale
    return err, torch.nonzero(~(err <= rtol)).flatten().tolist()


def _relative(a, e) -> float:
    return float(torch.linalg.vector_norm(a - e)) / (float(torch.linalg.vector_norm(e)) or 1.0)


def _check(label, p, path, runs, results, y_ref, ht_ref, names, prompt, rtol) -> str:
    batched, single = runs
    L = y_ref.shape[1]
    failures = _bitwise(results, batched, names, prompt, L)
    scale = float(torch.linalg.vector_norm(y_ref)) / math.sqrt(L) or 1.0
    for t_rank in range(p.tp):
        note = rank_note(p, t_rank, 0, False)
        y_b, y_s = (results[t_rank][k]["y"].double()[:, :L] for k in (0, 1))
        err_ref, off = _against(y_b, y_ref, scale, rtol)
        if off:
            t = off[0]
            i = batched.token_call(0, t, L)
            failures.append(f"copy 0 against the float64 reference{note}: {len(off)} token(s) off; first wrong "
                            f"{_token_words(t, prompt)}, {describe_call(i, batched.calls[i])}, error "
                            f"{float(err_ref[t]):.1e} of the tokens' RMS norm")
        err_single, off = _against(y_b, y_s, scale, rtol)
        if off:
            t = off[0]
            i = batched.token_call(0, t, L)
            single_ref = float(torch.linalg.vector_norm((y_s - y_ref)[0, t])) / scale
            failures.append(f"batched copy 0 against the single run (one request){note}: {len(off)} token(s) off; "
                            f"first {_token_words(t, prompt)}, {describe_call(i, batched.calls[i])}, error "
                            f"{float(err_single[t]):.1e} of the tokens' RMS norm (against the float64 reference: "
                            f"batched {float(err_ref[t]):.1e}, single {single_ref:.1e})")
    states = [_copy0_state(path, p, [results[t][k]["final"] for t in range(p.tp)]) for k in (0, 1)]
    for name, b, s, e in zip(names, *states, ht_ref):
        b_ref, s_ref, b_s = _relative(b, e[0]), _relative(s, e[0]), _relative(b, s)
        if not b_ref <= rtol:
            failures.append(f"copy 0's final state against the float64 reference: field {name} error {b_ref:.1e}")
        if not b_s <= rtol:
            failures.append(f"batched copy 0's final state against the single run's: field {name} error {b_s:.1e} "
                            f"(against the float64 reference: batched {b_ref:.1e}, single {s_ref:.1e})")
    for k, (run, words) in enumerate(zip(runs, ("", "the single run's "))):
        for r, result in enumerate(results):
            for i, slot, seq, field, diff in result[k]["changed"]:
                what = "free: never held" if seq is None else f"copy {seq}'s"
                failures.append(f"{words}{describe_call(i, run.calls[i])} changed slot {slot} ({what}), which it "
                                f"did not schedule: field {field}, max |change| {diff:.2e} (rank {r})")
    if not failures:
        return ""
    size = batched.pool[0].shape[0]
    free = [s for s in range(size) if s not in batched.slots and s not in path.reserved_slots]
    return (f"batch invariance failed for {label}: {len(failures)} failing check(s)\n"
            f"  {batched.copies} copies of one request ({prompt} prompt tokens, then {L - prompt} decode steps): "
            f"sequence n is copy n, in slots {list(batched.slots)}; a pool of {size} slots (free {free}"
            + (f", reserved {list(path.reserved_slots)}" if path.reserved_slots else "") + ")\n"
            + "".join(f"  {describe_call(i, c)}\n" for i, c in enumerate(batched.calls))
            + f"  the single run: copy 0 alone in slot {single.slots[0]}, the same calls with one row"
            + (f" (its decode calls padded to {len(single.calls[-1].slots)} rows)" if L > prompt else "")
            + "\n\n" + "\n".join(failures))


def _copy0_state(path, p, per_tp_rank) -> list:
    """Copy 0's final state, the replicated layout's fields in float64."""
    fields = per_tp_rank[0] if p.tp == 1 else path.unshard_state(per_tp_rank, p)
    return [f.double()[0] for f in fields]
