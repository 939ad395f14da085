"""Document isolation of transformers' Qwen3-Next, Qwen3.5 and Kimi Linear models (layer 0 linear
attention, layer 1 full attention; float64 on the CPU) on a packed row, fed as a packing collator
feeds them (clients.isolation, assert_document_isolation). Measured on transformers 5.17.0 (the
test pin) and 5.24.0; where they differ the outcome is keyed on transformers.__version__.

With fla installed transformers binds fla's kernels (here under fla_on_cpu, computed by linattn's
references) and its own torch conv, since causal-conv1d is not installed. Where a model leaks,
the strict xfail names transformers' behaviour in that version; the passing runs show which piece
is missing (each differs from its xfail in that piece only). From 5.20.0 a torch fallback handed
`cu_seqlens` or `seq_idx` raises ValueError instead of running (the packed-sequence guard in
`use_kernel_func_from_hub_with_fallback`): there the check is that it refuses."""

import importlib
import re

import pytest
import torch
import transformers
from packaging.version import Version

from clients.isolation import boundary_aware_conv, hf_call, hf_model, torch_fallbacks
from pytest_linattn.harness import PackedDocuments, assert_document_isolation

DOCUMENTS = [5, 4, 6]  # every document longer than the conv's reach (W - 1 = 3 tokens)
LEAK = r"perturbing document 0 token 4 \(global 4\): document 1's outputs changed from its token 0 \(global 5\) on"

TRANSFORMERS = Version(transformers.__version__)
# The packed-sequence guard: its source first appears in 5.20.0 (not run here); run on 5.24.0.
PACKED_GUARD = TRANSFORMERS >= Version("5.20.0")
VERSION = f"transformers {transformers.__version__}"


def _guard_refuses(function, distribution):
    return rf"`{function}` can't keep packed sequences apart without `{distribution}`"


def _modeling(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, sum(DOCUMENTS), 16, generator=gen, dtype=torch.float64)


@pytest.fixture
def conv_with_boundaries(monkeypatch):
    """Bind a conv that honours cu_seq_lens_q in place of transformers' torch conv fallback."""
    def bind(family):
        monkeypatch.setattr(_modeling(family), "causal_conv1d_fn", boundary_aware_conv)
    return bind


def _with_cu_seqlens(documents):
    # the flash kwargs plus fla's own argument name, cu_seqlens
    return {**documents.kwargs("flash_kwargs"), "cu_seqlens": documents.cu_seqlens.long()}


def flash_kwargs_without_seq_idx(documents):
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True): return_seq_idx left at its default, False
    return {k: v for k, v in documents.kwargs("flash_kwargs").items() if k != "seq_idx"}


def _check(family, feed, **options):
    return assert_document_isolation(hf_call(hf_model(family, seed=3)), _inputs(), DOCUMENTS, feed=feed, seed=2,
                                     name=family, **options)


def _leaks(family, feed):
    """The strict xfails' body: AssertionError with the located leak; any other outcome fails the
    test (pytest.fail is no AssertionError), so a change upstream shows."""
    try:
        _check(family, feed, perturbed=[0], gradients=False)
    except AssertionError as report:
        if not re.search(LEAK, str(report)):
            pytest.fail(f"a leak other than document 0 into document 1's first token: {report}")
        raise
    pytest.fail(f"{family} isolates documents under feed {feed}: transformers changed, flip this xfail")


def _refused(family, feed, function, distribution):
    """The guard's outcome: the model raises its ValueError rather than mixing documents."""
    with pytest.raises(ValueError, match=_guard_refuses(function, distribution)):
        _check(family, feed, perturbed=[0], gradients=False)


def _xfail_where_it_leaks(*, before_guard=None, with_guard=None):
    """A strict xfail (the located leak, an AssertionError) in the versions where the model leaks:
    `before_guard` names transformers' behaviour before 5.20 (5.17.0 run), `with_guard` from 5.20
    on (5.24.0 run); None where it does not leak. The reason names the version installed."""
    reason = with_guard if PACKED_GUARD else before_guard
    return pytest.mark.xfail(reason is not None, strict=True, raises=AssertionError, reason=f"{VERSION}: {reason}")


@pytest.mark.parametrize("family, feed", [("qwen3_next", "flash_kwargs"), ("qwen3_5", "flash_kwargs"),
                                          ("kimi_linear", _with_cu_seqlens)])
def test_isolated_with_fla_kernels_and_a_conv_given_the_boundaries(fla_on_cpu, conv_with_boundaries, family, feed):
    conv_with_boundaries(family)
    assert len(_check(family, feed)) == len(DOCUMENTS)


@_xfail_where_it_leaks(
    before_guard="the decoder never passes position_ids to the linear-attention layer and the model does not "
                 "derive cu_seq_lens from them (huggingface/transformers #46851, fix PR #46859 closed)",
    with_guard="as in 5.17: the decoder layer calls the linear-attention layer without position_ids and nothing "
               "derives cu_seq_lens from them (huggingface/transformers #46851, closed); with neither cu_seqlens "
               "nor seq_idx in the kwargs the packed-sequence guard stays silent")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear"])
def test_position_ids_only_packing(fla_on_cpu, conv_with_boundaries, family):
    conv_with_boundaries(family)
    _leaks(family, "position_ids")


@_xfail_where_it_leaks(
    before_guard="the torch fallback causal_conv1d_fn swallows cu_seq_lens_q (**kwargs), so the short conv runs "
                 "across documents (huggingface/transformers #46851: 'the current torch fallback silently fails "
                 "even when the cu_seqlen inputs are passed'); Kimi Linear's chunk_kda never gets them either")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear"])
def test_flash_kwargs_through_the_torch_conv_fallback(fla_on_cpu, family):
    """From 5.20 the collator's seq_idx reaches the torch conv's wrapper, and its guard refuses."""
    if PACKED_GUARD:
        _refused(family, "flash_kwargs", "causal_conv1d_fn", "causal_conv1d")
    else:
        _leaks(family, "flash_kwargs")


@_xfail_where_it_leaks(
    before_guard="the torch fallback causal_conv1d_fn swallows cu_seq_lens_q (**kwargs), so the short conv runs "
                 "across documents (huggingface/transformers #46851); Kimi Linear's chunk_kda never gets them "
                 "either",
    with_guard="the packed-sequence guard of use_kernel_func_from_hub_with_fallback looks for cu_seqlens or "
               "seq_idx only; the models hand causal_conv1d_fn cu_seq_lens_q, so without seq_idx (the "
               "flattening collator's default) the torch conv fallback still runs across documents, silently; "
               "Kimi Linear's chunk_kda never gets cu_seq_lens_q either")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear"])
def test_flash_kwargs_without_seq_idx_through_the_torch_conv_fallback(fla_on_cpu, family):
    _leaks(family, flash_kwargs_without_seq_idx)


@_xfail_where_it_leaks(
    before_guard="without fla, torch_chunk_gated_delta_rule takes cu_seqlens into **kwargs and runs the "
                 "recurrence over the whole packed row (huggingface/transformers #46851)")
def test_flash_kwargs_through_the_torch_delta_rule_fallback(conv_with_boundaries):
    """Without fla. From 5.20 the model hands the torch delta rule cu_seqlens and the guard refuses."""
    conv_with_boundaries("qwen3_next")
    with torch_fallbacks(_modeling("qwen3_next")) as rebound:
        assert rebound >= 1
        if PACKED_GUARD:
            _refused("qwen3_next", "flash_kwargs", "chunk_gated_delta_rule", "flash-linear-attention")
        else:
            _leaks("qwen3_next", "flash_kwargs")


@_xfail_where_it_leaks(
    before_guard="KimiDeltaAttention hands its kwargs to chunk_kda unrenamed; fla's argument is cu_seqlens, so "
                 "cu_seq_lens_q is filtered out and the KDA recurrence runs over the whole packed row (Qwen3-Next "
                 "renames it: cu_seqlens=kwargs.pop('cu_seq_lens_q')); no upstream report found",
    with_guard="as in 5.17: KimiDeltaAttention.forward hands chunk_kimi_delta_attention its kwargs unrenamed; "
               "the wrapper keeps only fla's parameters, so cu_seq_lens_q is dropped and the KDA recurrence runs "
               "over the whole packed row (the packed-sequence guard watches torch fallbacks only); no upstream "
               "report found")
def test_kimi_linear_flash_kwargs_never_reach_chunk_kda(fla_on_cpu, conv_with_boundaries):
    conv_with_boundaries("kimi_linear")
    _leaks("kimi_linear", "flash_kwargs")


_MASK_REASON = ("create_recurrent_attention_mask returns None for a 4D mask, so a block-diagonal mask reaches the "
                "full-attention layer only and the linear-attention layer runs over the whole packed row")


@_xfail_where_it_leaks(before_guard=_MASK_REASON, with_guard=f"as in 5.17: {_MASK_REASON}")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear"])
def test_block_diagonal_mask_packing(fla_on_cpu, conv_with_boundaries, family):
    conv_with_boundaries(family)
    _leaks(family, "attention_mask")


@pytest.mark.parametrize("return_seq_idx", [True, False])
def test_flash_kwargs_feed_is_the_flattening_collators(return_seq_idx):
    from transformers import DataCollatorWithFlattening

    options = {"return_seq_idx": True} if return_seq_idx else {}  # False: the collator's default
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt", **options)
    batch = collator([{"input_ids": list(range(1, n + 1))} for n in DOCUMENTS])
    documents = PackedDocuments(DOCUMENTS)
    feed = documents.kwargs("flash_kwargs") if return_seq_idx else flash_kwargs_without_seq_idx(documents)
    assert set(feed) == set(batch) - {"input_ids", "labels"}
    for key, value in feed.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, batch[key]) and value.dtype == batch[key].dtype, key
        else:
            assert value == batch[key], key
