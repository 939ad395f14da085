"""fla 0.6.0's serving entry of the KDA recurrence, computed with linattn's references.

    fused_recurrent_kda_fwd (fla.ops.kda.fused_recurrent): the state-pool interface that vLLM's
    decode kernel has, which fla's public fused_recurrent_kda does not pass on

What fla's kernel does (read from fla 0.6.0's ``fused_recurrent_kda_fwd_kernel``), and so the
emulation:

- ``inplace_final_state=True`` (the default): the returned state is ``initial_state`` itself,
  written in place (``initial_state`` required). Otherwise a new ``[N, HV, K, V]`` state when
  ``output_final_state``.
- Without ``ssm_state_indices``: sequence n starts from ``initial_state[n]`` and its state after
  its last token goes to row n of the returned state.
- With ``ssm_state_indices`` (a pool of slots, ``initial_state`` `[P, HV, K, V]`): sequence n
  starts from slot ``indices[n, a - 1]`` (``a = num_accepted_tokens[n]``; without it column 0);
  its state after token t goes to slot ``indices[n, t]`` (in place), or to row ``bos + t`` of a
  new state without ``inplace_final_state``. Indices `[N]` (one token per sequence: a decode) or
  `[N, columns]` (a state per token: speculative decoding's verify). A sequence of zero tokens
  (``cu_seqlens`` with repeated entries) reads and writes nothing: fla 0.6.0's only padding.
- ``out``: the output tensor written in place (tokens outside every sequence keep their values;
  a new one starts as zeros). There is no backward (fla's has none): computed without autograd.

Refused (NotImplementedError), where fla's kernel reads or writes outside what it was given, or
where the order of its parallel programs decides the result: a negative index (fla 0.6.0 has no
padding sentinel: slot -1 is the memory before the pool) or one past the pool; 1-D indices with
more than one token per sequence (token t then goes to entry n + t, another sequence's); a column
past the index row (``num_accepted_tokens`` 0 or above the columns, more tokens than columns);
a slot one sequence writes and another reads or writes; ``num_accepted_tokens`` without indices
(fla's kernel does not read it then); indices without ``inplace_final_state`` or
``output_final_state``, or with more tokens than ``N``; a non-contiguous input (this entry has
no ``input_guard``: fla's kernel reads it as contiguous). Options as ``fused_recurrent_kda``'s.
"""

from __future__ import annotations

import torch

from linattn import reference
from linattn.kernels import log_decay

from .delta_rule_options import _beta, _check_beta_options, _refuse_beta_per_value_channel, _state_dtype, _to_compute
from .patching import refuse

FUNCTION = "fused_recurrent_kda_fwd"


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's fused_recurrent_kda_fwd (the module docstring): `(out, final_state)`."""
    _refuse_beta_per_value_channel(FUNCTION, beta, v)
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        refuse(FUNCTION, "A_log", None, why="with use_gate_in_kernel=True and no lower_bound is not emulated")
    _check_beta_options(allow_neg_eigval, use_beta_sigmoid_in_kernel)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and not (t if name != "initial_state" else t[:1]).is_contiguous():
            refuse(FUNCTION, name, f"a tensor of strides {t.stride()}", why="is not emulated: this entry has no "
                   "input_guard, and fla's kernel reads it as contiguous (a pool: contiguous rows, any row stride)")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    bounds = _bounds(q, cu_seqlens, B, T)
    N = len(bounds)
    scale = K ** -0.5 if scale is None else scale
    if out is None:
        out = torch.zeros_like(v)
    else:
        assert out.shape == v.shape
    if inplace_final_state:
        assert initial_state is not None
        final_state = initial_state
    elif output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final_state = q.new_empty(shape, dtype=_state_dtype(q))
    else:
        final_state = None
    pooled = ssm_state_indices is not None
    if num_accepted_tokens is not None and not pooled:
        refuse(FUNCTION, "num_accepted_tokens", "a tensor without ssm_state_indices",
               why="is not emulated: fla's kernel reads it only with a state pool")
    reads, writes = (_pool_plan(ssm_state_indices, num_accepted_tokens, bounds, initial_state, final_state,
                                inplace_final_state) if pooled else (None, None))

    with torch.no_grad():
        q, k, v, g, beta, A_log, dt_bias = _to_compute(q, k, v, g, beta, A_log, dt_bias)
        if use_gate_in_kernel:
            g = log_decay(g, A_log, dt_bias, lower_bound, per_channel=True)
        beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
        flat = [t.flatten(0, 1) for t in (q, k, v, g, beta)]  # sequence n's tokens: flat rows bos..eos
        for n, (bos, eos) in enumerate(bounds):
            if eos == bos and pooled:
                continue  # fla's kernel returns before reading its index
            source = reads[n] if pooled else n
            h0 = None if initial_state is None else _k_first(initial_state[source], state_v_first).to(q.dtype)
            o, states = token_states(*(t[bos:eos] for t in flat), h0, scale, use_qk_l2norm_in_kernel)
            out.view(-1, HV, V)[bos:eos] = o.to(out.dtype)
            if pooled:
                for t, row in enumerate(writes[n]):
                    final_state[row] = _k_first(states[t], state_v_first).to(final_state.dtype)
            elif final_state is not None:
                last = states[-1] if eos > bos else (h0 if h0 is not None else q.new_zeros(HV, K, V))
                final_state[n] = _k_first(last, state_v_first).to(final_state.dtype)
    return out, final_state


def token_states(q, k, v, g, beta, h0, scale, use_qk_l2norm):
    """One sequence's tokens (q, k `[T, H, K]`, v `[T, HV, V]`, g `[T, HV, K]`, beta `[T, HV]`) from
    h0 `[HV, K, V]` (None: zeros), token by token with the reference: outputs `[T, HV, V]` and the
    state after every token `[T, HV, K, V]`."""
    outputs, states, state = [], [], h0
    for t in range(q.shape[0]):
        o, state = reference.kda(*(x[t:t + 1].unsqueeze(0) for x in (q, k, v, g, beta)), scale=scale,
                                 initial_state=None if state is None else state.unsqueeze(0),
                                 output_final_state=True, use_qk_l2norm=use_qk_l2norm, mode="recurrent",
                                 compute_dtype=q.dtype)
        state = state[0]
        outputs.append(o[0, 0])
        states.append(state)
    if not outputs:
        return q.new_zeros((0,) + tuple(v.shape[1:])), []
    return torch.stack(outputs), states


def _bounds(q, cu_seqlens, B, T):
    """Each sequence's (bos, eos) in the flat `[B*T]` tokens (fla's kernel: no check of its own)."""
    if cu_seqlens is None:
        return [(n * T, n * T + T) for n in range(B)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    if B != 1 or cu[0] != 0 or cu[-1] > T or any(b > e for b, e in zip(cu, cu[1:])):
        raise ValueError(f"fla_on_cpu: {FUNCTION}: cu_seqlens must rise from 0 to at most T = {T} over q packed "
                         f"as [1, T, ...]; got cu_seqlens = {cu}, q of shape {tuple(q.shape)}")
    return list(zip(cu, cu[1:]))


def _pool_plan(indices, num_accepted_tokens, bounds, initial_state, final_state, inplace):
    """(the slot each sequence reads, the rows each writes per token) of a pooled call, refusing
    what fla's kernel leaves to memory outside the pool or to the order of its programs."""
    if final_state is None:
        refuse(FUNCTION, "ssm_state_indices", "a tensor", why="with inplace_final_state=False and "
               "output_final_state=False is not emulated (fla's kernel then stores every token's state nowhere)")
    if indices.dim() not in (1, 2) or indices.dtype.is_floating_point:
        raise ValueError(f"fla_on_cpu: {FUNCTION}: ssm_state_indices must be integer [N] or [N, columns], "
                         f"got {indices.dtype} of shape {tuple(indices.shape)}")
    if indices.shape[0] < len(bounds):
        raise ValueError(f"fla_on_cpu: {FUNCTION}: ssm_state_indices needs a row per sequence ({len(bounds)}), "
                         f"got shape {tuple(indices.shape)}")
    columns = 1 if indices.dim() == 1 else indices.shape[1]
    if indices.dim() == 2 and columns > 1 and indices.stride(1) != 1:
        refuse(FUNCTION, "ssm_state_indices", f"a tensor of strides {indices.stride()}",
               why="is not emulated: fla's kernel steps along a row one element at a time, whatever its stride")
    table = indices.reshape(indices.shape[0], columns).tolist()
    accepted = None if num_accepted_tokens is None else [int(a) for a in num_accepted_tokens.tolist()]
    slots = initial_state.shape[0] if initial_state is not None else None
    reads, writes = [], []
    for n, (bos, eos) in enumerate(bounds):
        read_column = 0 if accepted is None else accepted[n] - 1
        if eos == bos:
            reads.append(None)
            writes.append([])
            continue
        if indices.dim() == 1 and (eos - bos > 1 or read_column != 0):
            refuse(FUNCTION, "ssm_state_indices", "a 1-D tensor", why=f"is not emulated for sequence {n} of "
                   f"{eos - bos} token(s), num_accepted_tokens {accepted and accepted[n]}: fla's kernel reads and "
                   "writes entry n + column, another sequence's")
        if not 0 <= read_column < columns or eos - bos > columns:
            refuse(FUNCTION, "num_accepted_tokens" if accepted else "ssm_state_indices", "a tensor",
                   why=f"is not emulated for sequence {n}: it reads column {read_column} and writes columns "
                   f"0..{eos - bos - 1} of an index row of {columns} (fla's kernel goes past the row)")
        row = table[n]
        reads.append(_slot(row[read_column], slots, n) if initial_state is not None else None)
        writes.append([_slot(row[t], slots, n) for t in range(eos - bos)] if inplace
                      else [_row(bos + t, final_state.shape[0], n) for t in range(eos - bos)])
    _refuse_shared_slots(reads, writes, inplace)
    return reads, writes


def _slot(index, slots, n):
    if index < 0 or (slots is not None and index >= slots):
        refuse(FUNCTION, "ssm_state_indices", index, why=f"(sequence {n}) is not emulated: fla 0.6.0's kernel has "
               f"no padding sentinel and reads and writes outside the pool of {slots} slots; give a padding row "
               "zero tokens (a repeated cu_seqlens entry), which it skips")
    return index


def _row(row, rows, n):
    if row >= rows:
        refuse(FUNCTION, "inplace_final_state", False, why=f"is not emulated for sequence {n}: fla's kernel writes "
               f"token {row}'s state to row {row} of a final state of {rows} rows")
    return row


def _refuse_shared_slots(reads, writes, inplace):
    """A slot one sequence writes and another reads or writes: fla's programs race on it."""
    owner = {}
    for n, rows in enumerate(writes):
        for row in set(rows):
            if owner.setdefault(row, n) != n:
                refuse(FUNCTION, "ssm_state_indices", f"slot {row} written by sequences {owner[row]} and {n}",
                       why="is not emulated: the order of fla's parallel programs decides")
    for n, slot in enumerate(reads):
        if inplace and slot is not None and owner.get(slot, n) != n:
            refuse(FUNCTION, "ssm_state_indices", f"slot {slot} read by sequence {n}, written by {owner[slot]}",
                   why="is not emulated: the order of fla's parallel programs decides")


def _k_first(state, state_v_first):
    """A state `[HV, K, V]` from fla's layout, or back (the transpose is its own inverse)."""
    return state.transpose(-1, -2) if state_v_first else state


PATCHES = {"fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd": fused_recurrent_kda_fwd}
