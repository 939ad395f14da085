"""The emulated chunk_gated_delta_product against fla's own kernels, interpreted: one packed case
(a length-1 sequence, 2 steps per token, initial and final states, the in-kernel l2norm, a scale),
forward and backward, bound fidelity.RTOL.

fla's public entry asserts its inputs are not float32 and the interpreter runs float32 only
(float64 is refused by the kernels, bf16 is wrong in Triton 3.9's interpreter), so fla's side
calls the autograd function behind the entry, ChunkGatedDeltaProductFunction, with the entry's
arguments: the same kernels, forward (chunk_deltaproduct_h / _o) and backward (the gated delta
rule's over the step stream).
"""

import torch

from fidelity import F32, F64, assert_emulated, assert_fidelity, backward, cotangents, draw

CU = [0, 1, 17, 24]
H, K, V, N_STEPS = 2, 16, 16, 2
SCALE = 0.3


def test_chunk_gated_delta_product_matches_fla_interpreted():
    from fla.ops.gated_delta_product.chunk import ChunkGatedDeltaProductFunction

    from linattn.emulation import fla_on_cpu

    gen = torch.Generator().manual_seed(4100)
    T, N = CU[-1], len(CU) - 1
    values = {"q": draw(gen, (1, T, H, K)), "k": draw(gen, (1, T * N_STEPS, H, K), "unit_vector"),
              "v": draw(gen, (1, T * N_STEPS, H, V)), "g": draw(gen, (1, T, H), "logdecay"),
              "beta": draw(gen, (1, T * N_STEPS, H), "unit"), "initial_state": draw(gen, (N, H, K, V))}
    cu = torch.tensor(CU, dtype=torch.long)

    fla_leaves = {n: t.to(F32).requires_grad_() for n, t in values.items()}
    x = fla_leaves
    fla_out = ChunkGatedDeltaProductFunction.apply(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, N_STEPS,
                                                   x["initial_state"], True, True, cu, None, None)
    with fla_on_cpu():
        from fla.ops.gated_delta_product import chunk_gated_delta_product

        assert_emulated(chunk_gated_delta_product, "chunk_gated_delta_product")
        emu_leaves = {n: t.to(F64).requires_grad_() for n, t in values.items()}
        emu_out = chunk_gated_delta_product(**emu_leaves, num_householder=N_STEPS, scale=SCALE,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    cots = cotangents(emu_out, None)
    backward(fla_out, cots)
    backward(emu_out, cots)
    fla_res = {"o": fla_out[0], "final_state": fla_out[1], **{f"grad {n}": t.grad for n, t in fla_leaves.items()}}
    emu_res = {"o": emu_out[0], "final_state": emu_out[1], **{f"grad {n}": t.grad for n, t in emu_leaves.items()}}
    assert all(t is not None for t in fla_res.values()), "fla's kernels left a gradient out"
    assert_fidelity(fla_res, emu_res, "chunk_gated_delta_product", cu_seqlens=CU)
