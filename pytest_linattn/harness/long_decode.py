"""Long decodes: the state's precision over many one-token steps. The ranks run the client's
layer in their dtype (float32 by default): one prefill call of `prefill` tokens per sequence,
then `steps` decode steps, each from the state the previous returned. The reference is the
float64 serial run of the replicated layer.

Two contracts, checked after every call:
  - every floating-point field of a returned state is at least `state_dtype` (default float32:
    a state stored in bf16 or fp16 loses its low bits every step, and the loss compounds);
  - the error of step t (relative, over every sequence: the outputs, and each state field)
    stays within `rtol * max(1, t / warmup) ** growth`: growth 0.5 allows a random walk of
    rounding errors; a state that drifts faster (linearly, or compounding) fails at the first
    step past the bound.
NaN never passes. TP placements only; no gradients. This module imports no pytest.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from linattn.checks import positive_int

from ..parity import check_rtol
from .cases import StatePath
from .continuation_rank import decode_in_layout, default_decode, default_prefill
from .continuation_report import field_names
from .placement import Placement, check_one_stage
from .sharded_parity_rank import load_shard, run_device
from .spec_decode import serial_run

__all__ = ["assert_long_decode_parity", "decode_error_bound", "long_decode_errors"]


def decode_error_bound(step: int, rtol: float, growth: float, warmup: int) -> float:
    """The largest relative error allowed at decode step `step` (1-based)."""
    return rtol * max(1.0, step / warmup) ** growth


@dataclasses.dataclass(frozen=True)
class RankLongDecode:
    path: StatePath
    placement: Placement
    weights: dict
    x: torch.Tensor
    prefill: int
    steps: int
    dtype: torch.dtype


def run_long_decode_on_rank(case: RankLongDecode) -> dict:
    """Rank function (for spawn): the outputs `[1, N, prefill + steps, hidden]`-ordered per call,
    and the state (this rank's shard) and its dtypes after every call."""
    import torch.distributed as dist

    p, path, device = case.placement, case.path, run_device()
    tp_rank = dist.get_rank() % p.tp
    module = path.layer.build(p, path.layer.process_groups(p), case.dtype, device)
    if path.layer.shard is not None:
        load_shard(module, path.layer.shard(case.weights, p, tp_rank))
    N = case.x.shape[0]
    x = case.x.to(device, case.dtype)
    prefill = path.prefill or default_prefill
    decode = path.decode or default_decode
    cu = torch.arange(N + 1, device=device) * case.prefill
    ys, states = [], []
    # every call's outputs and state are kept as copies: a client may update its state in place and
    # return the same tensors (as a serving pool is updated), and .cpu() on a CPU copies nothing
    with torch.no_grad():
        y, state = prefill(module, x[:, :case.prefill].reshape(1, -1, x.shape[2]), cu, None, p)
        ys.append(_kept(y).double().view(N, case.prefill, -1))
        states.append([_kept(t) for t in state])
        for t in range(case.prefill, case.prefill + case.steps):
            y, state = decode_in_layout(decode, module, x[:, t].unsqueeze(0), state, p, path.decode_layout)
            ys.append(_kept(y).double().view(N, 1, -1))
            states.append([_kept(s) for s in state])
    return dict(y=torch.cat(ys, dim=1), states=states, names=field_names(state), type=type(state))


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a client's tensor on the CPU, in its dtype (never the tensor itself)."""
    return tensor.detach().to("cpu", copy=True)


def long_decode_errors(spawn, path: StatePath, reference: torch.nn.Module, placement: Placement, *,
                       num_sequences: int, prefill: int, steps: int, hidden_size: int, seed: int,
                       dtype: torch.dtype = torch.float32, reference_forward=None) -> dict:
    """The errors `assert_long_decode_parity` judges, for one placement: `num_sequences` sequences,
    a `prefill`-token call, then `steps` decode steps in `dtype` on the ranks, against the float64
    serial run. Lists are indexed by call (0: the prefill call, t: decode step t), each the
    relative error over every sequence:

        outputs       {"output": [...]} (TP > 1: one entry per TP rank, "output tp_rank{r}")
        states        {field: [...]}, the state returned by each call (unsharded over TP)
        state_dtypes  per rank, per call, {field: dtype} of the returned state
        fields        the state's field names

    reference_forward: how the serial run calls `reference` on one token per sequence, as in
    `assert_long_decode_parity` (default: its forward with `output_final_state=True`).
    """
    _check_inputs(path, num_sequences=num_sequences, prefill=prefill, steps=steps, hidden_size=hidden_size)
    _check_placements(path, [placement])
    run = _serial_reference(reference, reference_forward, num_sequences=num_sequences, prefill=prefill, steps=steps,
                            hidden_size=hidden_size, seed=seed)
    return _placement_errors(spawn, path, reference, placement, run, dtype)


def assert_long_decode_parity(spawn, path: StatePath, reference: torch.nn.Module, placements, *, num_sequences: int,
                              prefill: int, steps: int = 256, hidden_size: int, seed: int, rtol: float = 1e-5,
                              growth: float = 0.5, warmup: int = 16, dtype: torch.dtype = torch.float32,
                              state_dtype: torch.dtype = torch.float32, reference_forward=None, name: str = "") -> None:
    """`num_sequences` sequences: a `prefill`-token call, then `steps` decode steps in `dtype` on
    the ranks, against the float64 serial run (the module docstring): returned state dtypes at
    least `state_dtype`, each step's error (`long_decode_errors`) within `decode_error_bound`.
    AssertionError naming the contract, the call or step, the field and the error."""
    __tracebackhide__ = True
    _check_inputs(path, num_sequences=num_sequences, prefill=prefill, steps=steps, hidden_size=hidden_size,
                  warmup=warmup)
    rtol = check_rtol(rtol)
    if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not 0 <= growth <= 1:
        raise ValueError(f"growth must be a number in [0, 1] (the bound's exponent: 0.5 a random walk, 1 linear), "
                         f"got {growth!r}")
    if not (isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point):
        raise ValueError(f"state_dtype must be a floating-point torch.dtype, got {state_dtype!r}")
    placements = list(placements)
    _check_placements(path, placements)

    run = _serial_reference(reference, reference_forward, num_sequences=num_sequences, prefill=prefill, steps=steps,
                            hidden_size=hidden_size, seed=seed)
    min_eps = torch.finfo(state_dtype).eps
    label = f"{name}/" if name else ""
    reports = []
    for p in placements:
        errors = _placement_errors(spawn, path, reference, p, run, dtype)
        failures = []
        for r, per_call in enumerate(errors["state_dtypes"]):
            low = [(i, f, d) for i, dtypes in enumerate(per_call) for f, d in dtypes.items()
                   if d.is_floating_point and torch.finfo(d).eps > min_eps]
            if low:
                i, f, d = low[0]
                failures.append(f"state dtype: {_call(i)} returned field {f} in {d}, below the contract {state_dtype} "
                                f"({len(low)} such field(s) over the calls; rank {r})")
        worst = {}
        for what, errs in errors["outputs"].items():  # the prefill call's outputs are the short checks'
            for step in range(1, steps + 1):
                _note(worst, what, step, errs[step], rtol, growth, warmup)
        for f, errs in errors["states"].items():
            for i in range(steps + 1):
                _note(worst, f"state field {f}", i, errs[i], rtol, growth, warmup)
        for what, (step, err, bound) in worst.items():
            failures.append(f"error growth: {what} first exceeds the bound at {_call(step)}: error {err:.1e} > "
                            f"{bound:.1e} (rtol {rtol:.0e} x max(1, step/{warmup})^{growth})")
        if failures:
            reports.append(f"long-decode parity failed for {label}{p.name}/seed{seed} ({dtype} ranks, {prefill}-token "
                           f"prefill, {steps} decode steps, {num_sequences} sequences):\n"
                           + "\n".join(f"  {f}" for f in failures))
    if reports:
        raise AssertionError("\n\n".join(reports))


def _check_inputs(path, **counts):
    if not isinstance(path, StatePath) or path.no_decode:
        raise ValueError(f"path must be a StatePath with a decode path, got {path!r}")
    for what, value in counts.items():
        positive_int(value, what)


def _check_placements(path, placements):
    if not placements or not all(isinstance(p, Placement) and p.cp == 1 and not p.sequence_parallel
                                 for p in placements):
        raise ValueError(f"placements must be a non-empty sequence of TP-only Placements, got {placements!r}")
    for p in placements:
        check_one_stage(p, "the long-decode check")
        if p.tp > 1 and path.unshard_state is None:
            raise ValueError(f"placement {p.name}: tp > 1 needs StatePath.shard_state and unshard_state")


@dataclasses.dataclass(frozen=True)
class _SerialRun:
    x: torch.Tensor  # [N, prefill + steps, hidden], float64
    y: torch.Tensor  # the same shape: the reference's outputs
    states: tuple  # per field [N, prefill + steps + 1, ...]: the state after each token
    prefill: int
    steps: int


def _serial_reference(reference, reference_forward, *, num_sequences, prefill, steps, hidden_size, seed):
    gen = torch.Generator().manual_seed(seed)
    L = prefill + steps
    x = torch.randn(num_sequences, L, hidden_size, generator=gen, dtype=torch.float64)
    bounds = [n * L for n in range(num_sequences + 1)]
    forward = reference_forward or (lambda ref, x_, cu_, s: ref(x_, cu_, s, output_final_state=True))
    y_ref, s_ref = serial_run(forward, reference, x.reshape(1, -1, hidden_size), bounds)
    return _SerialRun(x, y_ref.view(num_sequences, L, hidden_size), tuple(s_ref), prefill, steps)


def _placement_errors(spawn, path, reference, p, run: _SerialRun, dtype) -> dict:
    prefill, steps = run.prefill, run.steps
    case = RankLongDecode(path, p, {k: t.detach() for k, t in reference.named_parameters()}, run.x, prefill, steps,
                          dtype)
    results = spawn(run_long_decode_on_rank, p.size, case)
    names = list(results[0]["names"])
    outputs = {}
    for t_rank in range(p.tp):
        y = results[t_rank]["y"]
        calls = [slice(0, prefill)] + [slice(prefill + step - 1, prefill + step) for step in range(1, steps + 1)]
        outputs[f"output{f' tp_rank{t_rank}' if p.tp > 1 else ''}"] = [_rel(y[:, c], run.y[:, c]) for c in calls]
    states = {f: [] for f in names}
    for i in range(steps + 1):
        per_rank = [results[t]["states"][i] for t in range(p.tp)]
        got = per_rank[0] if p.tp == 1 else path.unshard_state([results[0]["type"](*s) for s in per_rank], p)
        for f, a, e in zip(names, got, run.states):
            states[f].append(_rel(a.double(), e[:, prefill + i]))
    state_dtypes = [[{f: t.dtype for f, t in zip(names, state)} for state in result["states"]] for result in results]
    return dict(outputs=outputs, states=states, state_dtypes=state_dtypes, fields=names)


def _call(i):
    return "the prefill call" if i == 0 else f"decode step {i}"


def _rel(actual, expected):
    return float(torch.linalg.vector_norm(actual.double() - expected)) / (float(torch.linalg.vector_norm(expected))
                                                                          or 1.0)


def _note(worst, what, step, err, rtol, growth, warmup):
    bound = decode_error_bound(max(step, 1), rtol, growth, warmup)
    if what not in worst and not (err <= bound and math.isfinite(err)):
        worst[what] = (step, err, bound)
