"""fla 0.6.0's public linear-attention ops computed with linattn's float64 references.

    from linattn.emulation import fla_on_cpu

    with fla_on_cpu():                 # compute_dtype=torch.float64
        layer = fla.layers.KimiDeltaAttention(...)   # fla's own layer, unchanged
        y, *_ = layer(x)               # chunk_kda, ShortConvolution, FusedRMSNormGated: emulated

So code written on fla (fla's layers, transformers' modules with fla installed, megatron-core's
GatedDeltaNet, a team's head-sharded layer) runs on a CPU, in float64, over gloo, and the
plugin's parity checks apply to it. The pytest fixture ``fla_on_cpu`` (and the option
``--linattn-fla-on-cpu``) keeps it active in the test and in every rank ``spawn`` runs.

What is emulated, per module (each declares ``PATCHES``):

    gated_delta_rule  chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, fused_gdn_gate
    kda          chunk_kda, fused_recurrent_kda, fused_kda_gate
    delta_product  chunk_gated_delta_product (gated DeltaProduct: several steps per token)
    dplr         chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule (the DPLR delta rule),
                 chunk_rwkv7, fused_recurrent_rwkv7, fused_mul_recurrent_rwkv7
    rwkv7        RWKV7Attention's other kernels: token_shift, fused_addcmul_rwkv7, fused_k_rwkv7,
                 gate_output_correction
    gdn2         chunk_gdn2, fused_recurrent_gdn2 (Gated DeltaNet 2: channel-wise erase and write gates)
    precond      chunk_precond_gated_delta_rule, fused_recurrent_precond_gated_delta_rule,
                 chunk_precond_kda, fused_recurrent_precond_kda (the preconditioned delta rules)
    serving      fused_recurrent_kda_fwd: KDA's state-pool entry (ssm_state_indices,
                 num_accepted_tokens, inplace_final_state), as vLLM's decode calls it
    conv         causal_conv1d, ShortConvolution
    norm         FusedRMSNormGated and the gated-norm functions, l2norm
    cp           build_cp_context; the ops' and the conv's ``cp_context=`` run linattn.parallel.cp's
                 exchange over the context's group

The delta-rule families share ``delta_rule_options`` (fla's option checks in fla's words, the
refusals, the run on the references); ``delta_rules`` re-exports the GDN and KDA ops, their gates
and l2norm under the name they first had.

Any argument value the emulation does not implement raises NotImplementedError naming the
function, the argument and the value. The ops compute on the inputs' device (CPU here); outputs
come back in the input dtype, recurrent states in float32 (float64 for float64 inputs), as fla's.
See docs/fla-on-cpu.md.

``fla_interpreted()`` (module ``interpreted``) is the other mode: fla's own Triton kernels under
Triton's interpreter, float32, slow; it checks the emulation against fla's code.
"""

from .interpreted import fla_interpreted
from .modes import active_modes, modes_context
from .patching import FLA_VERSION, active_compute_dtype, fla_on_cpu

__all__ = ["FLA_VERSION", "active_compute_dtype", "active_modes", "fla_interpreted", "fla_on_cpu", "modes_context"]
