"""Document isolation of a whole model or decoder stack on a packed batch: perturb one token of
document i; only document i's outputs may change, bitwise, and a loss on document i alone may
send gradient only to document i's inputs (exactly zero elsewhere).

A layer that is right once `cu_seqlens` reaches it still leaks when the model around it never
passes the boundaries (it reads `position_ids` the decoder drops, or a torch fallback swallows
the kwarg): the recurrence runs through document boundaries and the loss still falls. This check
needs no reference and no weights of its own, so it runs on any model in float64.

The model gets the boundaries the way a framework feeds packed data (`FEEDS`):

    cu_seqlens      {"cu_seqlens": int32 [N + 1]}: linattn's, fla's and Megatron's layer contract
    flash_kwargs    transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True,
                    return_seq_idx=True): position_ids restarting at 0 per document, cu_seq_lens_q
                    / _k (int32), max_length_q / _k, seq_idx (int32 `[1, T]`, the document of each token)
    position_ids    position_ids only, restarting at 0 per document (the collator's default)
    attention_mask  a block-diagonal causal mask `[1, 1, T, T]`, bool (True: may attend)

or a callable `feed(documents: PackedDocuments) -> dict` for any other convention. This module
imports no pytest.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence

import torch

from linattn.checks import positive_int

from .placement import check_seed

__all__ = ["FEEDS", "PERTURBED_TOKENS", "PackedDocuments", "Perturbation", "assert_document_isolation"]

FEEDS = ("cu_seqlens", "flash_kwargs", "position_ids", "attention_mask")
PERTURBED_TOKENS = ("last", "first", "random")


@dataclasses.dataclass(frozen=True)
class PackedDocuments:
    """Documents of `lengths` tokens packed into one row of T = sum(lengths) tokens, and the
    boundary conventions frameworks feed a model (`kwargs(feed)`)."""

    lengths: tuple

    def __post_init__(self):
        lengths = tuple(self.lengths) if isinstance(self.lengths, Sequence) else None
        if lengths is None or len(lengths) < 2:
            raise ValueError(f"documents must be at least 2 document lengths, got {self.lengths!r}")
        for d, length in enumerate(lengths):
            positive_int(length, f"documents[{d}]")
        object.__setattr__(self, "lengths", tuple(int(n) for n in lengths))

    @property
    def bounds(self) -> tuple:
        out = [0]
        for length in self.lengths:
            out.append(out[-1] + length)
        return tuple(out)

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor(self.bounds, dtype=torch.int32)

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.cat([torch.arange(n) for n in self.lengths]).unsqueeze(0)

    @property
    def document_ids(self) -> torch.Tensor:
        return torch.cat([torch.full((n,), d) for d, n in enumerate(self.lengths)])

    def block_causal_mask(self) -> torch.Tensor:
        """`[1, 1, T, T]` bool: token t may attend to token s iff s <= t in the same document."""
        ids = self.document_ids
        same = ids[:, None] == ids[None, :]
        return (same & torch.ones(self.total, self.total, dtype=torch.bool).tril())[None, None]

    def locate(self, token: int) -> tuple:
        """(document, token within it) of a packed token index."""
        bounds = self.bounds
        d = next(i for i in range(len(self.lengths)) if token < bounds[i + 1])
        return d, token - bounds[d]

    def kwargs(self, feed) -> dict:
        """The keyword arguments `model_call` gets under `feed` (one of FEEDS, or a callable)."""
        if callable(feed):
            out = feed(self)
            if not isinstance(out, dict):
                raise ValueError(f"feed must return a dict of keyword arguments, got {type(out).__name__}")
            return out
        if feed == "cu_seqlens":
            return {"cu_seqlens": self.cu_seqlens}
        if feed == "flash_kwargs":
            cu, longest = self.cu_seqlens, max(self.lengths)
            return {"position_ids": self.position_ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
                    "max_length_q": longest, "max_length_k": longest,
                    "seq_idx": self.document_ids.to(torch.int32).unsqueeze(0)}
        if feed == "position_ids":
            return {"position_ids": self.position_ids}
        if feed == "attention_mask":
            return {"attention_mask": self.block_causal_mask()}
        raise ValueError(f"feed must be one of {FEEDS} or a callable, got {feed!r}")


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """One run of the check: the perturbed document and token (within the document and global)."""

    document: int
    token: int
    global_token: int


def assert_document_isolation(model_call: Callable, inputs: torch.Tensor, documents, *, feed="cu_seqlens",
                              seed: int = 0, perturbed=None, token: str = "last", gradients: bool = True,
                              name: str = "") -> tuple:
    """Perturb one token of each perturbed document in turn and require every other document's
    outputs bitwise unchanged (and, with `gradients`, zero gradient on other documents' inputs
    from a loss on the perturbed document alone).

    model_call(inputs, **kwargs) -> a tensor `[1, T, ...]` or `[T, ...]`: the model's outputs
    per token (hidden states or logits); kwargs are `documents.kwargs(feed)`.
    inputs: float64 `[1, T, hidden]`, the input embeddings (random, never zeros).
    documents: the document lengths (sum T, at least 2) or a PackedDocuments.
    perturbed: None (every document), an int k (a sample of k documents drawn with `seed`), or a
    sequence of document indices. token: which token of a document is perturbed: "last" (the
    token whose leak into the next document is shortest: a short conv's reach), "first" or
    "random". The perturbation, the sample and the loss weights are drawn with `seed`.

    Returns the perturbations run. AssertionError naming, for each leaking run, the perturbed
    document and token, the first leaking document and token, and the size of the leak; also
    when the model is not deterministic, an output is NaN or Inf, or a perturbation changes
    nothing in its own document (the check would be empty)."""
    __tracebackhide__ = True
    docs = documents if isinstance(documents, PackedDocuments) else PackedDocuments(documents)
    _check_inputs(model_call, inputs, docs, feed, seed, token)
    picks = _perturbed_documents(perturbed, len(docs.lengths), seed)
    kwargs = docs.kwargs(feed)
    feed_name = feed if isinstance(feed, str) else getattr(feed, "__name__", "custom")
    gen = torch.Generator().manual_seed(seed)
    header = (f"document isolation failed for {name or 'model'} (feed {feed_name}, seed {seed}, documents "
              f"{list(docs.lengths)})")

    with torch.no_grad():
        base = _per_token(model_call(inputs, **kwargs), docs.total, "model_call's output")
        again = _per_token(model_call(inputs, **kwargs), docs.total, "model_call's output")
    _require_finite(base, docs, header, "the unperturbed output")
    if not torch.equal(base, again):
        leak = _changed(base, again, docs, exclude=None)
        raise AssertionError(f"{header}: model_call is not deterministic: two calls on the same inputs differ "
                             f"from document {leak.document} token {leak.token} on, max |diff| {leak.size:.3e}; "
                             f"a bitwise check needs a deterministic model (float64 on the CPU)")

    runs, failures = [], []
    scale = inputs.detach().pow(2).mean().sqrt().item()
    for d in picks:
        t = _pick_token(docs, d, token, gen)
        g = docs.bounds[d] + t
        run = Perturbation(d, t, g)
        runs.append(run)
        where = f"perturbing document {d} token {t} (global {g})"
        delta = torch.randn(inputs.shape[-1], generator=gen, dtype=inputs.dtype) * scale
        x = inputs.detach().clone()
        x[0, g] += delta
        with torch.no_grad():
            out = _per_token(model_call(x, **kwargs), docs.total, "model_call's output")
        if not torch.isfinite(out).all():
            bad = int((~torch.isfinite(out)).any(dim=1).nonzero()[0])
            failures.append(f"{where}: the output holds NaN or Inf at document {docs.locate(bad)[0]} token "
                            f"{docs.locate(bad)[1]} (global {bad})")
            continue
        own = slice(docs.bounds[d], docs.bounds[d + 1])
        if torch.equal(out[own], base[own]):
            failures.append(f"{where}: no output of document {d} changed, so the check sees nothing: "
                            f"model_call must compute its outputs from `inputs`")
        leak = _changed(base, out, docs, exclude=d)
        if leak is not None:
            failures.append(f"{where}: document {leak.document}'s outputs changed from its token {leak.token} "
                            f"(global {leak.global_token}) on; {leak.count} token(s) in {leak.documents} other "
                            f"document(s) changed, max |diff| {leak.size:.3e} (relative {leak.relative:.3e})")
        if gradients:
            failures.extend(_gradient_failures(model_call, inputs, kwargs, docs, d, gen))
    if failures:
        raise AssertionError(f"{header}: {len(failures)} failing check(s) in {len(runs)} perturbed document(s)\n  "
                             + "\n  ".join(failures))
    return tuple(runs)


@dataclasses.dataclass(frozen=True)
class _Leak:
    document: int
    token: int
    global_token: int
    count: int
    documents: int
    size: float
    relative: float


def _changed(base, out, docs, exclude) -> _Leak | None:
    """The first token outside document `exclude` whose output is not bitwise equal, and the size."""
    differs = (base != out).any(dim=1)
    if exclude is not None:
        differs[docs.bounds[exclude]:docs.bounds[exclude + 1]] = False
    if not differs.any():
        return None
    tokens = differs.nonzero().flatten()
    first = int(tokens[0])
    doc, t = docs.locate(first)
    size = (out[differs] - base[differs]).abs().max().item()
    ref = base[differs].abs().max().item()
    return _Leak(doc, t, first, len(tokens), len({docs.locate(int(i))[0] for i in tokens}), size,
                 size / ref if ref > 0 else math.inf)


def _gradient_failures(model_call, inputs, kwargs, docs, d, gen) -> list:
    """Backward of a random-weighted loss on document d's outputs alone: the inputs of every other
    document must get exactly zero gradient."""
    where = f"a loss on document {d} alone"
    x = inputs.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = _per_token(model_call(x, **kwargs), docs.total, "model_call's output")
        own = slice(docs.bounds[d], docs.bounds[d + 1])
        weights = torch.randn(out[own].shape, generator=gen, dtype=out.dtype)
        if not out.requires_grad:
            return [f"{where}: model_call's output has no gradient to its inputs (it must be differentiable, "
                    f"or pass gradients=False)"]
        (grad,) = torch.autograd.grad((out[own] * weights).sum(), x, allow_unused=True)
    if grad is None:
        return [f"{where}: model_call's output does not depend on `inputs`"]
    grad = grad.reshape(docs.total, -1)
    if not torch.isfinite(grad).all():
        return [f"{where}: the gradient holds NaN or Inf"]
    failures = []
    if not grad[own].abs().sum() > 0:
        failures.append(f"{where}: document {d}'s own inputs got zero gradient, so the check sees nothing")
    leak = _changed(torch.zeros_like(grad), grad, docs, exclude=d)
    if leak is not None:
        failures.append(f"{where}: document {leak.document}'s inputs got gradient from its token {leak.token} "
                        f"(global {leak.global_token}) on; {leak.count} token(s) in {leak.documents} other "
                        f"document(s), max |grad| {leak.size:.3e}")
    return failures


def _per_token(out, total: int, what: str) -> torch.Tensor:
    """`[1, T, ...]` or `[T, ...]` -> `[T, F]` (float64)."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{what} must be a tensor [1, T, ...] or [T, ...], got {type(out).__name__} "
                         f"(return the hidden states or logits from model_call)")
    if out.dim() >= 2 and out.shape[0] == 1 and out.shape[1] == total:
        out = out[0]
    elif not (out.dim() >= 1 and out.shape[0] == total):
        raise ValueError(f"{what} must be [1, T, ...] or [T, ...] with T = {total} tokens, got {tuple(out.shape)}")
    return out.reshape(total, -1)


def _require_finite(out, docs, header, what):
    if not torch.isfinite(out).all():
        bad = int((~torch.isfinite(out)).any(dim=1).nonzero()[0])
        doc, t = docs.locate(bad)
        raise AssertionError(f"{header}: {what} holds NaN or Inf at document {doc} token {t} (global {bad})")


def _check_inputs(model_call, inputs, docs, feed, seed, token):
    if not callable(model_call):
        raise ValueError(f"model_call must be callable, got {model_call!r}")
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 3 or inputs.shape[0] != 1:
        raise ValueError(f"inputs must be a packed [1, T, hidden] tensor, got {getattr(inputs, 'shape', inputs)!r}")
    if inputs.dtype != torch.float64:
        raise ValueError(f"inputs must be float64 (other documents' outputs are compared bitwise), got {inputs.dtype}")
    if inputs.shape[1] != docs.total:
        raise ValueError(f"inputs must hold sum(documents) = {docs.total} tokens, got {inputs.shape[1]}")
    if not torch.isfinite(inputs).all() or not inputs.abs().sum() > 0:
        raise ValueError("inputs must be finite and not all zeros (use fresh seeded random inputs)")
    if not callable(feed) and feed not in FEEDS:
        raise ValueError(f"feed must be one of {FEEDS} or a callable, got {feed!r}")
    check_seed(seed)
    if token not in PERTURBED_TOKENS:
        raise ValueError(f"token must be one of {PERTURBED_TOKENS}, got {token!r}")


def _perturbed_documents(perturbed, count: int, seed: int) -> list:
    if perturbed is None:
        return list(range(count))
    if isinstance(perturbed, numbers.Integral) and not isinstance(perturbed, bool):
        k = positive_int(perturbed, "perturbed")
        if k > count:
            raise ValueError(f"perturbed must be at most the {count} documents, got {k}")
        gen = torch.Generator().manual_seed(seed)
        return sorted(torch.randperm(count, generator=gen)[:k].tolist())
    picks = list(perturbed) if isinstance(perturbed, Sequence) else None
    if not picks or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or not 0 <= d < count
                        for d in picks):
        raise ValueError(f"perturbed must be None, a sample size or document indices in [0, {count}), got {perturbed!r}")
    return [int(d) for d in picks]


def _pick_token(docs, d: int, token: str, gen) -> int:
    n = docs.lengths[d]
    if token == "last":
        return n - 1
    if token == "first":
        return 0
    return int(torch.randint(n, (1,), generator=gen))
