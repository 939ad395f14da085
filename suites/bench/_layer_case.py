"""The rank side of one sharded layer case, shared by bench_layers and bench_breakdown: the
replicated layer's weights, this rank's TP/CP groups, its shard of the layer and of the tokens,
and the timed forward + backward of a step. A case is the dict `_common.sweep` builds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from _common import DTYPES, cu_seqlens, make_config  # also puts the repository on sys.path
from _timing import measure, peak_gib, reset_peak

_WEIGHTS: dict = {}  # (shape, seed) -> replicated-layer weights on the CPU, kept across calls
_GROUPS: dict = {}  # (tp, cp) -> (tp_group, cp_group), created once per rank process


def rank_device(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def full_weights(shape: str, seed: int) -> dict:
    """The replicated layer's weights (suites/layer_parity.random_state_dict, fla's init), float32."""
    key = (shape, seed)
    if key not in _WEIGHTS:
        from cases.layer_parity import random_state_dict

        _WEIGHTS.clear()
        _WEIGHTS[key] = {n: t.float() for n, t in random_state_dict(make_config(shape), seed, fla_init=True).items()}
    return _WEIGHTS[key]


def parallel_groups(tp: int, cp: int):
    if not dist.is_initialized():
        if tp * cp > 1:
            raise ValueError(f"tp={tp} cp={cp} needs torch.distributed (run through Ranks)")
        return None, None
    if (tp, cp) not in _GROUPS:
        from linattn.parallel import new_groups

        _GROUPS[(tp, cp)] = new_groups(tp, cp)  # collective: every rank runs the same cases in order
    return _GROUPS[(tp, cp)]


def full_inputs(config, T: int, seed: int, device, dtype):
    """The whole packed batch's input and output cotangent `[1, T, hidden]`, the same on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return tuple(torch.randn(1, T, config.hidden_size, generator=gen, device=device, dtype=dtype)
                 for _ in range(2))


def build_case(case: dict, tp_group=None, cp_group=None, *, sharded=True):
    """This rank's layer and tokens for `case`: (layer, x, dy, cu_seqlens on the device).

    sharded=False: the replicated layer on the whole batch (the reference of the error columns)."""
    from cases.layer_parity import local_tokens
    from linattn.layers import build_layer, shard_state_dict
    from linattn.parallel import group_rank

    config = make_config(case["shape"])
    device, dtype = rank_device(case["device"]), DTYPES[case["dtype"]]
    tp, cp = (case["tp"], case["cp"]) if sharded else (1, 1)
    tp_group, cp_group = (tp_group, cp_group) if sharded else (None, None)
    layer = build_layer(config, tp_group=tp_group, cp_group=cp_group, cp_layout=case["layout"],
                        sequence_parallel=case["sp"] and sharded, dtype=dtype, device=device)
    tp_rank, cp_rank = group_rank(tp_group), group_rank(cp_group)
    layer.load_state_dict(shard_state_dict(full_weights(case["shape"], case["seed"]), config, tp_rank, tp))
    cu = cu_seqlens(case["tokens"], case["seqs"])
    x, dy = full_inputs(config, case["tokens"], case["seed"], device, dtype)
    if sharded:
        placement = dict(cu_seqlens=cu, tp=tp, cp=cp, layout=case["layout"], sp=case["sp"])
        x, dy = (local_tokens(t, placement, tp_rank, cp_rank).contiguous() for t in (x, dy))
    return layer, x.requires_grad_(), dy, cu.to(device)


def time_layer_step(layer, x, dy, cu, *, iters: int, warmup: int) -> dict:
    """Forward + backward of the layer on this rank's tokens: median ms (fwd, fwd+bwd), peak GiB."""
    params = list(layer.parameters())

    def reset():
        x.grad = None
        for p in params:
            p.grad = None

    if dist.is_initialized():
        dist.barrier()
    reset_peak(x.device)
    t = measure(lambda: layer(x, cu), lambda y: y.backward(dy), iters=iters, warmup=warmup,
                device=x.device, reset=reset)
    t["peak_gib"] = peak_gib(x.device)
    reset()
    return t
