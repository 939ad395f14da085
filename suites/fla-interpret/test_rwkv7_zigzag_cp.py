"""fla's chunk_rwkv7 (RWKV-7's DPLR recurrence, chunk_dplr_delta_rule) with fla's zigzag CP context at CP 2,
its kernels interpreted, against the same op on one rank over the whole batch without CP: each rank's output
and input gradients within fidelity.RTOL.

Where it breaks (fla 0.6.0): the forward saves the CP initial state compressed; in the zigzag layout
compress_h0 (fla/ops/cp/chunk_delta_h.py) keeps rows [0, front_num_seqs], and
ChunkDPLRDeltaRuleFunction.backward (fla/ops/generalized_delta_rule/dplr/chunk.py) calls expand_h0 only
when the saved state has one row (the contiguous layout's). So on a rank holding more than two sequence
pieces its backward recomputes the chunk states (chunk_dplr_fwd_h, `h0 + (i_n*H + i_h)*K*V`) with local
sequence i starting from row i of the 2-row buffer: sequence 1 from the back piece's incoming state,
sequences 2.. from memory past it. The outputs are right (the forward used the full state); dr, dw, da
and db are not (dk and dv come out right). GDN's, KDA's and GDN-2's backwards expand unconditionally;
with disable_recompute=True (the states saved, not recomputed) the same run matches. This is what fails
the RWKV-7 client on GPUs in fla's zigzag layout (the comment above the xfail in
suites/gpu-4/test_fla_families_gpu4.py gives the evidence); there the rows past the buffer hold other
tensors' values, here the interpreter's reads give NaN and Inf.

Two tests: the strict xfail (the comparison), and the same run with compress_h0 the identity in fla's
dplr chunk module (the full [N, H, K, V] state saved), which matches: the place the xfail breaks.
Repro: suites/live_bugs/fla_rwkv7_zigzag_cp_backward.py.
"""

import pytest
import torch

from fidelity import RTOL
from pytest_linattn import assert_parity

CP, T, H, K = 2, 64, 1, 16
CU = [0, 5, 9, 30, 40, 64]  # zigzag intervals of 16: each rank holds 4 pieces, a state entering its back interval
LOWER_BOUND = -0.6065306597126334  # RWKV-7's log-decay bound (fla's RWKV7Attention)


def _run(index, **where):
    from fla.ops.rwkv7 import chunk_rwkv7

    gen = torch.Generator().manual_seed(7300)
    r, k, v, do, iclr = (torch.randn(1, T, H, K, generator=gen) for _ in range(5))
    kk = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    w = LOWER_BOUND * torch.sigmoid(torch.randn(1, T, H, K, generator=gen))
    values = dict(r=r, w=w, k=k, v=v, a=-kk, b=kk * torch.sigmoid(iclr))
    leaves = {n: t[:, index].clone().requires_grad_() for n, t in values.items()}
    o, _ = chunk_rwkv7(**leaves, scale=1.0, safe_gate=True, lower_bound=LOWER_BOUND, chunk_size=64, **where)
    o.backward(do[:, index])
    return {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _rank(full_state):
    """This rank's zigzag run (full_state: with compress_h0 the identity), the initial-state shapes
    chunk_dplr_fwd_h got, and the one-rank run at this rank's tokens."""
    import fla.ops.generalized_delta_rule.dplr.chunk as dplr
    import torch.distributed as dist
    from fla.ops import cp

    rank, part = dist.get_rank(), T // (2 * CP)
    index = torch.cat([torch.arange(i * part, (i + 1) * part) for i in (rank, 2 * CP - 1 - rank)])
    ctx = cp.build_cp_context(torch.tensor(CU), group=dist.group.WORLD, layout="zigzag")
    seen, fwd_h, compress = [], dplr.chunk_dplr_fwd_h, dplr.compress_h0
    dplr.chunk_dplr_fwd_h = lambda **kw: seen.append(tuple(kw["initial_state"].shape)) or fwd_h(**kw)
    if full_state:
        dplr.compress_h0 = lambda h0, context: h0
    try:  # the ranks are pooled: fla's module is put back whatever happens
        zigzag = _run(index, cp_context=ctx)
    finally:
        dplr.chunk_dplr_fwd_h, dplr.compress_h0 = fwd_h, compress
    one = {n: t[:, index] for n, t in _run(torch.arange(T), cu_seqlens=torch.tensor(CU)).items()}
    return ctx.cu_seqlens.tolist(), seen, zigzag, one


@pytest.mark.world_size(CP)
def test_rwkv7_zigzag_cp2_with_the_full_state_saved_matches_one_rank(spawn):
    for rank, (cu, _, zigzag, one) in enumerate(spawn(_rank, CP, True)):
        assert len(cu) - 1 > 2, f"rank {rank} holds {len(cu) - 1} sequence pieces: the case needs more than 2"
        assert_parity(zigzag, one, rtol=RTOL, name=f"rank {rank}, compress_h0 the identity",
                      cu_seqlens=torch.tensor(cu))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "fla 0.6.0's DPLR backward in fla's zigzag CP layout: zigzag's compress_h0 saves the initial state as rows "
    "[0, front_num_seqs], ChunkDPLRDeltaRuleFunction.backward expands it only when it has one row, so its "
    "recompute (chunk_dplr_fwd_h) starts local sequence i from row i (sequence 1 from the back piece's state, "
    "2.. past the buffer): dr, dw, da, db wrong on ranks holding more than two sequence pieces"))
@pytest.mark.world_size(CP)
def test_rwkv7_zigzag_cp2_matches_one_rank(spawn):
    for rank, (cu, seen, zigzag, one) in enumerate(spawn(_rank, CP, False)):
        name = (f"rank {rank} (chunk_dplr_fwd_h's initial state: forward {list(seen[0])}, backward's recompute "
                f"{list(seen[1])}, for {len(cu) - 1} local sequences)")
        assert_parity(zigzag, one, rtol=RTOL, name=name, cu_seqlens=torch.tensor(cu))
