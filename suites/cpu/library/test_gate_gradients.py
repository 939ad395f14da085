"""The in-kernel gate's gradients (the gate input's, A_log's, dt_bias's) of the GDN op entry (and, in
float32, KDA's) under strong decay, against float64 (cases.gate_gradients says why strong decay and
what is compared).

- linattn's torch kernels in bf16 (what a bf16 layer runs on a CPU): within the bf16 bound at
  strong decay; this is the bug record's check `gate-gradients`.
- in float32: within 1e-5 at mild and at strong decay, GDN's op and KDA's (its gate per key
  channel): the chunked form's decays send their gradient to the per-token log decay directly,
  span by span, with nothing to cancel (reference.delta_rule._chunk_terms). Autograd's form, a row
  sum minus a column sum per cumulative decay, left the fast heads' gate gradients to float32
  rounding: up to 3e-4 (GDN) and 5e-4 (KDA) off at strong decay (cases.gate_gradients has the
  numbers).
- the plant (bug_record.plants_gate: a fused backward whose gate-gradient cancellation goes
  through a bf16 transpose, as FlashQLA's did): caught at strong decay, A_log's and dt_bias's
  gradients named, each at its worst value head; at mild decay within the bf16 bound, which is why
  the check's decay is strong.
"""

import pytest
import torch

from bug_record.plants_gate import gated_delta_rule_with_a_bf16_transposed_gate_gradient as planted
from bug_record.plants_gate import located
from cases.gate_gradients import BOUNDS, DECAYS, SIZES, assert_gate_gradients, draw, reference_gradients
from linattn import kernels
from pytest_linattn.parity import capture_records

BF16, F32 = torch.bfloat16, torch.float32
# seeds 0-15: GDN's before the chunked form's decays took their gradient span by span, 3.3e-6 to 1.7e-4,
# 13 above 1e-5 (2, 6, 7: 4.6e-5, 1.7e-4, 6.7e-5); now 1.7e-7 to 7.0e-7. KDA's 5.3e-5 to 5.1e-4, all 16
# above; now 1.7e-7 to 2.4e-6
FLOAT32_SEEDS = tuple(range(16))


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_the_reference_is_the_recurrence_at_strong_decay(per_channel):
    # the float64 oracle's chunked form (exp of within-chunk log decays down to about -1000) against its
    # token-by-token form, outputs and gate gradients
    from linattn import reference

    values = draw(decay="strong", per_channel=per_channel)
    op = reference.kda if per_channel else reference.gated_delta_rule
    grads = {}
    for mode in ("chunk", "recurrent"):
        gate = {n: values[n].clone().requires_grad_() for n in ("a", "A_log", "dt_bias")}
        o, _ = op(values["q"], values["k"], values["v"], kernels.log_decay(gate["a"], gate["A_log"], gate["dt_bias"]),
                  values["beta"], cu_seqlens=torch.tensor(SIZES.cu_seqlens), mode=mode)
        (o * values["do"]).sum().backward()
        grads[mode] = {"o": o.detach(), **{n: t.grad for n, t in gate.items()}}
    for name, ref in grads["recurrent"].items():
        got = grads["chunk"][name]
        assert ((got - ref).norm() / ref.norm()).item() <= 1e-10, name


def test_the_decay_is_strong():
    # per-token log decay: the strong case's fast heads below -20 (within-chunk sums near -1000), the mild case's
    # every head above -1; exp(A_log) the same in both
    logs = {}
    for decay in ("strong", "mild"):
        v = draw(decay=decay)
        logs[decay] = kernels.log_decay(v["a"], v["A_log"], v["dt_bias"])
    assert logs["strong"].min() < -20 and logs["strong"].max() < 0
    assert logs["mild"].min() > -1 and logs["mild"].max() < 0
    assert torch.equal(draw(decay="strong")["A_log"], draw(decay="mild")["A_log"]) and DECAYS["strong"] > DECAYS["mild"]


def test_bf16_gate_gradients_at_strong_decay():
    assert_gate_gradients(dtype=BF16, decay="strong")


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_float32_gate_gradients_at_mild_decay(per_channel):
    assert_gate_gradients(dtype=F32, decay="mild", per_channel=per_channel)


@pytest.mark.parametrize("seed", FLOAT32_SEEDS)
def test_float32_gate_gradients_at_strong_decay(seed):
    assert_gate_gradients(dtype=F32, decay="strong", seed=seed)


@pytest.mark.parametrize("seed", FLOAT32_SEEDS)
def test_kda_float32_gate_gradients_at_strong_decay(seed):
    # per key channel: the decays of _ChannelDecayedLower's quarters and the chunk's edges
    assert_gate_gradients(dtype=F32, decay="strong", seed=seed, per_channel=True)


def test_plant_is_caught_at_strong_decay():
    with capture_records(), pytest.raises(AssertionError, match=located()) as failed:
        assert_gate_gradients(planted, dtype=BF16, decay="strong")
    assert "3 of 3 tensor(s) off" in str(failed.value)


def test_plant_passes_at_mild_decay():
    # within the bf16 bound: a check at mild decay cannot tell the plant from bf16 rounding
    records = assert_gate_gradients(planted, dtype=BF16, decay="mild")
    assert max(r["error"] for r in records) > 10 * max(
        r["error"] for r in assert_gate_gradients(dtype=F32, decay="mild")), "the plant is inert at mild decay"


def test_plant_forward_is_exact():
    # the plant changes the backward only: its float32 output is the entry's
    v = draw(decay="strong")
    args = [v[n].float() for n in ("q", "k", "v", "a", "beta")]
    kw = dict(cu_seqlens=torch.tensor(SIZES.cu_seqlens), use_gate_in_kernel=True, A_log=v["A_log"].float(),
              dt_bias=v["dt_bias"].float())
    assert torch.equal(planted(*args, **kw)[0], kernels.gated_delta_rule(*args, **kw)[0])


def test_bounds_are_the_project_s():
    assert BOUNDS == {F32: 1e-5, BF16: 2e-2}
    assert set(reference_gradients()) == {"dg", "dA_log", "ddt_bias"}
