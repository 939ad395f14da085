"""Block boundaries in the speculative-decoding check (`assert_spec_decode_parity(block_size=...)`,
`pytest_linattn.harness.spec_blocks`): an engine with prefix caching keeps each sequence's state
at every block boundary it commits in a block of its own, and its running state migrates as the
sequence crosses one. linattn's layer through the slot-pool client with verify and accept
(`clients.spec_decode.linattn_block_spec_path`) at TP 2, float64, with a scripted acceptance
sequence: rounds that land exactly on a boundary, cross one inside their tokens, stop short of one,
and a prefill chunk that ends on one.

The correct client passes; an accept that, when the acceptance lands exactly on a boundary, copies
the pre-move state back over the migrated one (vLLM #53505) fails with the round, the sequence,
the committed state and the block named, and what the block holds; plans that never land on a
boundary are refused.
"""

import pytest
import torch

from bug_record import plants_serving as P
from cases.layer_parity import make_config, replicated_layer
from clients.spec_decode import linattn_block_spec_path
from pytest_linattn.harness import Placement, SpecPlan, assert_spec_decode_parity
from pytest_linattn.harness.spec_blocks import landed, with_block_snapshots
from pytest_linattn.harness.spec_decode import spec_schedule
from pytest_linattn.parity import capture_records

CONFIG = make_config("qwen3_5", 1)
K = 3
BLOCK = 4
RTOL = 1e-10
# committed tokens after each round: sequence 0 2 -> 4 (lands) -> 7 -> 8 (lands); sequence 1's 4-token
# chunk ends on a boundary, then 7, 8 (lands); sequence 2 3 -> 6 (crosses 4 inside) -> 6 -> 8 (lands);
# sequence 3 3 -> 4 (lands) -> 7
PLANS = [SpecPlan((2,), (2, 3, 1)), SpecPlan((4,), (3, 1)), SpecPlan((3,), (3, 0, 2)), SpecPlan((1, 2), (1, 3))]


def reference(seed=23):
    return replicated_layer(CONFIG, seed)


def check(spawn, accept=None, plans=PLANS, placement=Placement(tp=2)):
    path = linattn_block_spec_path(CONFIG, **({"accept": accept} if accept else {}))
    with capture_records():  # the plant's failing comparisons stay out of the session's parity records
        assert_spec_decode_parity(spawn, path, reference(), [placement], plans, num_draft=K,
                                  hidden_size=CONFIG.hidden_size, seed=24, rtol=RTOL, block_size=BLOCK, name="qwen3_5")


def schedule(plans=PLANS):
    bounds = torch.tensor([0, *(pl.length for pl in plans)]).cumsum(0).tolist()
    x = torch.randn(1, bounds[-1], 4, dtype=torch.float64)
    # the blocks after sequence n's slots N - n, slot 0 and no CP scratch: from slot N + 1 on
    return with_block_snapshots(spec_schedule(plans, bounds, x, K, torch.Generator().manual_seed(0)), BLOCK,
                                len(plans) + 1)


def test_blocks_at_every_boundary_the_committed_tokens_reach():
    calls, snapshots = schedule()
    assert sorted((n, t) for _, n, t in snapshots.values()) == [(0, 4), (0, 8), (1, 4), (1, 8), (2, 4), (2, 8),
                                                                (3, 4)]
    first = calls[2]  # verify round 1: sequence 0 lands on 4 (offset 2 of 2 accepted), 2 crosses it at offset 1
    assert first.kind == "verify" and first.snapshot_offsets == (2, -1, 1, 1)
    assert calls[0].snapshot_slots[1] == 5 and calls[0].snapshot_offsets[1] == 4  # sequence 1's chunk ends on 4
    assert [landed(pl, BLOCK, 0) for pl in PLANS] == [[0, 2], [1], [2], [0]]


def test_block_client_and_plant(spawn):
    check(spawn)  # the correct client passes
    with pytest.raises(AssertionError) as back:
        check(spawn, P.accept_copying_back_on_a_landed_boundary)
    report = str(back.value)
    calls, snapshots = schedule()
    slot = next(s for s, (i, n, t) in snapshots.items() if (n, t) == (0, 4))
    said = ("call 2 (verify round 1: 3 drafts each of sequences [0, 1, 2, 3] in slots [4, 3, 2, 1], accepted "
            "[2, 3, 3, 1])")
    # the committed state of the round that landed on 4, and the block there, both the state before the round
    assert (f"{said}: slot 4, sequence 0 (chunks 2, then verify rounds accepting [2, 3, 1]), state after token 3, 2 of "
            f"3 drafts accepted: field conv error") in report, report
    assert (f"{said}: sequence 0 (chunks 2, then verify rounds accepting [2, 3, 1]), the block at token 4 (a block "
            f"boundary, where the round's acceptance landed) in slot {slot} is not the state there: field conv error"
            ) in report, report
    assert "; it holds the state at token 2 (the state the call started from)" in report, report
    # the round that crossed 4 inside its tokens kept its block right
    assert "sequence 2 (chunks 3, then verify rounds accepting [3, 0, 2]), the block at token 4" not in report, report


def test_block_plans_must_land_on_a_boundary():
    base = dict(num_draft=K, hidden_size=CONFIG.hidden_size, seed=0, rtol=RTOL, block_size=BLOCK)
    path = linattn_block_spec_path(CONFIG)
    with pytest.raises(ValueError, match=r"block_size 4: no verify round of these plans lands exactly on a block "
                                         r"boundary"):
        assert_spec_decode_parity(None, path, reference(), [Placement(tp=2)], [SpecPlan((1,), (2, 3))], **base)
    with pytest.raises(ValueError, match=r"plans\[0\].chunks\[0\] covers tokens 0..5, crossing the block boundary at "
                                         r"4 inside it"):
        assert_spec_decode_parity(None, path, reference(), [Placement(tp=2)], [SpecPlan((6,), (2,))], **base)
    with pytest.raises(ValueError, match=r"a verify round commits up to num_draft \(5\) tokens, which must not exceed "
                                         r"block_size"):
        assert_spec_decode_parity(None, path, reference(), [Placement(tp=2)], PLANS, **{**base, "num_draft": 5})
