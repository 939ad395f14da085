"""fla's GatedDeltaNet2, RWKV7Attention, PrecondKDA, GatedDeltaProduct and PrecondGatedDeltaNet
sharded as a team would (the fla-op clients of suites/clients/gdn2.py, clients/rwkv7.py,
clients/precond.py, clients/delta_product.py) on four ranks with fla's Triton kernels, bf16,
against the same client replicated, float64, on the CPU (fla's ops on linattn's float64
references there), same bf16-rounded weights and inputs: TP 4, CP 4 (fla's contiguous and zigzag
layouts) and TP 2 x CP 2 (both layouts). Output, dx and every parameter gradient (summed over CP,
unsharded over TP) <= 2e-2 (PrecondKDA: 4e-2, RTOL_OF says why), and RWKV-7's failing zigzag
placement in float32 (<= 5e-3) to tell bf16's rounding from a kernel's error. Head shapes: suites/cases/fla_families.py (4 key heads x 64, hidden
256), 256 tokens. The preconditioned clients' recurrence crosses CP ranks by the clients' own
state passing (fla's preconditioned ops refuse cp_context): fla's kernels with an initial state
and an initial ATK state, both final states out, their gradients back over send / recv.

One spawn call per family and placement. GatedDeltaProduct (with its forget gate) and
PrecondGatedDeltaNet are strictly xfailed, one test each: their backward runs fla's gated
chunk_bwd_dqkwg, which fla 0.6.0 refuses on Hopper with Triton >= 3.4.0, < 3.7.1 ("produces
incorrect results"); the harness runs forward and backward together, so none of their comparisons
run there. Each passes (and its strict xfail fails) where fla runs that backward. PrecondKDA's
backward is its own (no chunk_bwd_dqkwg).
"""

import pytest
import torch

from cases.gpu import BF16_RTOL as RTOL, require_cuda_and_fla

require_cuda_and_fla()

from cases.fla_families import PLACEMENTS, family_cases  # noqa: E402
from pytest_linattn import assert_parity_cases  # noqa: E402
from pytest_linattn.harness.reruns import keep_references  # noqa: E402

pytestmark = pytest.mark.gpus(4)

WORLD = 4
DTYPE = torch.bfloat16
TOKENS = 256  # 64 per rank under CP 4; fla's zigzag: 8 intervals of 32
FLA_REFUSAL = "produces incorrect results for gated chunk_bwd_dqkwg"


class FlaRefusesBackward(RuntimeError):
    """fla 0.6.0's refusal of the gated delta rule backward on this GPU and Triton."""


_CASES: dict = {}  # family -> its cases, one per placement


@pytest.fixture(scope="module", autouse=True)
def _one_reference_run_per_family():
    # the placements of a family share weights and inputs: their float64 reference runs once
    with keep_references():
        yield


# fla's kernels in float32 (their dots in TF32, as fla runs them): the bound of fla's own float32
# tests. A run there tells bf16's rounding from a kernel's error.
FP32_RTOL = 5e-3
# PrecondKDA in bf16: its ATK decay's per-head parameters (A_log_atk, dt_bias_atk) take a gradient
# summed over every token and key channel of the ATK state. Measured 2026-12-03: 2.05e-2 to
# 2.30e-2 on fla's kernels in bf16 (H200; every other tensor within 2e-2), 1.2e-2 to 1.6e-2 with
# bf16 tensors under the emulation on a CPU: bf16's rounding alone comes near the common bound.
# fla's float32 PrecondKDA kernels cannot tell more there: they ask 245760 bytes of shared memory,
# over the H200's 232448 (OutOfResources). So this family's bf16 bound is twice the others'.
RTOL_OF = {"precond_kda": 2 * RTOL}


def run_family(spawn, family, seed, placements=PLACEMENTS, dtype=DTYPE):
    key = (family, dtype)
    if key not in _CASES:
        rtol = RTOL_OF.get(family, RTOL) if dtype == DTYPE else FP32_RTOL
        _CASES[key] = family_cases(family, tokens=TOKENS, seed=seed, dtype=dtype, rtol=rtol, round_to=dtype)
    cases = [c for c in _CASES[key] if c.placement in placements]
    assert_parity_cases(spawn, cases, world_size=WORLD, bitwise_replicated=False)


# Seen on one H200 (2026-12-03, fla 0.6.0, Triton 3.6, 4 ranks sharing the GPU): in fla's zigzag
# layout (CP 4, and TP 2 x CP 2) the RWKV-7 client's outputs are right, but dx (0.36 to 0.42) and
# 13 to 16 of 26 parameter gradients (3e-2 to 1.0: the token-mix vectors, k_k, r_proj, the w / a
# adapters) are not; TP 4 and both contiguous placements pass, and GDN-2 passes in fla's zigzag
# layout on the same conv CP path. Under the emulation the same client matches the float64 layer
# to 1e-15 at every placement. Located on a CPU with fla's kernels interpreted
# (suites/fla-interpret/test_rwkv7_zigzag_cp.py, repro suites/live_bugs/fla_rwkv7_zigzag_cp_backward.py):
# the DPLR op's backward. Zigzag's compress_h0 saves the CP initial state as the two rows [0,
# front_num_seqs]; ChunkDPLRDeltaRuleFunction.backward expands it only when it has one row, so its
# recomputation (chunk_dplr_fwd_h) starts local sequence i from row i, and from memory past the
# buffer for i >= 2. This packing's ranks holding more than two sequence pieces (CP 4: ranks 0 and
# 1, 8 and 13 pieces; TP 2 x CP 2: CP rank 0, 19) recompute those states from other tensors' memory,
# and their r / w / a / b gradients with them. The width-2 conv's zigzag CP path is exact. The client
# itself at CP 2 fla-zigzag, interpreted, float32 (head dim 16; 2026-12-06): output right, dx and 13
# parameter gradients NaN (x_r, x_w, x_k, x_a, k_k, r_proj, k_proj, the w / a adapters); with
# compress_h0 the identity in fla's dplr chunk module, all 28 tensors within 1e-4.
RWKV7_ZIGZAG = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "fla 0.6.0's DPLR backward in fla's zigzag CP layout (CP 4; TP 2 x CP 2): compress_h0 saves the initial "
    "state as rows [0, front_num_seqs], ChunkDPLRDeltaRuleFunction.backward expands it only when it has one row, "
    "so its recompute (chunk_dplr_fwd_h) starts local sequence i from row i (past the buffer for i >= 2): "
    "RWKV-7's dx and 13 to 16 parameter gradients off by 0.03 to 1.8, outputs right (2026-12-03, H200)"))


# family -> its seed: the families fla runs forward and backward on Hopper (those not yet run on a GPU
# first: a call cut short by its time limit leaves the known verdicts), and those whose backward it refuses
FAMILIES = {"precond_kda": 7400, "rwkv7": 7200, "gdn2": 7100}
REFUSED_BACKWARD = {"delta_product": 7000, "precond_gdn": 7300}


def _family_params():
    for family, seed in FAMILIES.items():
        for placement in PLACEMENTS:
            known = family == "rwkv7" and placement.cp_layout == "fla-zigzag"
            yield pytest.param(family, seed, placement, id=f"{family}-{placement.name}",
                               marks=(RWKV7_ZIGZAG,) if known else ())


@pytest.mark.parametrize("family, seed, placement", list(_family_params()))
def test_fla_family_bf16_matches_float64(spawn, family, seed, placement):
    # one placement per test: a failure at one leaves the others' verdicts
    run_family(spawn, family, seed, [placement])


def _float32_params():
    by_name = {p.name: p for p in PLACEMENTS}
    for family, name in (("rwkv7", "tp2/cp2-fla-zigzag"),):
        yield pytest.param(family, FAMILIES[family], by_name[name], id=f"{family}-{name}",
                           marks=(RWKV7_ZIGZAG,) if family == "rwkv7" else ())


@pytest.mark.parametrize("family, seed, placement", list(_float32_params()))
def test_fla_family_float32_matches_float64(spawn, family, seed, placement):
    # RWKV-7 in fla's zigzag layout goes far over the bf16 bound: in float32 it does too (2026-12-03,
    # H200: dx 0.75, x_w's gradient 1.8), so a kernel computes something else, bf16 is not to blame
    run_family(spawn, family, seed, [placement], dtype=torch.float32)


@pytest.mark.xfail(raises=FlaRefusesBackward, strict=True,
                   reason="fla 0.6.0 refuses the gated chunk_bwd_dqkwg backward on Hopper with Triton >= 3.4.0, "
                          "< 3.7.1")
@pytest.mark.parametrize("family", list(REFUSED_BACKWARD))
def test_fla_family_with_refused_backward_bf16_matches_float64(spawn, family):
    try:
        run_family(spawn, family, REFUSED_BACKWARD[family])
    except Exception as exc:  # the ranks' failure report holds fla's message
        if FLA_REFUSAL in str(exc):
            raise FlaRefusesBackward(str(exc).splitlines()[0]) from exc
        raise
