"""The gate parameters' gradients of a gated-delta-rule op under strong decay, against float64
(GDN's op; KDA's with per_channel).

A GDN layer hands its kernel the raw gate input `a` and the kernel computes the per-token log
decay g = -exp(A_log) * softplus(a + dt_bias) (fla's use_gate_in_kernel). Training reads three
gradients off it: the gate input's ("dg", what fla returns for g with the in-kernel gate),
A_log's (the sum over tokens of g times the log decay's gradient) and dt_bias's (the sum over
tokens of dg). All three are compared here, per tensor, by relative Frobenius error against the
float64 reference (linattn.reference.gated_delta_rule with the same gate computed in float64 on
the same rounded values); a failure names the worst sequence, token and value head (dg) or value
head (A_log, dt_bias), each head with its exp(A_log).

Why strong decay. Inside a chunk the op differentiates exp(G_i - G_j) (G the cumulative log
decay): dL/dG_i = rowsum_i(M) - colsum_i(M) with M = dA * A over the chunk's gated pair products.
M's diagonal (exp(0) = 1) appears in both sums and must cancel. Where decay is mild the gate
gradient is as large as M and a rounding residue of the cancellation is lost in it. Where a head
decays hard (log decay -0.2 to -45 a token: Qwen's exp(A_log) up to 16, a + dt_bias about 1),
its true gate gradient is tiny: the previous state, scaled by exp(g_t), barely reaches the
output. What the op computes is then the residue, and the chain rule multiplies it by
|g_t| (up to 45) into A_log's gradient, which sums the residue over every token of the head. A
fused backward that rounds one of the cancelling copies (a transpose through bf16 shared memory)
is within bf16 bounds at mild decay and off by O(1) at strong decay, while its forward is exact:
the strong-decay case is the one that sees it.

    DECAYS["strong"]: dt_bias = 1, the decay the fused-backward report measured with
    DECAYS["mild"]:   dt_bias = -4.5, where a fresh layer's dt_bias sits (inverse softplus of a dt
                      drawn in [1e-3, 1e-1]), log decay -0.001 to -1 a token

exp(A_log) is RATES repeated over the value heads at both: only the gate input's offset changes.

Measured (CPU, torch 2.13, seeds 0-15 at SIZES; the worst of the three tensors, usually dA_log):
linattn's torch kernels in bf16 (float32 compute on bf16 inputs, the cotangent arriving in bf16)
1.3e-3 to 5.1e-3 at strong decay, within the bf16 bound 2e-2; in float32 2.0e-7 to 4.6e-7 at mild
decay and 1.7e-7 to 7.0e-7 at strong decay (seeds 0-39: up to 1.4e-6), within 1e-5. linattn's chunked
form once took the decays' gradient as autograd does, through the cumulative decay G (a row sum
minus a column sum per G_i, the diagonal's exp(0) = 1 in both): the same cancellation in float32,
3.3e-6 to 1.7e-4 at strong decay (13 of 16 seeds above 1e-5), while mild decay was within. Now each
decay's gradient goes to the per-token log decay span by span (reference.delta_rule._chunk_terms).
KDA (per_channel: the gate input per key channel, dt_bias `[HV * K]`) in float32: 1.7e-7 to 2.4e-6
at strong decay (seeds 0-39), 2.3e-7 to 5.1e-7 at mild; through G it was 5.3e-5 to 5.1e-4, every
seed above 1e-5. KDA in bf16 at strong decay: 1.5e-3 to 2.3e-2 (seed 8's dA_log above the bound;
not checked here). The bf16-transpose plant (bug_record.plants_gate): dA_log 0.2 to 5.5 and dg 0.16
to 0.88 at strong decay, 3.7e-3 to 1.4e-2 at mild decay (within the bound: at mild decay a check
cannot see it).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from linattn import kernels, reference
from pytest_linattn.parity import assert_parity

RATES = (0.5, 2.0, 8.0, 16.0)  # exp(A_log) of the value heads, repeated: 0.5 to 16, Qwen's decay rates
DECAYS = {"strong": 1.0, "mild": -4.5}  # dt_bias of every value head
GATE_SCALE = 0.5  # the gate input a ~ N(0, 0.5^2) around dt_bias's offset
SEED = 2
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # DESIGN.md's float32 and bf16 bounds
NAMES = ("dg", "dA_log", "ddt_bias")


@dataclasses.dataclass(frozen=True)
class Sizes:
    cu_seqlens: tuple[int, ...] = (0, 47, 128)  # a sequence ending inside the first 64-token chunk, one across it
    key_heads: int = 2
    value_heads: int = 4
    head_k_dim: int = 32
    head_v_dim: int = 32


SIZES = Sizes()


def draw(seed: int = SEED, decay: str = "strong", sizes: Sizes = SIZES,
         per_channel: bool = False) -> dict[str, torch.Tensor]:
    """Float64 values of every input and the output's cotangent, seeded; none zero. per_channel: KDA's
    gate (the gate input `[1, T, HV, K]`, dt_bias `[HV * K]`), else GDN's (`[1, T, HV]`, `[HV]`)."""
    gen = torch.Generator().manual_seed(seed)
    T, H, HV = sizes.cu_seqlens[-1], sizes.key_heads, sizes.value_heads
    K, V = sizes.head_k_dim, sizes.head_v_dim

    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    rates = torch.tensor(RATES, dtype=torch.float64).repeat(-(-HV // len(RATES)))[:HV]
    channels = (K,) if per_channel else ()
    return dict(
        q=F.normalize(normal(1, T, H, K), dim=-1),
        k=F.normalize(normal(1, T, H, K), dim=-1),
        v=normal(1, T, HV, V),
        a=GATE_SCALE * normal(1, T, HV, *channels),
        beta=normal(1, T, HV).sigmoid(),
        A_log=rates.log(),
        dt_bias=torch.full((HV * (K if per_channel else 1),), DECAYS[decay], dtype=torch.float64),
        do=normal(1, T, HV, V),
    )


def _run(op, values, dtype, device, cu_seqlens, compute=None):
    """op's gate gradients: q, k, v, beta in `dtype`; the gate input, A_log, dt_bias in float32 (a
    layer's parameters and its gate projection's float32 output), or all in `compute`."""
    leaf_dtype = compute or torch.float32
    gate = {n: values[n].to(leaf_dtype).to(device).requires_grad_() for n in ("a", "A_log", "dt_bias")}
    q, k, v, beta = (values[n].to(compute or dtype).to(device) for n in ("q", "k", "v", "beta"))
    cu = torch.tensor(cu_seqlens, device=device)
    o, _ = op(q, k, v, gate["a"], beta, cu_seqlens=cu, use_gate_in_kernel=True, A_log=gate["A_log"],
              dt_bias=gate["dt_bias"])
    (o.double() * values["do"].to(device)).sum().backward()
    return dict(zip(NAMES, (gate[n].grad for n in ("a", "A_log", "dt_bias"))))


def reference_op(q, k, v, a, beta, *, cu_seqlens, use_gate_in_kernel, A_log, dt_bias):
    """linattn.reference.gated_delta_rule (or .kda for a per-channel gate input `[B, T, HV, K]`) in
    float64, the gate computed by the same formula in float64."""
    assert use_gate_in_kernel
    g = kernels.log_decay(a, A_log, dt_bias)
    op = reference.kda if a.dim() == 4 else reference.gated_delta_rule
    return op(q, k, v, g, beta, cu_seqlens=cu_seqlens)


@functools.lru_cache(maxsize=8)
def _reference_gradients(seed, decay, sizes, dtype, per_channel=False):
    values = draw(seed, decay, sizes, per_channel)
    # the reference runs on the values the op gets: q, k, v, beta rounded to dtype, the gate's in float32
    rounded = {n: (t.to(dtype) if n in ("q", "k", "v", "beta") else t.float() if n != "do" else t).double()
               for n, t in values.items()}
    return _run(reference_op, rounded, torch.float64, "cpu", sizes.cu_seqlens, compute=torch.float64)


def reference_gradients(seed=SEED, decay="strong", sizes=SIZES, dtype=torch.bfloat16,
                        per_channel=False) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in _reference_gradients(seed, decay, sizes, dtype, per_channel).items()}


def describe(sizes, per_channel=False):
    """Where the worst element of each gradient lies, in a layer's words: dg `[1, T, HV(, K)]` by sequence,
    token and value head (and key channel), A_log's `[HV]` by value head, dt_bias's `[HV]` by value head
    (KDA's `[HV * K]` by value head and key channel), each head with its decay rate."""
    bounds = list(sizes.cu_seqlens)

    def words(name, index):
        channel = None
        if name == "dg":
            head, channel = index[2], (index[3] if per_channel else None)
        elif name == "ddt_bias" and per_channel:
            head, channel = divmod(index[-1], sizes.head_k_dim)
        else:
            head = index[-1]
        rate = f"value head {head} (exp(A_log) = {RATES[head % len(RATES)]:g})"
        if channel is not None:
            rate += f", key channel {channel}"
        if name != "dg":
            return rate
        token = index[1]
        seq = max(i for i, b in enumerate(bounds[:-1]) if b <= token)
        return f"seq {seq} token {token - bounds[seq]} (global {token}), {rate}"
    return words


def assert_gate_gradients(op=None, *, dtype=torch.bfloat16, decay="strong", seed=SEED, sizes=SIZES,
                          device="cpu", rtol=None, label=None, per_channel=False) -> list[dict]:
    """op (kernels.gated_delta_rule's signature, or with per_channel kernels.kda's; None: linattn's
    entry) against the float64 reference: dg, dA_log, ddt_bias within rtol (None: BOUNDS[dtype]), per
    tensor. AssertionError with the assert_parity table, each failing tensor's worst element located
    (`describe`). Returns the records."""
    op = (kernels.kda if per_channel else kernels.gated_delta_rule) if op is None else op
    got = _run(op, draw(seed, decay, sizes, per_channel), dtype, device, sizes.cu_seqlens)
    family = "KDA " if per_channel else ""
    name = label or f"{family}gate gradients at {decay} decay ({str(dtype).removeprefix('torch.')}, seed {seed})"
    return assert_parity({n: t.detach() for n, t in got.items()},
                         reference_gradients(seed, decay, sizes, dtype, per_channel),
                         rtol=BOUNDS[dtype] if rtol is None else rtol, name=name,
                         cu_seqlens=torch.tensor(sizes.cu_seqlens), describe=describe(sizes, per_channel))
