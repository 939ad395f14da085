"""vLLM 0.33.0's serving kernels at the edges of their contract, under Triton's interpreter in float32,
against linattn's float64 references (float32 bound 1e-5). Each test runs one case its callers use
(it passes: the check is right) and one just outside (a strict xfail naming what the kernel does there,
a live bug of docs/live-bugs.md with a standalone repro in suites/live_bugs/):

- a speculative-decoding row with num_accepted_tokens = 0 starts from the previous row's last slot;
- 1-D ssm_state_indices with several tokens per sequence: token t's state lands in the slot t places on;
- fused_sigmoid_gating_delta_rule_update(is_kda=True) steps the per-channel gate by HV, not HV * K;
- causal_conv1d_update given slot -1 reads and writes the conv state one slot before the pool.

The pools are in vLLM's layout (recurrent `[slots, HV, V, K]`, the transpose of linattn's; conv
`[slots, D, W - 1]`), slot 0 is vLLM's null block.
"""

import pytest
import torch
import torch.nn.functional as F

from clients.engines.fetch import VLLM
from clients.engines.loader import load_vllm, missing_reason
from linattn.reference import gated_delta_rule, kda, short_conv

pytestmark = pytest.mark.skipif(missing_reason(VLLM) is not None, reason=str(missing_reason(VLLM)))

FLA_OPS = "vllm.third_party.flash_linear_attention.ops"
H, HV, K, V = 1, 2, 16, 16
RTOL = 1e-5


def rel(actual, expected):
    """Relative Frobenius error, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def inputs(seed, T, kda_gate=False):
    """q, k `[1, T, H, K]`, v `[1, T, HV, V]`, the gate's projection a (`[T, HV]`, KDA `[T, HV, K]`), b
    `[T, HV]`, A_log `[HV]`, dt_bias (`[HV]`, KDA `[HV * K]`), as vLLM's decode gives them."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    a = torch.randn(T, HV, K, generator=gen) if kda_gate else torch.randn(T, HV, generator=gen)
    b = torch.randn(T, HV, generator=gen)
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV * K if kda_gate else HV, generator=gen) * 0.5
    return q, k, v, a, b, A_log, dt_bias


def gate(a, A_log, dt_bias):
    """The gates fused_sigmoid_gating computes (fused_sigmoid_gating.py:129-133): g = -exp(A_log) *
    softplus(a + dt_bias), per head (GDN) or per key channel (KDA, dt_bias `[HV * K]`)."""
    if a.dim() == 3:
        return -A_log.double().exp()[:, None] * F.softplus(a.double() + dt_bias.double().view(a.shape[1:]))
    return -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())


def recurrence(kernel, q, k, v, a, b, A_log, dt_bias, pool, **call):
    """vLLM's decode / verify recurrence on the pool in place (the gate and beta from a, b): the
    fused kernel as Qwen3-Next's layer calls it, or fused_recurrent_gated_delta_rule given the same
    g and beta (as OLMo-hybrid's does)."""
    call = dict(initial_state=pool, inplace_final_state=True, use_qk_l2norm_in_kernel=True, **call)
    if kernel == "fused_sigmoid_gating":
        gating = load_vllm(f"{FLA_OPS}.fused_sigmoid_gating")
        return gating.fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, **call)[0]
    recurrent = load_vllm(f"{FLA_OPS}.fused_recurrent")
    g = gate(a, A_log, dt_bias).float()
    return recurrent.fused_recurrent_gated_delta_rule(q, k, v, g[None], b.sigmoid()[None], **call)[0]


KERNELS = pytest.mark.parametrize("kernel", ["fused_sigmoid_gating", "fused_recurrent"])


@KERNELS
@pytest.mark.parametrize("accepted", [
    [1, 1],
    pytest.param([1, 0], marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
        "vLLM 0.33.0: num_accepted_tokens = 0 reads ssm_state_indices[n * stride - 1], the previous row's "
        "last slot (fused_sigmoid_gating.py:106-110, fused_recurrent.py:107-111)"))),
], ids=["accepted-1-1", "accepted-1-0"])
def test_a_verify_row_reads_only_its_own_slots(kernel, accepted):
    """A verify call of 2 rows x 2 tokens, `[N, 2]` state indices [[1, 2], [3, 4]]: row 1's output
    and slots are the same whatever row 0's slots hold."""
    x = inputs(0, 4)
    pool = torch.randn(6, HV, V, K, generator=torch.Generator().manual_seed(1))
    other = pool.clone()
    other[1:3] = torch.randn(2, HV, V, K, generator=torch.Generator().manual_seed(2))  # row 0's slots
    call = dict(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32),
                ssm_state_indices=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
                num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))
    o = recurrence(kernel, *x, pool, **call)
    o_other = recurrence(kernel, *x, other, **call)
    assert torch.equal(o[0, 2:], o_other[0, 2:]) and torch.equal(pool[3:5], other[3:5]), (
        f"row 1 (slots [3, 4], num_accepted_tokens {accepted[1]}) changed with row 0's slots [1, 2]: output "
        f"{rel(o_other[0, 2:], o[0, 2:]):.2e}, slots {rel(other[3:5], pool[3:5]):.2e}")


@KERNELS
@pytest.mark.parametrize("seqlens", [
    (1, 1),
    pytest.param((2, 1), marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
        "vLLM 0.33.0: with 1-D ssm_state_indices the state after token t is stored at "
        "ssm_state_indices[n + t], the next sequences' slots (fused_sigmoid_gating.py:157-166, "
        "fused_recurrent.py:153-162; stride_indices_tok is never read)"))),
], ids=["tokens-1-1", "tokens-2-1"])
def test_flat_state_indices_keep_each_sequence_in_its_slot(kernel, seqlens):
    """One slot per sequence (1-D indices [2, 4]), `seqlens` tokens each: the outputs and the final
    states in the slots are the float64 reference's from those slots; no other slot changes."""
    q, k, v, a, b, A_log, dt_bias = inputs(0, sum(seqlens))
    pool = torch.randn(6, HV, V, K, generator=torch.Generator().manual_seed(1))
    work, slots = pool.clone(), [2, 4]
    cu = torch.tensor([0, *seqlens]).cumsum(0).to(torch.int32)
    o = recurrence(kernel, q, k, v, a, b, A_log, dt_bias, work, cu_seqlens=cu,
                   ssm_state_indices=torch.tensor(slots, dtype=torch.int32))
    ref_o, ref_final = gated_delta_rule(q, k, v, gate(a, A_log, dt_bias)[None], b.sigmoid()[None], K ** -0.5,
                                        initial_state=pool[slots].transpose(-1, -2), output_final_state=True,
                                        cu_seqlens=cu, use_qk_l2norm=True, mode="recurrent")
    errors = dict(output=rel(o, ref_o), **{f"slot {s}": rel(work[s], ref_final[n].transpose(-1, -2))
                                           for n, s in enumerate(slots)})
    assert max(errors.values()) <= RTOL, f"sequences of {seqlens} tokens in slots {slots}: {errors}"
    assert all(torch.equal(work[s], pool[s]) for s in (0, 1, 3, 5)), "a slot no sequence holds changed"


@pytest.mark.parametrize("T", [
    1,
    pytest.param(3, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
        "vLLM 0.33.0: fused_sigmoid_gating_delta_rule_update(is_kda=True) steps the gate by p_a += HV "
        "(fused_sigmoid_gating.py:178) where KDA's [T, HV, K] gate is HV * K apart (:92)"))),
], ids=["tokens-1", "tokens-3"])
def test_fused_sigmoid_gating_kda_matches_the_float64_kda(T):
    """is_kda=True: a verify call of one sequence of T tokens from slot 1 (indices [[1, .., T]], 1
    accepted): the outputs and the last token's state against linattn's KDA."""
    q, k, v, a, b, A_log, dt_bias = inputs(0, T, kda_gate=True)
    pool = torch.randn(T + 1, HV, V, K, generator=torch.Generator().manual_seed(1))
    work = pool.clone()
    gating = load_vllm(f"{FLA_OPS}.fused_sigmoid_gating")
    o, _ = gating.fused_sigmoid_gating_delta_rule_update(
        A_log, a, b, dt_bias, q, k, v, initial_state=work, inplace_final_state=True,
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32),
        ssm_state_indices=torch.arange(1, T + 1, dtype=torch.int32)[None],
        num_accepted_tokens=torch.tensor([1], dtype=torch.int32), use_qk_l2norm_in_kernel=True, is_kda=True)
    ref_o, ref_final = kda(q, k, v, gate(a, A_log, dt_bias)[None], b.sigmoid()[None], K ** -0.5,
                           initial_state=pool[1:2].transpose(-1, -2), output_final_state=True, use_qk_l2norm=True,
                           mode="recurrent")
    errors = {f"output token {t}": rel(o[0, t], ref_o[0, t]) for t in range(T)}
    errors[f"slot {T}"] = rel(work[T], ref_final[0].transpose(-1, -2))
    assert max(errors.values()) <= RTOL, f"is_kda=True, {T} tokens: {errors}"


@pytest.mark.parametrize("padding_slot", [
    0,
    pytest.param(-1, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
        "vLLM 0.33.0: causal_conv1d_update skips only slot == null_block_id (causal_conv1d.py:698-704); slot -1 "
        "passes its mask (:785) and the store (:808-816) writes one slot before the pool"))),
], ids=["null-block-0", "pad-slot-minus-1"])
def test_conv_update_padding_row_touches_nothing_outside_its_rows(padding_slot):
    """A decode of 3 rows, the middle one padding at `padding_slot`; the pool is a view of a larger
    buffer (as vLLM's states are views of the KV cache's raw tensor), so a write before the pool is
    seen: the real rows match the float64 conv, the padding row writes nothing."""
    conv = load_vllm("vllm.model_executor.layers.mamba.ops.causal_conv1d")
    D, W, P = 8, 4, 5
    gen = torch.Generator().manual_seed(0)
    buffer = torch.randn(1 + P, D, W - 1, generator=gen)  # the row before the pool, then the pool
    x, weight = torch.randn(3, D, generator=gen), torch.randn(D, W, generator=gen)
    work, slots = buffer.clone(), [2, padding_slot, 3]
    y = conv.causal_conv1d_update(x.clone(), work[1:], weight, None, "silu",
                                  conv_state_indices=torch.tensor(slots, dtype=torch.int32), validate_data=True)
    real = [0, 2]
    ref_y, ref_state = short_conv(x[real, None], weight, activation="silu",
                                  initial_state=buffer[1:][[slots[r] for r in real]], output_final_state=True)
    assert rel(y[real], ref_y[:, 0]) <= RTOL and rel(work[1:][[2, 3]], ref_state) <= RTOL
    changed = [s - 1 for s in range(1 + P) if not torch.equal(work[s], buffer[s]) and s - 1 not in (2, 3)]
    assert not changed, f"the padding row at slot {padding_slot} wrote slot(s) {changed} (-1: before the pool)"
