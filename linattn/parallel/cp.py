"""Context parallelism (CP) for linear-attention ops: token layouts, the CP context, and the two
ops whose results cross a rank boundary (short conv, delta-rule recurrence).

Layouts of a packed batch of ``T`` tokens (global ``cu_seqlens``) over ``cp`` ranks, token dim 1:

- ``"contiguous"``: rank r holds tokens ``[r*T/cp, (r+1)*T/cp)`` of the packed batch.
- ``"zigzag"``: per sequence (Megatron's THD / Transformer Engine packed layout). Every sequence
  is cut into ``2*cp`` equal chunks; rank r holds chunks ``r`` and ``2*cp-1-r`` of every
  sequence, concatenated in sequence order. Hybrid models share one token layout between their
  softmax-attention layers, which need zigzag for causal load balance, and their linear-attention
  layers. Linear attention's cost is linear in tokens, so the contiguous layout is already
  balanced for it: zigzag is supported for compatibility, not for speed. Note fla's own
  ``layout="zigzag"`` cuts the whole packed batch, not each sequence, so it is not this layout.

Zigzag is handled by relayout: one all-to-all moves the tokens into the contiguous layout
(``CPContext.to_contiguous``), the contiguous machinery runs, and the inverse all-to-all moves the
result back (``CPContext.from_contiguous``). One exact code path serves both layouts; the price is
two all-to-alls of the op's inputs/outputs, small next to the projections around the op.

What crosses a rank boundary (contiguous layout):

- short conv: the ``W-1`` tokens before a piece that belong to the same sequence. They are
  gathered from the previous rank(s) (a piece may be shorter than ``W-1`` tokens, then several
  ranks contribute), prepended to the piece's first sequence; their gradient goes back by
  reduce-scatter.
- recurrence: the state ``S`` of a sequence that continues across a boundary. On CPU it is passed
  along the ranks (receive, run the piece, send the final state); backward passes ``dS`` back the
  same way. Only boundaries crossed by a sequence exchange anything (every rank knows which from
  the global ``cu_seqlens``), so unrelated pieces never wait on each other. On CUDA the op runs
  fla's chunk kernels with an fla CP context (all-gather of per-rank affine state maps), see
  ``linattn.parallel.cp_fla``.

Parameter gradients (conv weight/bias, and anything upstream of the op) stay per-rank partial
sums over the CP group: reduce them over the CP group (with the data-parallel reduction) as for
any token split.

Every rank of the CP group must call these ops in the same order, and call backward through them
if any rank does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")

__all__ = [
    "LAYOUTS",
    "CPContext",
    "build_context",
    "cp_shard",
    "cp_unshard",
    "cp_token_index",
    "short_conv",
    "delta_rule",
]


# ----------------------------------------------------------------------------------------------
# validation and token index maps


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"CP layout must be one of {LAYOUTS}, got {layout!r}")


def _check_cu_seqlens(cu_seqlens, total_tokens: int | None = None) -> torch.Tensor:
    """Global cu_seqlens as a CPU int64 tensor; ValueError if it is not a valid packing."""
    from linattn.checks import validate_cu_seqlens

    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() == 1 and cu.numel() >= 1 and total_tokens is None:
        total_tokens = int(cu[-1])
    validate_cu_seqlens(cu, total_tokens)
    return cu.detach().to("cpu", torch.int64)


def _check_divisibility(cu: torch.Tensor, cp_size: int, layout: str) -> None:
    _check_layout(layout)
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    total = int(cu[-1])
    if layout == "contiguous":
        if total % cp_size:
            raise ValueError(f"contiguous CP needs total tokens divisible by cp_size: {total} % {cp_size} != 0")
        return
    parts = 2 * cp_size
    if total % parts:
        raise ValueError(f"zigzag CP needs total tokens divisible by 2*cp_size: {total} % {parts} != 0")
    lengths = (cu[1:] - cu[:-1]).tolist()
    bad = [(i, n) for i, n in enumerate(lengths) if n % parts]
    if bad:
        raise ValueError(
            f"zigzag CP needs every sequence length divisible by 2*cp_size={parts}; "
            f"(sequence, length) violating it: {bad[:4]}"
        )


def _zigzag_index(cu: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global token indices held by ``cp_rank`` in the per-sequence zigzag layout, local order."""
    parts = 2 * cp_size
    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        chunk = (end - start) // parts
        for c in (cp_rank, parts - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def cp_token_index(cu_seqlens, cp_rank: int, cp_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Global token indices (int64, CPU) that ``cp_rank`` holds, in its local order."""
    cu = _check_cu_seqlens(cu_seqlens)
    _check_divisibility(cu, cp_size, layout)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if layout == "zigzag":
        return _zigzag_index(cu, cp_rank, cp_size)
    local = int(cu[-1]) // cp_size
    return torch.arange(cp_rank * local, (cp_rank + 1) * local)


def cp_shard(tensor: torch.Tensor, cu_seqlens, cp_rank: int, cp_size: int, layout: str = "contiguous") -> torch.Tensor:
    """The tokens (dim 1) of a full packed tensor that ``cp_rank`` holds in ``layout``.

    Differentiable (an index_select), so a test can shard a leaf and compare gradients.
    """
    cu = _check_cu_seqlens(cu_seqlens)
    if tensor.dim() < 2 or tensor.shape[1] != int(cu[-1]):
        raise ValueError(f"cp_shard needs token dim 1 of size cu_seqlens[-1]={int(cu[-1])}, got shape {tuple(tensor.shape)}")
    index = cp_token_index(cu, cp_rank, cp_size, layout)
    return tensor.index_select(1, index.to(tensor.device))


def cp_unshard(shards: Sequence[torch.Tensor], cu_seqlens, cp_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Inverse of ``cp_shard``: the full packed tensor from the ranks' shards in rank order."""
    cu = _check_cu_seqlens(cu_seqlens)
    if len(shards) != cp_size:
        raise ValueError(f"cp_unshard needs one shard per rank: got {len(shards)} for cp_size={cp_size}")
    index = torch.cat([cp_token_index(cu, r, cp_size, layout) for r in range(cp_size)])
    stacked = torch.cat(list(shards), dim=1)
    if stacked.shape[1] != int(cu[-1]):
        raise ValueError(f"cp_unshard: shards hold {stacked.shape[1]} tokens, cu_seqlens says {int(cu[-1])}")
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel())
    return stacked.index_select(1, inverse.to(stacked.device))


# ----------------------------------------------------------------------------------------------
# communication, each an autograd function named by what it does forward / backward


def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


class _RelayoutTokensAllToAll(torch.autograd.Function):
    """Forward: all-to-all tokens (dim 1 of ``[1, T, F]``) from one CP layout into another.
    Backward: the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.plan, ctx.group = plan, group
        return _relayout(x, plan.send_index, plan.recv_index, group)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        return _relayout(grad.contiguous(), plan.recv_index, plan.send_index, ctx.group), None, None


def _relayout(x: torch.Tensor, send_index, recv_index, group) -> torch.Tensor:
    # send_index[d]: local rows going to rank d; recv_index[s]: where rows from rank s land
    rows = x[0]
    send = rows.index_select(0, torch.cat(send_index).to(rows.device))
    recv = rows.new_empty((sum(len(i) for i in recv_index),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(
        recv, send,
        output_split_sizes=[len(i) for i in recv_index],
        input_split_sizes=[len(i) for i in send_index],
        group=group,
    )
    out = torch.empty_like(recv)
    out[torch.cat(recv_index).to(rows.device)] = recv
    return out.unsqueeze(0)


class _AllGatherFromCPRanks(torch.autograd.Function):
    """Forward: all-gather a per-rank tensor into ``[cp, ...]``. Backward: reduce-scatter (sum)
    the gradient, so every rank gets the gradient of its own piece from all users."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x, group=group)
        return out.view((size,) + tuple(x.shape))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty(tuple(grad.shape[1:]))
        _reduce_scatter_single(out, grad.flatten(0, 1), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


# torch >= 2.13 renames the flat collectives; older builds (GPU images) have only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ReceiveStateFromPreviousRank(torch.autograd.Function):
    """Forward: receive the incoming recurrent state from the previous CP rank.
    Backward: send the state's gradient back to that rank.

    The previous rank waits for that send, so this node must run in every backward that reaches
    this rank's graph. Its inputs make sure of it: the op's inputs (``upstream``, no gradient
    flows to them from here), so a backward restricted to some inputs (``autograd.grad``,
    ``backward(inputs=...)``) keeps the node whenever it reaches anything upstream of the op; and
    ``anchor``, an empty leaf that requires grad, for a plain backward when no op input on this
    rank requires grad."""

    @staticmethod
    def forward(ctx, shape, dtype, device, group, src, anchor, *upstream):
        ctx.group, ctx.src, ctx.num_upstream = group, src, len(upstream)
        state = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(state, src=src, group=group)
        return state

    @staticmethod
    def backward(ctx, grad):
        dist.isend(grad.contiguous(), dst=ctx.src, group=ctx.group).wait()
        return (None,) * (6 + ctx.num_upstream)


class _SendStateToNextRank(torch.autograd.Function):
    """Forward: send this piece's final state to the next CP rank; pass ``out`` through.
    Backward: receive the state's gradient from the next rank; pass ``out``'s gradient through.

    Riding on the op's output puts the receive before this rank's local backward, which needs it."""

    @staticmethod
    def forward(ctx, state, out, anchor, group, dst):
        ctx.group, ctx.dst, ctx.shape, ctx.dtype = group, dst, state.shape, state.dtype
        dist.isend(state.detach().contiguous(), dst=dst, group=group).wait()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_state = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_out.device)
        dist.recv(grad_state, src=ctx.dst, group=ctx.group)
        return grad_state, grad_out, None, None, None


def _grad_anchor(device) -> torch.Tensor | None:
    if not torch.is_grad_enabled():
        return None
    return torch.empty(0, device=device, requires_grad=True)


# ----------------------------------------------------------------------------------------------
# the CP context


@dataclass(frozen=True)
class _RelayoutPlan:
    send_index: list  # per destination rank: local rows to send
    recv_index: list  # per source rank: local rows the received tokens go to


@dataclass(eq=False)
class CPContext:
    """What the CP ops need, built once per forward by ``build_context``.

    All fields describe the contiguous piece this rank works on (after ``to_contiguous``):
    global tokens ``[start, end)``. ``prev_tokens[r]`` is how many tokens of rank r's first
    sequence lie before rank r's piece (0: the sequence starts at the piece), known for every rank
    so all ranks agree on who exchanges what.
    """

    group: object
    cp_rank: int
    cp_size: int
    layout: str
    cu_seqlens: torch.Tensor  # global, CPU int64
    local_cu_seqlens: torch.Tensor  # of the contiguous piece, CPU int64
    prev_tokens: tuple
    _plan: _RelayoutPlan | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def local_tokens(self) -> int:
        return self.total_tokens // self.cp_size

    @property
    def start(self) -> int:
        return self.cp_rank * self.local_tokens

    @property
    def end(self) -> int:
        return self.start + self.local_tokens

    @property
    def first_seq_continues(self) -> bool:
        """The piece's first sequence started on an earlier rank (state/halo come in)."""
        return self.prev_tokens[self.cp_rank] > 0

    @property
    def last_seq_continues(self) -> bool:
        """The piece's last sequence goes on on the next rank (state goes out)."""
        nxt = self.cp_rank + 1
        return nxt < self.cp_size and self.prev_tokens[nxt] > 0

    def local_cu_seqlens_on(self, device, dtype=torch.int32) -> torch.Tensor:
        key = ("cu", str(device), dtype)
        if key not in self._cache:
            self._cache[key] = self.local_cu_seqlens.to(device=device, dtype=dtype)
        return self._cache[key]

    def to_contiguous(self, *tensors: torch.Tensor):
        """Tensors ``[1, T_local, ...]`` in this context's layout -> the contiguous layout."""
        return self._relayout(tensors, inverse=False)

    def from_contiguous(self, *tensors: torch.Tensor):
        """Inverse of ``to_contiguous``."""
        return self._relayout(tensors, inverse=True)

    def _relayout(self, tensors, inverse: bool):
        for t in tensors:
            if t.dim() < 2 or t.shape[0] != 1 or t.shape[1] != self.local_tokens:
                raise ValueError(
                    f"CP tensors must be packed [1, T_local={self.local_tokens}, ...], got shape {tuple(t.shape)}"
                )
        if self._plan is None:
            return tensors[0] if len(tensors) == 1 else tensors
        plan = self._plan
        if inverse:
            plan = _RelayoutPlan(plan.recv_index, plan.send_index)
        # one all-to-all per dtype: concatenate the features of same-dtype tensors
        out = [None] * len(tensors)
        by_dtype: dict = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = [tensors[i].reshape(1, self.local_tokens, -1) for i in idx]
            moved = _RelayoutTokensAllToAll.apply(torch.cat(flat, dim=2) if len(flat) > 1 else flat[0], plan, self.group)
            for i, piece in zip(idx, moved.split([f.shape[2] for f in flat], dim=2)):
                out[i] = piece.reshape(tensors[i].shape)
        return out[0] if len(out) == 1 else tuple(out)


def build_context(
    cu_seqlens,
    total_tokens: int | None = None,
    cp_group=None,
    layout: str = "contiguous",
    *,
    cp_rank: int | None = None,
    cp_size: int | None = None,
) -> CPContext:
    """The CP context of this rank for one packed batch.

    cu_seqlens: GLOBAL boundaries of the packed batch (any integer dtype/device).
    total_tokens: global token count, checked against ``cu_seqlens[-1]`` when given.
    cp_group: the CP process group (None: the default group). ``cp_rank``/``cp_size`` override
    the group's (metadata-only use, e.g. tests of the bookkeeping without a process group).
    """
    _check_layout(layout)
    cu = _check_cu_seqlens(cu_seqlens, total_tokens)
    if cp_size is None:
        cp_size = dist.get_world_size(cp_group)
    if cp_rank is None:
        cp_rank = dist.get_rank(cp_group)
    _check_divisibility(cu, cp_size, layout)
    local = int(cu[-1]) // cp_size

    starts = torch.arange(cp_size, dtype=torch.int64) * local
    seq_of_start = torch.searchsorted(cu[1:], starts, right=True)  # sequence holding each start
    prev_tokens = tuple(int(v) for v in (starts - cu[seq_of_start.clamp(max=cu.numel() - 1)]).tolist())
    if local == 0:
        prev_tokens = (0,) * cp_size

    start, end = cp_rank * local, (cp_rank + 1) * local
    local_cu = torch.unique_consecutive(cu.clamp(min=start, max=end) - start)

    plan = None
    if layout == "zigzag" and cp_size > 1:
        plan = relayout_plan_to_contiguous(lambda rank: _zigzag_index(cu, rank, cp_size), cp_rank, cp_size, local)
    return CPContext(
        group=cp_group, cp_rank=cp_rank, cp_size=cp_size, layout=layout, cu_seqlens=cu,
        local_cu_seqlens=local_cu, prev_tokens=prev_tokens, _plan=plan,
    )


def relayout_plan_to_contiguous(tokens_of_rank: Callable[[int], torch.Tensor], cp_rank: int, cp_size: int,
                                local: int) -> _RelayoutPlan:
    """The all-to-all plan that moves this rank's tokens from a layout into the contiguous one.

    tokens_of_rank(r): the global token indices rank r holds in that layout, in its local order;
    local: tokens per rank."""
    mine = tokens_of_rank(cp_rank)
    dest = mine // local
    send_index = [torch.nonzero(dest == d).flatten() for d in range(cp_size)]
    recv_index = []
    for src in range(cp_size):
        theirs = tokens_of_rank(src)
        # the source sends its rows for us in its local order; they land at global - start
        recv_index.append(theirs[theirs // local == cp_rank] - cp_rank * local)
    return _RelayoutPlan(send_index, recv_index)


# ----------------------------------------------------------------------------------------------
# ops


def _default_conv():
    from linattn.kernels import short_conv as conv

    return conv


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    ctx: CPContext,
    conv_fn: Callable | None = None,
) -> torch.Tensor:
    """Causal depthwise short conv of this rank's tokens ``x`` ``[1, T_local, D]`` (ctx's layout)
    with each sequence's ``W-1`` earlier tokens taken from the ranks that hold them.

    conv_fn: the single-process op, ``conv_fn(x, weight, cu_seqlens=, bias=, activation=)``
    (default ``linattn.kernels.short_conv``). On CUDA with the default, fla's CP conv is used when
    every piece holds at least ``W-1`` tokens.
    """
    W = weight.shape[-1]
    if x.is_cuda and conv_fn is None and W > 1 and ctx.local_tokens >= W - 1:
        from linattn.parallel import cp_fla

        xc = ctx.to_contiguous(x)
        return ctx.from_contiguous(cp_fla.short_conv(xc, weight, bias, activation, ctx))
    conv = conv_fn or _default_conv()
    xc = ctx.to_contiguous(x)
    cu = ctx.local_cu_seqlens
    if W == 1 or not any(ctx.prev_tokens):
        y = conv(xc, weight, cu_seqlens=ctx.local_cu_seqlens_on(x.device), bias=bias, activation=activation)
        return ctx.from_contiguous(y)

    # every rank contributes its last min(W-1, T_local) tokens; the halo is the last
    # min(W-1, prev_tokens) tokens before this piece, read from the gathered tails in token order
    local = ctx.local_tokens
    n_tail = min(W - 1, local)
    tails = _AllGatherFromCPRanks.apply(xc[0, local - n_tail:], ctx.group)  # [cp, n_tail, ...]
    halo_len = min(W - 1, ctx.prev_tokens[ctx.cp_rank])
    pos = torch.arange(ctx.start - halo_len, ctx.start)
    src = pos // local
    halo = tails[src, pos - (src * local + local - n_tail)]
    x_ext = torch.cat([halo.unsqueeze(0), xc], dim=1)
    cu_ext = cu + halo_len
    cu_ext[0] = 0
    y = conv(x_ext, weight, cu_seqlens=cu_ext.to(device=x.device, dtype=torch.int32), bias=bias, activation=activation)
    return ctx.from_contiguous(y[:, halo_len:])


_OPS = ("gated_delta_rule", "kda")
_OP_ALIASES = {"gdn": "gated_delta_rule"}  # the layers' config.op names


def _resolve_op(op):
    if callable(op):
        return op
    import linattn.kernels as kernels

    return getattr(kernels, op)


def delta_rule(
    op,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
    ctx: CPContext,
) -> torch.Tensor:
    """Output ``[1, T_local, HV, V]`` of the (gated) delta rule over this rank's tokens, with the
    recurrent state of sequences crossing rank boundaries carried exactly (forward and backward).

    op: ``"gated_delta_rule"``/``"gdn"`` (g ``[1,T,HV]``), ``"kda"`` (g ``[1,T,HV,K]``), or a callable with
    ``linattn.reference``'s signature. String ops on CUDA run fla's chunk kernels with an fla CP
    context; otherwise the state is passed rank to rank around the single-process op.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dim() < 3 or t.shape[0] != 1:
            raise ValueError(f"CP delta_rule needs packed [1, T_local, ...] inputs, {name} has shape {tuple(t.shape)}")
    if isinstance(op, str):
        op = _OP_ALIASES.get(op, op)
        if op not in _OPS:
            raise ValueError(f"delta_rule op must be one of {_OPS} (or 'gdn') or a callable, got {op!r}")
    elif not callable(op):
        raise ValueError(f"delta_rule op must be one of {_OPS} (or 'gdn') or a callable, got {op!r}")
    q, k, v, g, beta = ctx.to_contiguous(q, k, v, g, beta)
    if isinstance(op, str) and q.is_cuda:
        from linattn.parallel import cp_fla

        o = cp_fla.delta_rule(op, q, k, v, g, beta, scale, use_qk_l2norm, ctx)
        return ctx.from_contiguous(o)

    fn = _resolve_op(op)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    # the state travels in float64 for float64 runs, float32 otherwise (fla's state dtype)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_seqs = ctx.local_cu_seqlens.numel() - 1
    anchor = _grad_anchor(q.device)
    initial_state = None
    if ctx.first_seq_continues:
        src = _global_rank(ctx.group, ctx.cp_rank - 1)
        upstream = [t for t in (q, k, v, g, beta) if t.requires_grad]
        state_in = _ReceiveStateFromPreviousRank.apply((HV, K, V), state_dtype, q.device, ctx.group, src,
                                                       anchor, *upstream)
        rest = state_in.new_zeros((num_seqs - 1, HV, K, V))
        initial_state = torch.cat([state_in.unsqueeze(0), rest], dim=0)
    o, final_state = fn(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=ctx.last_seq_continues,
        cu_seqlens=ctx.local_cu_seqlens_on(q.device),
        use_qk_l2norm=use_qk_l2norm,
    )
    if ctx.last_seq_continues:
        dst = _global_rank(ctx.group, ctx.cp_rank + 1)
        o = _SendStateToNextRank.apply(final_state[-1].to(state_dtype), o, anchor, ctx.group, dst)
    return ctx.from_contiguous(o)
