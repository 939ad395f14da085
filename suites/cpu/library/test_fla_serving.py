"""A serving client on fla's KDA ops (suites/clients/fla_serving.py: chunk_kda for prefill,
fused_recurrent_kda_fwd with `ssm_state_indices` in place on a state pool for decode) under the
fla_on_cpu emulation, float64, at TP 2, through `assert_state_pool_parity` against linattn's
replicated float64 layer (<= 1e-10).

Decode calls are padded to a captured size with rows at slot -1, slot 0 and a free slot, given
zero tokens (fla 0.6.0's kernel skips them unread); slots are freed and reused. A planted decode
that runs the padding rows as one-token sequences (fla's kernel then reads and writes slot -1,
outside the pool) is refused by the emulation, naming the index.
"""


import pytest
import torch

from cases.layer_parity import make_config, replicated_layer
from pytest_linattn.harness import Placement, SequencePlan, assert_state_pool_parity
from pytest_linattn.parity import capture_records

CONFIG = make_config("kda", 2)  # bounded gate, two value heads per key head
SEQLENS = (7, 6, 5, 8)
CU = torch.tensor([0, *SEQLENS]).cumsum(0).to(torch.int32)
# a 1-token first chunk, chunks from a state, decode runs of several lengths; 2 live at once:
# sequences 2 and 3 take the slots 0 and 1 freed
PLANS = [SequencePlan((1, 4), 2), SequencePlan((3,), 3), SequencePlan((2, 1), 2), SequencePlan((5,), 3)]
CAPTURE_SIZES = (4,)
RTOL = 1e-10


def reference(seed=31):
    return replicated_layer(CONFIG, seed)


def decode_running_padding_rows(module, x, pool, slots, num_valid, placement):
    """Every row a one-token sequence: the padding rows' slots are read and written too."""
    conv = pool.conv[slots.clamp(min=0)]
    y, _ = module.pool_step(x, conv, pool.recurrent, slots, x.shape[1])
    return y


def check(spawn, path):
    assert_state_pool_parity(spawn, path, reference(), [Placement(tp=2)], CU, plans=PLANS,
                             hidden_size=CONFIG.hidden_size, seed=32, rtol=RTOL, max_live=2,
                             capture_sizes=CAPTURE_SIZES, name="fla-kda")


@pytest.mark.tp_sizes(2)
def test_fla_pool_client_matches_the_serial_run(spawn, fla_on_cpu, tp_size):
    from clients.fla_serving import fla_pool_path

    check(spawn, fla_pool_path(CONFIG))


@pytest.mark.tp_sizes(2)
def test_padding_rows_run_as_sequences_are_refused(spawn, fla_on_cpu, tp_size):
    from clients.fla_serving import fla_pool_path

    with capture_records(), pytest.raises(Exception, match=r"ssm_state_indices=-1\).*no padding sentinel"):
        check(spawn, fla_pool_path(CONFIG, decode=decode_running_padding_rows))
