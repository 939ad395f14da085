"""The public layer-parity harness (pytest_linattn.harness) on a toy client.

The toy: y = fc2(gelu(fc1(gain * (x_t + x_{t-1})))), x_{t-1} the previous token of the same
sequence (zero at a sequence start), so under CP the first token of a rank's piece needs a halo
from another rank. fc1 column-parallel, fc2 row-parallel, `gain` TP-replicated. The correct
client passes every placement; planted bugs (a wrong shard, an unreduced replicated gradient, a
dropped halo, a wrong unshard, a layer with its own CP layout) fail with messages that name what
broke, and bad input raises ValueError before any rank runs. Beside it: the token layout against
hand-written examples (test_token_layout.py), the project's layer's gradient locations
(test_layer_grad_locations.py).
"""

import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linattn.parallel import group_rank
from linattn.parallel.cp import cp_token_index
from linattn.parallel.mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                                       reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region)
from pytest_linattn.parity import capture_records
from pytest_linattn.harness import (ParityCase, Placement, ShardedLayer, assert_parity_cases,
                                           assert_sharded_parity, rank_token_index)

DIM, HIDDEN = 6, 8
RTOL = 1e-10
CU = [0, 3, 10, 11, 16]  # T=16: a sequence crosses the CP edge at 8, one is a single token
CU_ZIGZAG = [0, 8, 16]  # every length divisible by 2 * cp = 4
PLACEMENTS = [Placement(tp=2), Placement(tp=2, sequence_parallel=True), Placement(cp=2),
              Placement(tp=2, cp=2, sequence_parallel=True), Placement(tp=2, cp=2)]


# ---- the toy client -----------------------------------------------------------------------------


class ToyMixer(nn.Module):
    """The toy layer; with no groups, the replicated reference."""

    def __init__(self, placement=Placement(), groups=(None, None), bug=None, dtype=torch.float64, device="cpu"):
        super().__init__()
        self.placement, (self.tp_group, self.cp_group), self.bug = placement, groups, bug
        tp = placement.tp
        self.gain = nn.Parameter(torch.empty(DIM, dtype=dtype, device=device))
        self.fc1 = nn.Linear(DIM, HIDDEN // tp, bias=False, dtype=dtype, device=device)
        self.fc2 = nn.Linear(HIDDEN // tp, DIM, bias=False, dtype=dtype, device=device)

    def forward(self, x, cu_seqlens):
        sp = self.placement.sequence_parallel
        if sp:  # SP slice -> this CP rank's tokens
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        x = x + self._previous_tokens(x, cu_seqlens)
        if not sp:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        gain = self.gain if self.bug == "unreduced" else copy_to_tensor_parallel_region(self.gain, self.tp_group)
        out = self.fc2(F.gelu(self.fc1(gain * x)))
        if sp:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_parallel_region(out, self.tp_group)

    def _previous_tokens(self, x, cu_seqlens):
        """x_{t-1} of each of this CP rank's tokens (the library's layout), zero at sequence starts."""
        cu, cp, layout = cu_seqlens.cpu(), self.placement.cp, self.placement.cp_layout
        if self.bug == "contiguous_only":  # a layer with its own layout, whatever the placement says
            layout = "contiguous"
        if self.bug == "no_boundaries":  # the packing lost: the batch taken as one sequence
            cu = cu[[0, -1]]
        mine = cp_token_index(cu, group_rank(self.cp_group), cp, layout)
        if self.bug == "no_halo":  # only the tokens this rank holds
            held, tokens = mine, x
        else:  # every CP rank's tokens, in CP rank order
            held = torch.cat([cp_token_index(cu, r, cp, layout) for r in range(cp)])
            tokens = gather_from_sequence_parallel_region(x, self.cp_group)
        where = torch.full((int(cu[-1]) + 1,), -1, dtype=torch.int64)
        where[held + 1] = torch.arange(held.numel())  # where[g + 1]: position of token g
        prev = where[mine]
        prev[torch.isin(mine, cu[:-1].long())] = -1
        picked = tokens[:, prev.clamp(min=0).to(x.device)]
        return picked * (prev >= 0).to(x.device, x.dtype)[None, :, None]


def build_toy(placement, groups, dtype, device, bug=None):
    return ToyMixer(placement, groups, bug, dtype, device)


def shard_toy(full, placement, tp_rank, bug=None):
    tp = placement.tp
    fc1 = full["fc1.weight"].flip(0) if bug == "swapped_rows" and tp > 1 else full["fc1.weight"]
    return {"gain": full["gain"], "fc1.weight": fc1.chunk(tp, 0)[tp_rank],
            "fc2.weight": full["fc2.weight"].chunk(tp, 1)[tp_rank]}


def unshard_toy(grads, placement, bug=None):
    order = grads[::-1] if bug == "reversed" else grads
    return {"gain": grads[0]["gain"], "fc1.weight": torch.cat([g["fc1.weight"] for g in order], 0),
            "fc2.weight": torch.cat([g["fc2.weight"] for g in grads], 1)}


def reduce_gain_over_tp(module, placement):
    """A trainer's finalize step: the all-reduce the "unreduced" layer leaves out."""
    import torch.distributed as dist

    if module.tp_group is not None:
        dist.all_reduce(module.gain.grad, group=module.tp_group)


def describe_toy_grad(name, index, placement):
    """fc1's rows are hidden units, split over TP; the other parameters keep the default words."""
    if name != "fc1.weight":
        return None
    unit, feature = index
    return f"hidden unit {unit}, input {feature} (TP rank {unit // (HIDDEN // placement.tp)})"


def toy_client(bug=None, **extra):
    return ShardedLayer(build=functools.partial(build_toy, bug=bug), shard=functools.partial(shard_toy, bug=bug),
                        unshard=functools.partial(unshard_toy, bug=bug), replicated={"gain"},
                        describe_grad_element=describe_toy_grad, **extra)


def toy_reference(seed=0, cls=ToyMixer):
    torch.manual_seed(seed)
    ref = cls()
    with torch.no_grad():
        ref.gain.copy_(1 + 0.2 * torch.randn(DIM, dtype=torch.float64))
    return ref


# ---- the correct client passes ------------------------------------------------------------------


def test_toy_client_passes_every_placement(spawn):
    contiguous = [ParityCase(toy_client(), p, toy_reference(), CU, *_inputs(CU), rtol=RTOL) for p in PLACEMENTS]
    zigzag = [ParityCase(toy_client(), Placement(tp=tp, cp=2, cp_layout="zigzag", sequence_parallel=tp > 1),
                         toy_reference(), CU_ZIGZAG, *_inputs(CU_ZIGZAG), rtol=RTOL) for tp in (1, 2)]
    with capture_records() as records:
        assert_parity_cases(spawn, contiguous + zigzag, world_size=4)  # tp2 / cp2 as 2 data-parallel replicas
    assert records and all(r["passed"] for r in records)
    assert any("/dp1 " in r["group"] for r in records)


def test_after_backward_hook_reduces_the_replicated_gradient(spawn):
    client = toy_client("unreduced", after_backward=reduce_gain_over_tp)
    with capture_records():
        assert_sharded_parity(spawn, client, toy_reference(), [Placement(tp=2), Placement(tp=2, cp=2)], CU,
                              hidden_size=DIM, seed=3, rtol=RTOL, name="toy")


# ---- planted bugs are caught --------------------------------------------------------------------


@pytest.mark.parametrize("bug, placement, bitwise, message", [
    ("swapped_rows", Placement(tp=2), True, r"parity failed for toy/tp2/seed1 output tp_rank0"),
    ("unreduced", Placement(tp=2), True,
     r"toy/tp2/seed1 grad gain: TP-replicated parameter, but TP ranks 0 and 1 hold different gradients"),
    ("unreduced", Placement(tp=2, cp=2, sequence_parallel=True), False,
     r"grad gain: TP-replicated, TP rank 1 vs TP rank 0 \(CP rank 0\)"),
    ("no_halo", Placement(cp=2), True, r"(?s)toy/cp2-contiguous/seed1 output: .*seq 1 token 5 \(global 8\)"),
    ("reversed", Placement(tp=2), True, r"toy/tp2/seed1 grad: 1 of 3 tensor\(s\) off.*\n.*\n\s+fc1.weight"),
])
def test_planted_bug_is_caught(spawn, bug, placement, bitwise, message):
    with capture_records(), pytest.raises(AssertionError, match=message):
        assert_sharded_parity(spawn, toy_client(bug), toy_reference(), [placement], CU, hidden_size=DIM, seed=1,
                              rtol=RTOL, bitwise_replicated=bitwise, name="toy")


def test_every_failing_check_of_the_case_is_reported(spawn):
    # a dropped halo breaks the output, the input gradient and every parameter gradient
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("no_halo"), toy_reference(), [Placement(cp=2)], CU,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    msg = str(info.value)
    assert msg.startswith("parity failed for case toy/cp2-contiguous/seed1: 3 failing check(s)")
    for check in ("output: 1 of 1", "dx: 1 of 1", "grad: 3 of 3"):
        assert f"parity failed for toy/cp2-contiguous/seed1 {check} tensor(s) off" in msg


def _tokens(cu, placement, tp_rank=0, cp_rank=0):
    return rank_token_index(torch.tensor(cu), placement, tp_rank, cp_rank).tolist()


@pytest.mark.parametrize("placement", [Placement(cp=2, cp_layout="zigzag"),
                                       Placement(tp=2, cp=2, cp_layout="zigzag", sequence_parallel=True)])
def test_failure_names_the_ranks_holding_the_worst_token(spawn, placement):
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("no_halo"), toy_reference(), [placement], CU_ZIGZAG,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    named = re.findall(r"\(global (\d+)\) on CP rank (\d)(?:, TP rank (\d))?", str(info.value))
    assert len(named) == 2  # the output's and the input gradient's worst token
    for token, cp_rank, tp_rank in named:
        held = _tokens(CU_ZIGZAG, placement, int(tp_rank or 0), int(cp_rank))
        assert int(token) in held, f"token {token} is not on CP rank {cp_rank}, TP rank {tp_rank}: {held}"
        assert bool(tp_rank) == placement.sequence_parallel


def test_layer_with_another_layout_is_told_the_layouts_differ(spawn):
    zigzag = [Placement(cp=2, cp_layout="zigzag")]
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("contiguous_only"), toy_reference(), zigzag, CU_ZIGZAG,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    note, report = str(info.value).split("\n\n", 1)
    assert note.startswith("the layouts differ: the layer lays tokens out as cp_layout='contiguous' does")
    assert "this placement as 'zigzag' does (each sequence cut in 2*cp chunks" in note
    assert note.endswith("test it with Placement(cp_layout='contiguous'), or give the layer this layout")
    assert report.startswith("parity failed for case toy/cp2-zigzag/seed1: 3 failing check(s)")
    # a layer that follows the placement but drops its halo passes contiguously on CU_ZIGZAG (the
    # edge is a sequence boundary there): still a bug of its own, not a layout
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("no_halo"), toy_reference(), zigzag, CU_ZIGZAG,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    assert str(info.value).startswith("parity failed for case toy/cp2-zigzag/seed1")


def test_parameter_gradient_located_by_the_client(spawn):
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("reversed"), toy_reference(), [Placement(tp=2)], CU,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    # the gradient table's row (the note before the report names fc1.weight too)
    (unit, feature, tp_rank, row, col), = re.findall(
        r"\n\s+fc1.weight .* hidden unit (\d+), input (\d+) \(TP rank (\d)\) at index \((\d+), (\d+)\)",
        str(info.value))
    assert (unit, feature) == (row, col) and int(tp_rank) == int(unit) // (HIDDEN // 2)


@pytest.mark.parametrize("bug", ["swapped_rows", "reversed"])
def test_shard_and_unshard_that_disagree_are_told_first(spawn, bug):
    # the shard function flips fc1's rows, or unshard puts the ranks' rows back in reversed order:
    # the shards put back together are not the weights, every row of fc1 comes back elsewhere
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client(bug), toy_reference(), [Placement(tp=2)], CU, hidden_size=DIM,
                              seed=1, rtol=RTOL, name="toy")
    note, report = str(info.value).split("\n\n", 1)
    assert note == (f"shard and unshard disagree: unshard of the TP ranks' shards is not the reference's weight in "
                    f"fc1.weight (rows 0..{HIDDEN - 1} of {HIDDEN} differ; first: hidden unit 0, input 0 (TP rank 0) "
                    "at index (0, 0)). Each rank computes with other weights than its gradients are compared as: fix "
                    "the shard function (or unshard) of these parameters first"), note
    assert report.startswith("parity failed for case toy/tp2/seed1"), report
    # a client whose shard and unshard agree fails for its own bug, without the note
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("unreduced"), toy_reference(), [Placement(tp=2)], CU,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    assert str(info.value).startswith("parity failed for case toy/tp2/seed1"), str(info.value)


def test_first_wrong_token_is_named_on_each_cp_rank(spawn):
    # a dropped halo: CP rank 0 needs none and is right; rank 1's first token (global 8, sequence 1's
    # token 5) misses its previous token, on rank 0
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("no_halo"), toy_reference(), [Placement(cp=2)], CU, hidden_size=DIM,
                              seed=1, rtol=RTOL, name="toy")
    output = str(info.value).split("parity failed for toy/cp2-contiguous/seed1 output")[1].split("\n\n")[0]
    assert output.endswith("\nfirst wrong token per rank: CP rank 0 at none; CP rank 1 at seq 1 token 5 (global 8)")
    # without CP: one first wrong token, the first of the batch here (fc1's rows flipped)
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("swapped_rows"), toy_reference(), [Placement(tp=2)], CU,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    assert "tp_rank0  " in str(info.value) and "\nfirst wrong token: seq 0 token 0 (global 0)\n" in str(info.value)


def test_a_layer_that_loses_the_packing_under_cp_is_told_so(spawn):
    # the layer takes the batch as one sequence: its ranks' outputs are the reference's on [0, T]
    with capture_records(), pytest.raises(AssertionError) as info:
        assert_sharded_parity(spawn, toy_client("no_boundaries"), toy_reference(), [Placement(cp=2)], CU,
                              hidden_size=DIM, seed=1, rtol=RTOL, name="toy")
    note, report = str(info.value).split("\n\n", 1)
    assert re.fullmatch(r"the packing was lost: the ranks' outputs are the replicated layer's on the batch as one "
                        r"sequence \(cu_seqlens \[0, 16\], error \S+\), not on its 4 packed sequences: the "
                        r"sharded layer runs its pieces without the boundaries \(they did not reach its CP context or "
                        r"its ops\), so state and conv run from one document into the next", note), note
    assert report.startswith("parity failed for case toy/cp2-contiguous/seed1"), report
    # at CP rank 0, the first packed boundary (token 3) is the first wrong token
    assert "first wrong token per rank: CP rank 0 at seq 1 token 0 (global 3); CP rank 1 at" in report, report


# ---- bad input: ValueError naming the parameter and the rule -----------------------------------


def _inputs(cu, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, cu[-1], DIM, generator=gen, dtype=torch.float64) for _ in range(2)]


def no_spawn(*args, **kwargs):
    raise AssertionError("spawn must not be reached on bad input")


def build_lambda_free(placement, groups, dtype, device):
    return ToyMixer(placement, groups, dtype=dtype, device=device)


@pytest.mark.parametrize("make, rule", [
    (lambda: Placement(tp=0), r"Placement.tp must be a positive int, got 0"),
    (lambda: Placement(cp=2, cp_layout="ring"),
     r"Placement.cp_layout must be one of \('contiguous', 'zigzag', 'fla-zigzag', 'zigzag-padded'\)"),
    (lambda: Placement(sequence_parallel=True), r"Placement.sequence_parallel needs tp > 1"),
    (lambda: ShardedLayer(build=lambda *a: None, shard=shard_toy, unshard=unshard_toy),
     r"ShardedLayer's callables must be module-level"),
    (lambda: ShardedLayer(build=build_lambda_free, shard=shard_toy, unshard=unshard_toy, replicated="gain"),
     r"ShardedLayer.replicated must be a collection of parameter names"),
    (lambda: ParityCase(toy_client(), Placement(cp=3), toy_reference(), CU, *_inputs(CU), rtol=RTOL),
     r"cu_seqlens: contiguous CP needs the total token count divisible by cp: 16 % 3 != 0"),
    (lambda: ParityCase(toy_client(), Placement(cp=2, cp_layout="zigzag"), toy_reference(), CU, *_inputs(CU),
                        rtol=RTOL),
     r"cu_seqlens: zigzag CP needs every sequence length divisible by 2\*cp=4; sequence 0 has 3 tokens"),
    (lambda: ParityCase(toy_client(), Placement(cp=4, cp_layout="fla-zigzag"), toy_reference(), [0, 3, 12],
                        *_inputs([0, 3, 12]), rtol=RTOL),
     r"cu_seqlens: fla-zigzag CP needs the total token count divisible by 2\*cp: 12 % 8 != 0"),
    (lambda: ParityCase(toy_client(), Placement(tp=4, cp=2, sequence_parallel=True), toy_reference(), [0, 4, 12],
                        *_inputs([0, 4, 12]), rtol=RTOL),
     r"cu_seqlens: sequence parallel needs each CP rank's token count divisible by tp: 6 % 4 != 0"),
    (lambda: ParityCase(toy_client(), Placement(tp=2), toy_reference(), CU, *_inputs([0, 8]), rtol=RTOL),
     r"ParityCase.x must be a \[1, T=16, ...\] tensor"),
    (lambda: ParityCase(toy_client(), Placement(tp=2), toy_reference(), CU, *_inputs(CU), rtol=0),
     r"rtol must be positive"),
    (lambda: assert_parity_cases(no_spawn, [ParityCase(toy_client(), Placement(tp=4), toy_reference(), CU,
                                                       *_inputs(CU), rtol=RTOL)], world_size=6),
     r"world_size 6 must be a multiple of tp \* cp = 4 of placement tp4"),
    (lambda: assert_sharded_parity(no_spawn, toy_client(), toy_reference(), [], CU, hidden_size=DIM, seed=0,
                                   rtol=RTOL),
     r"placements must hold at least one Placement"),
    (lambda: assert_sharded_parity(no_spawn, toy_client(), toy_reference(), [Placement(tp=2)], CU,
                                   hidden_size=DIM + 1, seed=0, rtol=RTOL),
     r"^hidden_size \(x's last dim, 7\) must be the reference's input size: the reference raised on x of shape "
     r"\(1, 16, 7\): RuntimeError: The size of tensor a \(6\) must match the size of tensor b \(7\)"),
])
def test_bad_input_raises_value_error(make, rule):
    with pytest.raises(ValueError, match=rule):
        make()


# ---- reruns of a test (collective mutants) reuse its references ----------------------------------


class CountingToyMixer(ToyMixer):
    forwards = 0

    def forward(self, x, cu_seqlens):
        CountingToyMixer.forwards += 1
        return super().forward(x, cu_seqlens)


def counting_reference(seed=0):
    return toy_reference(seed, CountingToyMixer)


def test_reruns_compute_each_reference_once_and_anew_when_it_changes(spawn):
    from pytest_linattn.harness.reruns import keep_references

    def check(ref, seed=3):
        with capture_records():
            assert_sharded_parity(spawn, toy_client(), ref, [Placement(tp=2)], CU, hidden_size=DIM, seed=seed,
                                  rtol=RTOL, name="toy")

    CountingToyMixer.forwards = 0
    check(counting_reference())
    check(counting_reference())
    assert CountingToyMixer.forwards == 2  # outside reruns: every call computes
    CountingToyMixer.forwards = 0
    with keep_references():
        check(counting_reference())
        check(counting_reference())  # a rerun: new objects, the same weights and inputs
        assert CountingToyMixer.forwards == 1
        check(counting_reference(seed=1))  # other weights
        check(counting_reference(), seed=4)  # other inputs
        assert CountingToyMixer.forwards == 3
    # a planted bug is still caught inside a rerun block, from the kept reference
    with keep_references(), pytest.raises(AssertionError, match="parity failed"):
        with capture_records():
            assert_sharded_parity(spawn, toy_client("swapped_rows"), counting_reference(), [Placement(tp=2)], CU,
                                  hidden_size=DIM, seed=3, rtol=RTOL, name="toy")
