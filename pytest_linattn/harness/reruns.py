"""References kept across the reruns of one test: the harness's keys for them.

Collective mutants rerun a test once per mutant; while the mutation recorder keeps references
(`keep_references`, pytest_linattn.mutation.reruns), `kept(key, compute)` computes once per key.
The harness's keys hold `digest`s of the tensors a reference reads, so a rerun that changed them
computes anew.
"""
from __future__ import annotations

import hashlib

import torch

from ..mutation.reruns import keep_references, kept

__all__ = ["digest", "keep_references", "kept"]


def digest(*tensors) -> str:
    """A digest of the tensors' dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
