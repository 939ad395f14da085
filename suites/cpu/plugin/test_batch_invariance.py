"""Batch invariance (`pytest_linattn.harness.assert_batch_invariance`) on linattn's layer through
the slot-pool client (suites/clients/state_pool.py), at TP 1 and TP 2, in float64: eight
identical requests batched in one call give bitwise identical outputs and states, equal to the
request run alone and to the float64 reference, the decode calls padded to 9 rows with a padding
row at -1, slot 0 and the spare slot in turn, its input large.

The plants (suites/bug_record/plants_batch.py) each fail with the place they break located: a
later copy started from the first copy's slot (a differing copy at prompt token 0), a batch-wide
input scale that counts the padding rows (copy 0 off the reference at the first padded decode),
a float32 kernel for batches of more than one row (the batched copy off the single run), states
written as increments in later rows (copies apart by ulps: bitwise only). A row reading its
neighbour's slot passes: identical copies hold identical states (the state-pool check sees it).

Where a packed batch leaves a tail (3 copies of 5 tokens), torch's CPU kernels compute the last
elements another way (a vector loop's scalar tail, a GEMM's partial row tile), and the last
copy's last tokens come out a rounding apart: the check reports it, bitwise only.
"""

import re

import pytest
import torch

from bug_record import plants_batch as B
from cases.layer_parity import make_config, replicated_layer
from clients.state_pool import linattn_pool_path, pool_decode
from linattn.layers import LayerState
from pytest_linattn.harness import Placement, assert_batch_invariance
from pytest_linattn.harness.serving_plans import free_fill
from pytest_linattn.parity import capture_records

CONFIG = make_config("qwen3_5", 1)
# 8 copies: every packed tensor's element count a multiple of 16, so no copy falls in the tail of
# a CPU kernel's vector loop or of a GEMM's row tile, where torch computes another way (a rounding
# apart: `test_kernel_tails_are_a_rounding_apart`); one padding row per decode call
PROMPT, COPIES, DECODE_STEPS, CAPTURE_SIZE = 5, 8, 3, 9
RTOL = 1e-10
# the schedule's calls as the reports name them: padding rows at -1, slot 0, the spare slot 8 in turn
ROWS = f"sequences {list(range(COPIES))} in slots {list(range(COPIES))}"
PREFILL = f"call 0 (prefill of {ROWS})"
DECODE_1 = f"call 1 (decode of {ROWS}, padded to 9 rows with padding rows at slots [-1])"
DECODE_2 = f"call 2 (decode of {ROWS}, padded to 9 rows with padding rows at slots [0])"


def reference(seed=11):
    return replicated_layer(CONFIG, seed)


def check(spawn, placement=Placement(tp=2), prefill=None, decode=None, **options):
    path = linattn_pool_path(CONFIG, **{k: v for k, v in (("prefill", prefill), ("decode", decode)) if v})
    arguments = dict(prompt=PROMPT, copies=COPIES, decode_steps=DECODE_STEPS, hidden_size=CONFIG.hidden_size,
                     seed=5, rtol=RTOL, capture_size=CAPTURE_SIZE, name="qwen3_5") | options
    with capture_records():  # the plants' failing comparisons stay out of the session's parity records
        assert_batch_invariance(spawn, path, reference(), [placement], **arguments)


def failure(spawn, **plant) -> str:
    with pytest.raises(AssertionError) as info:
        check(spawn, **plant)
    return str(info.value)


@pytest.mark.parametrize("placement", [Placement(), Placement(tp=2)], ids=["tp1", "tp2"])
def test_pool_client_is_batch_invariant(spawn, placement):
    check(spawn, placement)


def test_unpadded_and_prefill_only_pass(spawn):
    check(spawn, Placement(), capture_size=None)
    check(spawn, Placement(), decode_steps=0)


def _layer_gives_copies_other_bits(copies, prompt) -> bool:
    """Whether linattn's layer, run here, gives `copies` identical packed sequences different bits."""
    x = torch.randn(1, prompt, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        y, final = reference()(x.repeat(1, copies, 1), torch.arange(copies + 1, dtype=torch.int32) * prompt, None,
                               output_final_state=True)
    per_copy = [y[0].unflatten(0, (copies, prompt)), *final]  # each [copies, ...]
    return not all(torch.equal(t[n], t[0]) for t in per_copy for n in range(1, copies))


def test_kernel_tails_are_a_rounding_apart(spawn):
    """linattn's layer on a CPU, 3 copies of 5 tokens: a CPU kernel computes the last elements of
    a tensor (its vector loop's tail: silu, sigmoid, softplus) or a GEMM's last rows (MKL's
    AVX-512 dgemm: those past the last multiple of 4) another way, a rounding apart, so the last
    copy's last tokens may differ from the others' in their last bits. The check says so where the
    layer does, with the bitwise check alone failing."""
    if not _layer_gives_copies_other_bits(3, 5):
        check(spawn, Placement(), prompt=5, copies=3, capture_size=4)
        return
    report = failure(spawn, placement=Placement(), prompt=5, copies=3, capture_size=4)
    assert "batch invariance failed for qwen3_5/replicated/seed5: 1 failing check(s)" in report, report
    assert ("copies differ bitwise from copy 0 (the same input in every row): 1 of 2; first differing copy 2 (slot 2)"
            ": output token") in report and "call 0 (prefill of sequences [0, 1, 2]" in report, report


def test_later_copy_started_from_the_first_slot_is_caught(spawn):
    report = failure(spawn, prefill=B.prefill_starting_later_copies_from_the_first_slot)
    assert ("copies differ bitwise from copy 0 (the same input in every row): 7 of 7; first differing copy 1 (slot 1): "
            f"output token 0 (prompt token 0), {PREFILL}, max |diff|") in report, report
    assert "(rank 0)" in report and "batched copy 0 against the single run" not in report, report


def test_padding_rows_leaking_through_a_batch_scale_are_caught(spawn):
    report = failure(spawn, decode=B.decode_scaled_by_the_padded_batch)
    assert (f"copy 0 against the float64 reference (tp_rank0): {DECODE_STEPS} token(s) off; first wrong token 5 "
            f"(decode step 0), {DECODE_1}, error") in report, report
    assert "copies differ bitwise" not in report, report  # every copy scaled alike


def test_the_leak_hides_behind_zero_padding_rows():
    """Why the padding rows carry large values: with zeros there the plant's valid rows are right."""
    module = reference()
    x = torch.randn(1, 4, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    slots = torch.tensor([0, 1, 2, -1])  # 3 valid rows, a padding row

    def decode(plant, pads):
        with torch.no_grad():
            _, probe = module(x[:, :1], torch.tensor([0, 1], dtype=torch.int32), None, output_final_state=True)
            pool = LayerState(*(torch.randn((4,) + f.shape[1:], generator=torch.Generator().manual_seed(1),
                                            dtype=torch.float64) for f in probe))
            return plant(module, torch.cat([x[:, :3], pads], dim=1), pool, slots, 3, None)[:, :3]

    want = decode(pool_decode, x[:, 3:])
    assert torch.equal(decode(B.decode_scaled_by_the_padded_batch, torch.zeros_like(x[:, 3:])), want)
    assert not torch.allclose(decode(B.decode_scaled_by_the_padded_batch, free_fill(x[:, 3:])), want)


def test_kernel_chosen_by_batch_size_is_caught(spawn):
    report = failure(spawn, decode=B.decode_batched_in_float32, placement=Placement())
    line = next(line for line in report.splitlines() if line.startswith("batched copy 0 against the single run"))
    assert (f"batched copy 0 against the single run (one request): {DECODE_STEPS} token(s) off; first token 5 "
            f"(decode step 0), {DECODE_1}, error") in line, report
    assert re.search(r"\(against the float64 reference: batched \d\.\de-0[5-9], single \d\.\de-1[0-9]\)$", line), line
    assert "copies differ bitwise" not in report, report


def test_copies_apart_by_rounding_fail_bitwise_only(spawn):
    report = failure(spawn, decode=B.decode_writing_later_rows_as_an_increment, placement=Placement())
    assert "batch invariance failed for qwen3_5/replicated/seed5: 1 failing check(s)" in report, report
    assert ("copies differ bitwise from copy 0 (the same input in every row): 7 of 7; first differing copy 1 (slot 1): "
            f"output token 6 (decode step 1), {DECODE_2}, max |diff|") in report, report


def test_crosstalk_between_identical_copies_is_invisible(spawn):
    # a row reading its neighbour's slot reads the same state: identical copies cannot show it
    check(spawn, Placement(), decode=B.decode_reading_the_next_rows_slot)


def _zero_output(ref, x, cu, state):
    y, final = ref(x, cu, state, output_final_state=True)
    return torch.zeros_like(y), final


def _zero_recurrent_state(ref, x, cu, state):
    y, final = ref(x, cu, state, output_final_state=True)
    return y, final._replace(recurrent=torch.zeros_like(final.recurrent))


def test_degenerate_reference_is_refused():
    for forward, what in ((_zero_output, "its output"), (_zero_recurrent_state, "its final state's field recurrent")):
        with pytest.raises(AssertionError, match=f"the reference is degenerate: {what} is all zeros"):
            check(None, reference_forward=forward)


@pytest.mark.parametrize("bad, message", [
    (dict(copies=1), r"copies must be an int >= 2"),
    (dict(prompt=0), r"prompt must be a positive int"),
    (dict(decode_steps=-1), r"decode_steps must be an int >= 0"),
    (dict(capture_size=2), r"capture_size must be None or an int >= copies \(8\)"),
    (dict(placement=Placement(cp=2)), r"batch invariance runs TP placements \(cp = 1\)"),
])
def test_bad_input_names_the_parameter(bad, message):
    with pytest.raises(ValueError, match=message):
        check(None, **bad)
