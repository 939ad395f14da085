"""The tensor-parallel MLP against the replicated one: output and every gradient.

Uses only pytest-linattn's public surface: the `spawn`, `tp_size`, `float64_reference` and
`packed_seqlens` fixtures and `pytest_linattn.assert_parity`.
"""

import pytest
import torch
import torch.distributed as dist

from pytest_linattn import assert_parity
from tp_mlp import MLP, TensorParallelMLP

DIM, HIDDEN = 16, 64  # HIDDEN divides by every --tp size up to 8


def _tp_forward_backward(state, x, grad_output):
    """On every rank: shard the replicated weights, run forward and backward, return grads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    full = MLP(DIM, HIDDEN).to(x.dtype)
    full.load_state_dict(state)
    tp = TensorParallelMLP.from_replicated(full, rank, world).to(device)
    x = x.to(device).requires_grad_()
    y = tp(x)
    y.backward(grad_output.to(y))
    return {"y": y.detach(), "dx": x.grad, **{name: p.grad for name, p in tp.named_parameters()}}


def _gathered_param_grads(ranks):
    """The shards' gradients put back in the replicated MLP's layout."""
    return {
        "fc1.weight": torch.cat([r["fc1.weight"] for r in ranks], dim=0),
        "fc1.bias": torch.cat([r["fc1.bias"] for r in ranks], dim=0),
        "fc2.weight": torch.cat([r["fc2.weight"] for r in ranks], dim=1),
        "fc2.bias": ranks[0]["bias"],
    }


def _check(ranks, ref, rtol, cu_seqlens=None):
    for rank, out in enumerate(ranks):
        # Output and input grad are replicated: every rank must hold the full, right answer.
        assert_parity({"y": out["y"], "dx": out["dx"]}, {"y": ref.output, "dx": ref.input_grads[0]},
                      rtol=rtol, name=f"rank {rank}", cu_seqlens=cu_seqlens)
        assert torch.equal(out["bias"], ranks[0]["bias"]), "replicated bias grad differs across ranks"
    assert_parity(_gathered_param_grads(ranks), ref.param_grads, rtol=rtol, name="weight grads")


# float64: a sharding bug is an O(1) error, summation order ~1e-16; float32 shows its rounding.
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
def test_tp_mlp_matches_replicated(spawn, tp_size, float64_reference, dtype, rtol):
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    mlp = MLP(DIM, HIDDEN)
    x = torch.randn(2, 12, DIM, generator=gen)
    ref = float64_reference(mlp, x)  # float64 CPU copy; mlp itself is untouched
    state = {k: v.to(dtype) for k, v in mlp.state_dict().items()}
    ranks = spawn(_tp_forward_backward, tp_size, state, x.to(dtype), ref.grad_output)
    assert len(ranks) == tp_size
    _check(ranks, ref, rtol)


def test_tp_mlp_on_a_packed_batch(spawn, tp_size, float64_reference, packed_seqlens):
    # The MLP is token-wise, so the packing does not change the maths; cu_seqlens makes a failure
    # say which sequence and token broke.
    cu_seqlens = packed_seqlens(48, 5, seed=7)
    gen = torch.Generator().manual_seed(99)
    torch.manual_seed(99)
    mlp = MLP(DIM, HIDDEN)
    x = torch.randn(1, int(cu_seqlens[-1]), DIM, generator=gen, dtype=torch.float64)
    ref = float64_reference(mlp, x)
    state = {k: v.double() for k, v in mlp.state_dict().items()}
    ranks = spawn(_tp_forward_backward, tp_size, state, x, ref.grad_output)
    _check(ranks, ref, 1e-10, cu_seqlens=cu_seqlens)
