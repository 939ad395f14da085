"""Document isolation of transformers 5.17's Qwen3-Next, Qwen3.5 and Kimi Linear models (layer 0
linear attention, layer 1 full attention; float64 on the CPU) on a packed row, fed as a packing
collator feeds them (isolation_clients, assert_document_isolation).

With fla installed transformers binds fla's kernels (here under fla_on_cpu, computed by linattn's
references) and its own torch conv, since causal-conv1d is not installed. Where a model leaks,
the strict xfail names transformers' behaviour; the passing runs show which piece is missing
(each differs from its xfail in that piece only)."""

import importlib
import re

import pytest
import torch

from isolation_clients import boundary_aware_conv, hf_call, hf_model, torch_fallbacks
from pytest_linattn.harness import PackedDocuments, assert_document_isolation

DOCUMENTS = [5, 4, 6]  # every document longer than the conv's reach (W - 1 = 3 tokens)
LEAK = r"perturbing document 0 token 4 \(global 4\): document 1's outputs changed from its token 0 \(global 5\) on"


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


@pytest.mark.parametrize("family, feed", [("qwen3_next", "flash_kwargs"), ("qwen3_5", "flash_kwargs"),
                                          ("kimi_linear", _with_cu_seqlens)])
def test_isolated_with_fla_kernels_and_a_conv_given_the_boundaries(fla_on_cpu, conv_with_boundaries, family, feed):
    conv_with_boundaries(family)
    assert len(_check(family, feed)) == len(DOCUMENTS)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "transformers 5.17: the decoder never passes position_ids to the linear-attention layer and the model "
    "does not derive cu_seq_lens from them (huggingface/transformers #46851, fix PR #46859 closed)"))
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "kimi_linear"])
def test_position_ids_only_packing(fla_on_cpu, conv_with_boundaries, family):
    conv_with_boundaries(family)
    _leaks(family, "position_ids")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "transformers 5.17: the torch fallback causal_conv1d_fn swallows cu_seq_lens_q (**kwargs), so the "
    "short conv runs across documents (huggingface/transformers #46851: 'the current torch fallback "
    "silently fails even when the cu_seqlen inputs are passed')"))
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_flash_kwargs_through_the_torch_conv_fallback(fla_on_cpu, family):
    _leaks(family, "flash_kwargs")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "transformers 5.17: without fla, torch_chunk_gated_delta_rule takes cu_seqlens into **kwargs and "
    "runs the recurrence over the whole packed row (huggingface/transformers #46851)"))
def test_flash_kwargs_through_the_torch_delta_rule_fallback(conv_with_boundaries):
    conv_with_boundaries("qwen3_next")
    with torch_fallbacks(_modeling("qwen3_next")) as swapped:
        assert swapped >= 1
        _leaks("qwen3_next", "flash_kwargs")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "transformers 5.17: KimiDeltaAttention hands its kwargs to chunk_kda unrenamed; fla's argument is "
    "cu_seqlens, so cu_seq_lens_q is filtered out and the KDA recurrence runs over the whole packed row "
    "(Qwen3-Next renames it: cu_seqlens=kwargs.pop('cu_seq_lens_q')); no upstream report found"))
def test_kimi_linear_flash_kwargs_never_reach_chunk_kda(fla_on_cpu, conv_with_boundaries):
    conv_with_boundaries("kimi_linear")
    _leaks("kimi_linear", "flash_kwargs")


def test_flash_kwargs_feed_is_the_flattening_collators():
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True, return_tensors="pt")
    batch = collator([{"input_ids": list(range(1, n + 1))} for n in DOCUMENTS])
    feed = PackedDocuments(DOCUMENTS).kwargs("flash_kwargs")
    assert set(feed) == set(batch) - {"input_ids", "labels"}
    for key, value in feed.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, batch[key]) and value.dtype == batch[key].dtype, key
        else:
            assert value == batch[key], key
