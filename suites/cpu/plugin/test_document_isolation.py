"""assert_document_isolation on linattn's layers inside a small decoder stack (clients.isolation):
the right plumbing isolates documents bitwise under cu_seqlens and position_ids feeds; each
planted plumbing bug (the decoder drops cu_seqlens, never reads position_ids, or gives the
boundaries to the conv but not to the recurrence) is caught with the perturbed and the leaking
document and token; bad arguments and empty, NaN or non-deterministic models are refused."""

import pytest
import torch

from clients.isolation import ConvOnlyBoundaries, DecoderStack, DropsCuSeqlens, IgnoresPositionIds, stack_call
from cases.layer_parity import make_config
from pytest_linattn.harness import PackedDocuments, assert_document_isolation

DOCUMENTS = [6, 5, 7]  # every document longer than the conv's reach (W - 1 = 3 tokens)


def _inputs(seed=1, documents=DOCUMENTS, hidden=20):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, sum(documents), hidden, generator=gen, dtype=torch.float64)


@pytest.fixture(scope="module")
def gdn_config():
    return make_config("qwen3_next", 1)


@pytest.mark.parametrize("family, feed", [("qwen3_next", "cu_seqlens"), ("kda", "position_ids")])
def test_decoder_stack_isolates_documents(family, feed):
    stack = DecoderStack(make_config(family, 1), seed=3)
    runs = assert_document_isolation(stack_call(stack), _inputs(), DOCUMENTS, feed=feed, seed=4, name=family)
    assert [(r.document, r.token, r.global_token) for r in runs] == [(0, 5, 5), (1, 4, 10), (2, 6, 17)]


def test_decoder_dropping_cu_seqlens_is_caught(gdn_config):
    # model-level packing plumbing: the boundaries stop at the decoder
    stack = DropsCuSeqlens(gdn_config, seed=3)
    with pytest.raises(AssertionError) as info:
        assert_document_isolation(stack_call(stack), _inputs(), DOCUMENTS, feed="cu_seqlens", seed=4, name="drops")
    report = str(info.value)
    assert report.startswith("document isolation failed for drops (feed cu_seqlens, seed 4, documents [6, 5, 7]): "
                             "4 failing check(s) in 3 perturbed document(s)")
    assert ("perturbing document 0 token 5 (global 5): document 1's outputs changed from its token 0 (global 6) "
            "on; 12 token(s) in 2 other document(s) changed, max |diff| ") in report
    assert "a loss on document 1 alone: document 0's inputs got gradient from its token 0 (global 0) on" in report
    assert "perturbing document 2" not in report  # the last document has nothing after it to leak into


def test_decoder_ignoring_position_ids_is_caught_only_under_position_ids(gdn_config):
    stack = IgnoresPositionIds(gdn_config, layers=1, seed=3)
    assert_document_isolation(stack_call(stack), _inputs(), DOCUMENTS, feed="cu_seqlens", seed=4, gradients=False)
    with pytest.raises(AssertionError, match=r"\(feed position_ids, .*\n  perturbing document 0 token 5 \(global 5\): "
                                             r"document 1's outputs changed from its token 0 \(global 6\) on"):
        assert_document_isolation(stack_call(stack), _inputs(), DOCUMENTS, feed="position_ids", seed=4,
                                  perturbed=[0], gradients=False)


def test_recurrence_without_boundaries_is_caught_beyond_the_conv_reach(gdn_config):
    # the conv gets cu_seqlens, the delta rule does not: a document's first token is 6 tokens
    # before the next document, out of the conv's reach, so only the recurrence carries it across
    stack = ConvOnlyBoundaries(gdn_config, layers=1, seed=3)
    with pytest.raises(AssertionError) as info:
        assert_document_isolation(stack_call(stack), _inputs(), DOCUMENTS, seed=4, token="first", perturbed=[0],
                                  gradients=False, name="conv-only")
    assert str(info.value).splitlines()[1] == (
        "  perturbing document 0 token 0 (global 0): document 1's outputs changed from its token 0 (global 6) "
        + str(info.value).splitlines()[1].split("(global 6) ", 1)[1])
    assert "12 token(s) in 2 other document(s) changed" in str(info.value)


def test_sample_of_documents_is_seeded():
    documents = [3, 4, 5, 4, 6]
    x = _inputs(documents=documents)
    first = assert_document_isolation(_mixing_model, x, documents, perturbed=2, token="random", seed=7)
    again = assert_document_isolation(_mixing_model, x, documents, perturbed=2, token="random", seed=7)
    assert first == again and len({r.document for r in first}) == 2
    for r in first:
        assert 0 <= r.token < documents[r.document]
        assert r.global_token == sum(documents[:r.document]) + r.token


def test_packed_documents_feeds():
    docs = PackedDocuments([2, 3])
    assert docs.cu_seqlens.tolist() == [0, 2, 5] and docs.cu_seqlens.dtype == torch.int32
    assert docs.position_ids.tolist() == [[0, 1, 0, 1, 2]]
    mask = docs.kwargs("attention_mask")["attention_mask"]
    assert mask.shape == (1, 1, 5, 5) and mask[0, 0, 2].tolist() == [False, False, True, False, False]
    flash = docs.kwargs("flash_kwargs")
    assert flash["max_length_q"] == 3 and flash["seq_idx"].tolist() == [[0, 0, 1, 1, 1]]
    assert docs.kwargs(lambda d: {"lengths": d.lengths}) == {"lengths": (2, 3)}
    assert docs.locate(4) == (1, 2)


def _mixing_model(inputs, cu_seqlens=None):
    # per-token map: isolated whatever the boundaries
    return torch.tanh(inputs * 1.5)


@pytest.mark.parametrize("kwargs, rule", [
    (dict(inputs=_inputs().float()), "inputs must be float64"),
    (dict(inputs=_inputs()[0]), r"inputs must be a packed \[1, T, hidden\] tensor"),
    (dict(inputs=torch.zeros(1, 18, 20, dtype=torch.float64)), "inputs must be finite and not all zeros"),
    (dict(documents=[6, 5, 6]), r"inputs must hold sum\(documents\) = 17 tokens, got 18"),
    (dict(documents=[18]), "documents must be at least 2 document lengths"),
    (dict(documents=[6, 0, 12]), r"documents\[1\] must be a positive int"),
    (dict(feed="segments"), "feed must be one of"),
    (dict(token="middle"), "token must be one of"),
    (dict(perturbed=4), "perturbed must be at most the 3 documents"),
    (dict(perturbed=[0, 3]), r"perturbed must be None, a sample size or document indices in \[0, 3\)"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(model_call=lambda x, **kw: (x,)), r"model_call's output must be a tensor \[1, T, ...\] or \[T, ...\]"),
    (dict(model_call=lambda x, **kw: x[:, :4]), r"model_call's output must be .* with T = 18 tokens, got \(1, 4, 20\)"),
])
def test_bad_arguments_name_the_rule(kwargs, rule):
    args = dict(model_call=_mixing_model, inputs=_inputs(), documents=DOCUMENTS)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rule):
        assert_document_isolation(args.pop("model_call"), args.pop("inputs"), args.pop("documents"), **args)


def test_per_token_model_passes_and_its_gradient_stays_home():
    runs = assert_document_isolation(_mixing_model, _inputs(), DOCUMENTS)
    assert len(runs) == 3


def test_model_ignoring_its_inputs_is_refused_as_an_empty_check():
    fixed = torch.randn(1, 18, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"perturbing document 0 token 5 \(global 5\): no output of document 0 "
                                             r"changed, so the check sees nothing"):
        assert_document_isolation(lambda x, **kw: fixed + 0 * x, _inputs(), DOCUMENTS, gradients=False)


def test_nan_never_passes():
    def nan_in_document_1(x, **kw):
        y = x.clone()
        y[0, 8] = float("nan")
        return y

    with pytest.raises(AssertionError, match=r"the unperturbed output holds NaN or Inf at document 1 token 2 \(global 8\)"):
        assert_document_isolation(nan_in_document_1, _inputs(), DOCUMENTS)


def test_non_deterministic_model_is_named():
    calls = []

    def noisy(x, **kw):
        calls.append(1)
        return x + 1e-12 * len(calls)

    with pytest.raises(AssertionError, match="model_call is not deterministic: two calls on the same inputs differ "
                                             "from document 0 token 0 on"):
        assert_document_isolation(noisy, _inputs(), DOCUMENTS)


def test_batch_wide_statistic_leaks_backwards_and_is_caught():
    # a normalisation over the whole packed row (not per document): every document reads every other
    def row_norm(x, **kw):
        return x / x.pow(2).mean().sqrt()

    with pytest.raises(AssertionError, match=r"perturbing document 2 token 6 \(global 17\): document 0's outputs "
                                             r"changed from its token 0 \(global 0\) on; 11 token\(s\)"):
        assert_document_isolation(row_norm, _inputs(), DOCUMENTS)
