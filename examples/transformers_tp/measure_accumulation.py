"""The q_norm / k_norm accumulation figures, by hand (no harness): run with

    .venv/bin/torchrun --nproc-per-node 2 examples/transformers_tp/measure_accumulation.py

For each tiny checkpoint (written to a temporary directory), the unsharded model and the TP 2
model run backward on ONE micro-batch k = 1, 2, 3 times without zeroing the gradients. After k
backwards the right gradient is k x G (G: the unsharded model's single-pass gradient). Printed
per parameter whose plan style is replicated_with_grad_allreduce: the TP gradient in units of G
and its relative error against k x G. Kimi Linear has no such parameter (its plan shards only
the MLPs / experts), so it prints none.
"""

import fnmatch
import os
import sys
import tempfile

import transformers_tp  # noqa: F401  - first: fla absent (transformers' torch fallbacks)

import torch
import torch.distributed as dist

from transformers_tp.checkpoints import MODELS, write_checkpoint
from transformers_tp.client import load


def _style(plan: dict, parameter: str):
    """The plan style of `parameter`'s module (plan keys are module patterns, `*` for a layer number)."""
    module = parameter.rsplit(".", 1)[0]
    return next((style for pattern, style in plan.items() if fnmatch.fnmatchcase(module, pattern)), None)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = [tempfile.mkdtemp(prefix="transformers-tp-") if rank == 0 else None]
    dist.broadcast_object_list(root)
    x = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    dy = torch.randn(1, 24, 96, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for model in MODELS:
        path = os.path.join(root[0], model)
        if rank == 0:
            write_checkpoint(model, path)
        dist.barrier()
        ref, tp = load(path), load(path, tp_size=dist.get_world_size())
        names = [n for n, _ in tp.named_parameters() if _style(tp.tp_plan, n) == "replicated_with_grad_allreduce"]
        (ref(inputs_embeds=x, use_cache=False).logits * dy).sum().backward()
        G = {n: p.grad.clone() for n, p in ref.named_parameters() if n in names}
        tp_params = dict(tp.named_parameters())
        lines = []
        for k in (1, 2, 3):
            (tp(inputs_embeds=x, use_cache=False).logits * dy).sum().backward()
            for n in names:
                g, ref_g = tp_params[n].grad, G[n]
                ratio = float(g @ ref_g / (ref_g @ ref_g))
                err = float((g - k * ref_g).norm() / (k * ref_g).norm())
                lines.append(f"  {n}: after {k} backward(s) TP grad = {ratio:.6f} x G (right: {k} x G), "
                             f"relative error {err:.3e}")
        if rank == 0:
            print(f"{model}: {len(names)} replicated_with_grad_allreduce parameter(s)", *lines, sep="\n", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
