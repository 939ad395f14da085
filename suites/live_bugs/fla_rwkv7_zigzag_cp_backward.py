"""fla 0.6.0: chunk_rwkv7 (chunk_dplr_delta_rule) in fla's zigzag CP layout: outputs right, the gradients of
r, w, a and b wrong on a rank holding more than two sequence pieces.

    python suites/live_bugs/fla_rwkv7_zigzag_cp_backward.py [--device cuda]   # default: CPU, Triton's interpreter
Zigzag's compress_h0 (fla/ops/cp/chunk_delta_h.py:274) saves the CP initial state as rows [0, front_num_seqs];
ChunkDPLRDeltaRuleFunction.backward (fla/ops/generalized_delta_rule/dplr/chunk.py:293) expands it only when it
has one row (contiguous), so its recompute chunk_dplr_fwd_h (`h0 + (i_n*H + i_h)*K*V`) starts local sequence
i from row i: sequence 1 from the back piece's incoming state, 2.. from memory past the buffer. 2 ranks, gloo
(fla's all-gather through host memory: a test transport), float32, vs one rank, the whole batch without CP."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

DEVICE = sys.argv[2] if sys.argv[1:2] == ["--device"] else "cuda" if torch.cuda.is_available() else "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if DEVICE == "cpu":  # fla's kernels on a CPU: the interpreter, with linattn's patches
    from linattn.emulation.interpreted import prepare_process
else:  # each kernel's first config, none timed: fla's DPLR kernels autotune over dozens (minutes of compiling)
    from pytest_linattn.autotune import patch_autotuner as prepare_process
prepare_process()  # before fla's import

import fla  # noqa: E402
import fla.ops.generalized_delta_rule.dplr.chunk as dplr  # noqa: E402
from fla.ops import cp  # noqa: E402
from fla.ops.rwkv7 import chunk_rwkv7  # noqa: E402

WORLD, T, H, K, LB = 2, 64, 1, 16, -0.6065306597126334  # LB: RWKV-7's log-decay bound (RWKV7Attention's)
CU = [0, 5, 9, 30, 40, 64]  # zigzag intervals of 16: rank 0 holds 0-15 (3 pieces) and 48-63 (a state enters)


def host_gather(inp, out=None, group=None, async_op=False):  # fla.ops.cp.comm's contract, through host memory
    flat = torch.empty(WORLD * inp.shape[0], *inp.shape[1:], dtype=inp.dtype)
    dist.all_gather_into_tensor(flat, inp.cpu().contiguous(), group=group)
    return flat.view(WORLD, *inp.shape).to(inp.device) if out is None else out.copy_(flat.view(out.shape)), None


def run(index, **where):
    gen = torch.Generator().manual_seed(7)
    r, k, v, do, iclr = (torch.randn(1, T, H, K, generator=gen) for _ in range(5))
    kk, w = torch.nn.functional.normalize(k + v, dim=-1), LB * torch.sigmoid(r + do)
    values = dict(r=r, w=w, k=k, v=v, a=-kk, b=kk * iclr.sigmoid())
    leaves = {n: t[:, index].to(DEVICE).requires_grad_() for n, t in values.items()}
    o, _ = chunk_rwkv7(**leaves, scale=1.0, safe_gate=True, lower_bound=LB, chunk_size=64, **where)
    o.backward(do[:, index].to(DEVICE))
    return {"o": o.detach().cpu(), **{f"d{n}": t.grad.cpu() for n, t in leaves.items()}}


def rank_main(rank):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=rank, world_size=WORLD)
    cp.chunk_delta_h.all_gather_into_tensor = host_gather
    for module in (cp.chunk_fwd, cp.chunk_bwd, cp.chunk_merge, cp.chunk_delta_h):  # fla wants CUDA sm >= 8
        module._check_cp_device = lambda device: None
    seen, fwd_h = [], dplr.chunk_dplr_fwd_h  # the initial state each call of chunk_dplr_fwd_h starts from
    dplr.chunk_dplr_fwd_h = lambda **kw: seen.append(list(kw["initial_state"].shape)) or fwd_h(**kw)
    ctx = cp.build_cp_context(torch.tensor(CU, device=DEVICE), group=dist.group.WORLD, layout="zigzag")
    index = torch.cat([torch.arange(i * 16, i * 16 + 16) for i in (rank, 2 * WORLD - 1 - rank)])
    zigzag = run(index, cp_context=ctx)
    dplr.compress_h0, dplr.chunk_dplr_fwd_h = (lambda h0, context: h0), fwd_h  # the full [N, H, K, V] state saved
    full, ref = run(index, cp_context=ctx), run(torch.arange(T), cu_seqlens=torch.tensor(CU, device=DEVICE))
    err = lambda a, b: f"{float((a - b).norm() / b.norm()):.2e}"  # noqa: E731
    errs = lambda res: ", ".join(f"{n} {err(res[n], ref[n][:, index])}" for n in ref)  # noqa: E731
    cu, dr = ctx.cu_seqlens.tolist(), ref["dr"][:, index]
    per_seq = ", ".join(f"{i} {err(zigzag['dr'][:, a:b], dr[:, a:b])}" for i, (a, b) in enumerate(zip(cu, cu[1:])))
    dist.all_gather_object(lines := [None] * WORLD, (
        f"  rank {rank}, local cu_seqlens {cu}, front piece {ctx.front_num_seqs} sequences: {errs(zigzag)}\n    "
        f"chunk_dplr_fwd_h's initial state: forward {seen[0]}, backward {seen[1]}; dr per local sequence: {per_seq}",
        f"  rank {rank}: {errs(full)}"))
    if rank == 0:
        print(f"fla {fla.__version__}, torch {torch.__version__}, {DEVICE}" + " (Triton interpreter)" * (DEVICE == "cpu"),
              f"chunk_rwkv7, float32, H {H}, K = V {K}, cu_seqlens {CU}: zigzag CP over {WORLD} ranks vs one rank:",
              *(z for z, _ in lines), "with compress_h0 the identity in fla's dplr/chunk.py (the full state saved):",
              *(f for _, f in lines), sep="\n", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(rank_main, nprocs=WORLD)
