"""The emulated state-pool entry, fused_recurrent_kda_fwd, against fla's own kernel, interpreted.

One pooled call each way the serving engines make it (forward only: fla has no backward here):
a verify call with a state per token (2-D `ssm_state_indices`, `num_accepted_tokens` choosing the
column each sequence starts from) and a padded decode (1-D indices; a padding row of zero tokens
at slot -1, which fla's kernel skips). The outputs and the whole pool after the call (written in
place: the slots the call writes, and every other slot unchanged) agree to fidelity.RTOL.
"""

import pytest
import torch

from fidelity import LOWER_BOUND, Case, check_case

H, HV, K, V = 1, 2, 16, 16
P = 8  # pool slots
REC_FWD = "fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd"


def pooled(T, gate):
    t = {"q": ((1, T, H, K), "normal"), "k": ((1, T, H, K), "unit_vector"), "v": ((1, T, HV, V), "normal"),
         "g": ((1, T, HV, K), "logdecay"), "beta": ((1, T, HV), "unit"),
         "initial_state": ((P, HV, K, V), "normal")}
    if gate:
        t["g"] = ((1, T, HV, K), "normal")  # raw: the kernel's gate shifts it by dt_bias
        t["A_log"], t["dt_bias"] = ((HV,), "A_log"), ((HV * K,), "dt_bias")
    return t


CASES = {
    # sequence 0: 3 tokens from column 1 of its row; sequence 1 padding (zero tokens, row of -1);
    # sequence 2: 2 tokens from column 2
    "verify-2d_indices-num_accepted_tokens-padding_row-gate_in_kernel-lower_bound-l2norm": Case(
        REC_FWD, pooled(5, gate=True),
        dict(ssm_state_indices=torch.tensor([[0, 1, 2], [-1, -1, -1], [5, 6, 7]]),
             num_accepted_tokens=torch.tensor([2, 1, 3]), use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
             use_qk_l2norm_in_kernel=True), cu_seqlens=[0, 3, 3, 5], grads=False),
    "decode-1d_indices-padding_row-decay": Case(
        REC_FWD, pooled(3, gate=False), dict(ssm_state_indices=torch.tensor([6, 1, -1, 3])),
        cu_seqlens=[0, 1, 2, 2, 3], grads=False),
}


@pytest.mark.parametrize("name", CASES)
def test_emulated_pool_entry_matches_fla_interpreted(name):
    check_case(CASES, name, 3500)
