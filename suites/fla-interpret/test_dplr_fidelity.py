"""The emulated chunk_dplr_delta_rule against fla's own kernels, interpreted: one packed case (a
length-1 sequence, initial and final states, a scale), RWKV-7's inputs (a = -kk, b = kk·iclr, a
log decay in RWKV-7's (-0.61, 0)), forward and backward, bound fidelity.RTOL. fla's public entry
takes float32 with a warning (that the kernels may not support it on some platforms)."""

import warnings

import torch

from fidelity import F32, F64, assert_emulated, assert_fidelity, backward, cotangents, draw

CU = [0, 1, 17, 24]
H, K, V = 2, 16, 16
SCALE = 0.5


def test_chunk_dplr_delta_rule_matches_fla_interpreted():
    from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule as fla_op

    from linattn.emulation import fla_on_cpu

    gen = torch.Generator().manual_seed(4200)
    T, N = CU[-1], len(CU) - 1
    kk, iclr = draw(gen, (1, T, H, K), "unit_vector"), draw(gen, (1, T, H, K), "unit")
    values = {"q": draw(gen, (1, T, H, K)), "k": draw(gen, (1, T, H, K)) / K ** 0.5, "v": draw(gen, (1, T, H, V)),
              "a": -kk, "b": (kk * iclr).to(F32).to(F64),
              "gk": -0.6065306597126334 * draw(gen, (1, T, H, K), "unit"), "initial_state": draw(gen, (N, H, K, V))}
    values["gk"] = values["gk"].to(F32).to(F64)
    cu = torch.tensor(CU, dtype=torch.long)

    fla_leaves = {n: t.to(F32).requires_grad_() for n, t in values.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fla's float32 note
        fla_out = fla_op(**fla_leaves, scale=SCALE, output_final_state=True, cu_seqlens=cu)
        with fla_on_cpu():
            from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule

            assert_emulated(chunk_dplr_delta_rule, "chunk_dplr_delta_rule")
            emu_leaves = {n: t.to(F64).requires_grad_() for n, t in values.items()}
            emu_out = chunk_dplr_delta_rule(**emu_leaves, scale=SCALE, output_final_state=True, cu_seqlens=cu)
    cots = cotangents(emu_out, None)
    backward(fla_out, cots)
    backward(emu_out, cots)
    fla_res = {"o": fla_out[0], "final_state": fla_out[1], **{f"grad {n}": t.grad for n, t in fla_leaves.items()}}
    emu_res = {"o": emu_out[0], "final_state": emu_out[1], **{f"grad {n}": t.grad for n, t in emu_leaves.items()}}
    assert all(t is not None for t in fla_res.values()), "fla's kernels left a gradient out"
    assert_fidelity(fla_res, emu_res, "chunk_dplr_delta_rule", cu_seqlens=CU)
