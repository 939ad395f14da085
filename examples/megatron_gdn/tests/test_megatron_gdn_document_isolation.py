"""Document isolation of megatron-core 0.19.2's GatedDeltaNet on its packed path
(pytest_linattn.harness.assert_document_isolation, feed "cu_seqlens").

The layer is the example's, single rank (TP 1, CP 1: Megatron's parallel_state over a one-process
gloo group in the test process), float64, weights from the tests' seeded reference. The check's
`cu_seqlens` reaches it as Megatron's packed batches do: THD, `[T, 1, hidden]` with
`PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens_kv=cu_seqlens, max_seqlen_*)`
(megatron_gdn.client.forward_packed). Every document is perturbed in turn, its first and its last
token; a loss on each document alone must leave zero gradient on every other document's inputs
(Megatron's backward runs on the CPU). Megatron's fla calls (l2norm, causal_conv1d with
cu_seqlens, chunk_gated_delta_rule with cu_seqlens) compute under fla_on_cpu.
"""

import re

import pytest
import torch
import torch.distributed as dist

from megatron_gdn import client, cpu
from megatron.core import parallel_state
from pytest_linattn import Placement
from pytest_linattn.harness import assert_document_isolation
from test_megatron_gdn import reference

# every document longer than the conv's reach (conv_size - 1 = 3 tokens); a 1-token document too
DOCUMENTS = [7, 5, 1, 9, 6]
ONE_RANK = Placement()


@pytest.fixture
def megatron_layer(fla_on_cpu):
    """The example's GDN layer at TP 1 / CP 1, float64, on a one-process gloo group; built under
    fla_on_cpu (the layer binds chunk_gated_delta_rule as it is constructed)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process (torchrun?)")
    cpu.install()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups = client.process_groups(ONE_RANK)
        layer = client.build(ONE_RANK, groups, torch.float64, "cpu")
        weights = client.shard(reference(seed=2).state_dict(), ONE_RANK, tp_rank=0)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(weights[name])
        yield layer
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def packed_call(layer):
    """model_call for the check: its cu_seqlens as Megatron's PackedSeqParams (THD)."""
    def call(inputs, cu_seqlens):
        return client.forward_packed(layer, inputs, cu_seqlens, ONE_RANK)
    return call


def whole_row_call(layer):
    """The same layer called without packed_seq_params (sbhd): the row as one sequence."""
    def call(inputs, cu_seqlens):
        return client.forward_unpacked(layer, inputs, torch.tensor([0, inputs.shape[1]]), ONE_RANK)
    return call


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, sum(DOCUMENTS), client.CONFIG.hidden_size, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("token", ["last", "first"])
def test_packed_thd_isolates_every_document(megatron_layer, token):
    runs = assert_document_isolation(packed_call(megatron_layer), _inputs(), DOCUMENTS, feed="cu_seqlens",
                                     seed=2, token=token, name="megatron-gdn/thd")
    assert [r.document for r in runs] == list(range(len(DOCUMENTS)))


def test_the_check_sees_a_leak_without_packed_seq_params(megatron_layer):
    # the control: the same layer and weights called as one sbhd sequence (no packed_seq_params)
    # leak forward in the outputs and backward in the gradients, so the passing check is not empty
    with pytest.raises(AssertionError) as info:
        assert_document_isolation(whole_row_call(megatron_layer), _inputs(), DOCUMENTS, feed="cu_seqlens",
                                  seed=2, perturbed=[0, 1], name="megatron-gdn/sbhd")
    report = str(info.value)
    for leak in (r"perturbing document 0 token 6 \(global 6\): document 1's outputs changed from its token 0 "
                 r"\(global 7\) on",
                 r"a loss on document 1 alone: document 0's inputs got gradient from its token 0 \(global 0\) on"):
        assert re.search(leak, report), report
