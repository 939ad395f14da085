"""megatron-core's GatedDeltaNet described for pytest-linattn's sharded-parity harness.

Every callable is module-level (the harness pickles them by reference to the ranks):

    process_groups   Megatron's own parallel_state over the spawned world (TP fastest, as the harness)
    build            the GDN layer from Megatron's spec for the placement
    shard / unshard  the reference's weights (Qwen3.5 or Qwen3-Next layout) <-> Megatron's per TP
                     rank, by linattn.layers' adapters
    forward_*        Megatron's [T, B, hidden] call, unpacked (sbhd) or packed (THD, PackedSeqParams)
    finalize_grads   Megatron's own gradient finalization (finalize_model_grads) after backward

`megatron_gdn_layer(packed, family)` puts them together as a `pytest_linattn.ShardedLayer`;
`CONFIG` is the same layer as `linattn.layers`' GDN (the float64 reference the tests compare with).
The fla ops the layer calls need `linattn.emulation.fla_on_cpu` active on the ranks (the tests
use the `fla_on_cpu` fixture); everything else it needs on a CPU is in `cpu`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from . import cpu  # first: sets the environment Megatron's modules read at import
from linattn.layers import LinearAttentionConfig, from_megatron_state_dicts, to_megatron_state_dict
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_gated_delta_net_module_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from pytest_linattn import ShardedLayer

__all__ = ["CONFIG", "REPLICATED", "build", "finalize_grads", "forward_packed", "forward_unpacked",
           "megatron_gdn_layer", "process_groups", "shard", "unshard", "unshard_no_param_grads",
           "unshard_without_out_norm"]

# 4 key heads, 2 value heads each: TP 2 x CP 2 leaves every rank one key head (Megatron's CP
# all-to-all splits each TP rank's heads again over CP)
CONFIG = LinearAttentionConfig("qwen3_5", hidden_size=32, num_k_heads=4, num_v_heads=8, head_k_dim=8,
                               head_v_dim=6, conv_size=4, norm_eps=1e-6)

# Megatron's name of the one TP-replicated parameter (the gated RMSNorm's weight, [head_v_dim])
REPLICATED = frozenset({"out_norm.weight"})


def megatron_config(placement, dtype) -> TransformerConfig:
    c = CONFIG
    return TransformerConfig(
        num_layers=1, hidden_size=c.hidden_size, num_attention_heads=4, normalization="RMSNorm",
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1],
        linear_conv_kernel_dim=c.conv_size, linear_key_head_dim=c.head_k_dim,
        linear_value_head_dim=c.head_v_dim, linear_num_key_heads=c.num_k_heads,
        linear_num_value_heads=c.num_v_heads, activation_func=F.silu, layernorm_epsilon=c.norm_eps,
        params_dtype=dtype,
        use_cpu_initialization=True,  # the linears' weights on the CPU
        perform_initialization=False,  # the harness loads the weights; skips the CUDA RNG tracker
        tensor_model_parallel_size=placement.tp, context_parallel_size=placement.cp,
        sequence_parallel=placement.sequence_parallel,
    )


def process_groups(placement) -> ProcessGroupCollection:
    """Megatron's parallel_state for this placement (re-initialised: rank processes are reused)."""
    cpu.install()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=placement.tp,
                                             context_parallel_size=placement.cp)
    return ProcessGroupCollection.use_mpu_process_groups()


def build(placement, groups, dtype, device):
    if torch.device(device).type != "cpu":
        raise ValueError(f"this example runs Megatron's GDN on the CPU (fla_on_cpu); got device {device}")
    cfg = megatron_config(placement, dtype)
    spec = get_gated_delta_net_module_spec(cfg, backend=cpu.CPUBackend())
    return spec.module(cfg, spec.submodules, layer_number=1, pg_collection=groups)


def shard(full, placement, tp_rank, family="qwen3_5"):
    """TP rank `tp_rank`'s Megatron weights from the reference's (`family`'s layout)."""
    return to_megatron_state_dict(full, _config(family), tp_rank=tp_rank, tp_size=placement.tp)


def unshard(local_grads, placement, family="qwen3_5"):
    """The reference's gradients from the TP ranks' Megatron gradients (out_norm.weight from TP
    rank 0; the harness checks every TP rank holds the same one)."""
    return from_megatron_state_dicts(local_grads, _config(family))


def _config(family):
    return dataclasses.replace(CONFIG, family=family)


def forward_unpacked(module, x, cu_seqlens, placement):
    """One sequence in Megatron's sbhd layout ([T, B, hidden], B = 1, no packed_seq_params)."""
    if cu_seqlens.numel() != 2:
        raise ValueError(f"forward_unpacked takes one sequence, got cu_seqlens {cu_seqlens.tolist()}")
    y, _ = module(x.transpose(0, 1), None)
    return y.transpose(0, 1)


def forward_packed(module, x, cu_seqlens, placement):
    """Packed sequences in Megatron's THD format: [T, 1, hidden] with PackedSeqParams(cu_seqlens)."""
    cu = cu_seqlens.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    y, _ = module(x.transpose(0, 1), None, packed_seq_params=params)
    return y.transpose(0, 1)


def finalize_grads(module, placement):
    """Megatron's finalize_model_grads on the bare layer: its TP reductions of replicated weights'
    gradients (SP-tagged norms and the like); the DP x CP sum is the harness's."""
    cpu.ready_for_finalizer(module)
    finalize_model_grads([module])


def megatron_gdn_layer(packed: bool, family: str = "qwen3_5", *, check_out_norm: bool = True,
                       param_grads: bool = True) -> ShardedLayer:
    """The client for the harness: Megatron's GDN against a reference of `family`'s layout
    (qwen3_5 or qwen3_next). check_out_norm=False leaves out_norm.weight's gradient out of the
    comparison, param_grads=False every parameter's (the output and the input gradient only, as
    Megatron's own parity test compares); the reference must not compute them either."""
    unshard_grads = unshard if check_out_norm else unshard_without_out_norm
    if not param_grads:
        unshard_grads = unshard_no_param_grads
    return ShardedLayer(build=build, process_groups=process_groups, after_backward=finalize_grads,
                        shard=functools.partial(shard, family=family),
                        unshard=functools.partial(unshard_grads, family=family),
                        replicated=REPLICATED if check_out_norm and param_grads else frozenset(),
                        forward=forward_packed if packed else forward_unpacked)


def unshard_no_param_grads(local_grads, placement, family="qwen3_5"):
    """No parameter's gradient (for a check of the output and the input gradient only)."""
    return dict.fromkeys(unshard(local_grads, placement, family))


def unshard_without_out_norm(local_grads, placement, family="qwen3_5"):
    """unshard, leaving out out_norm.weight's gradient (for the SP-off checks of everything else)."""
    return {**unshard(local_grads, placement, family), "norm.weight": None}
