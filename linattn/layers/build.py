"""`build_layer`: one entry for every family, with its TP / SP / CP placement."""

from __future__ import annotations

from .config import LinearAttentionConfig
from .gated_deltanet import GatedDeltaNet
from .kimi_delta_attention import KimiDeltaAttention

__all__ = ["build_layer"]

LAYER_CLASSES = {"qwen3_next": GatedDeltaNet, "qwen3_5": GatedDeltaNet, "kda": KimiDeltaAttention}


def build_layer(config: LinearAttentionConfig, **options):
    """The layer of `config.family`, holding this rank's TP shard of the heads. options (keyword
    only, see HeadShardedLinearAttention): tp_group=None, cp_group=None, cp_layout="contiguous",
    sequence_parallel=False, dtype=torch.float32, device="cpu".

    tp_group: heads split over it (None: replicated layer); load each rank's weights with
    `shard_state_dict(full, config, tp_rank, tp_size)`.

    cp_group: context parallelism, the packed batch `[1, T, hidden]` split over its ranks (None:
    no CP). Every CP rank holds the same weights. cp_layout says which tokens a CP rank holds:
    "contiguous" or "zigzag", defined in `linattn.parallel.cp.layout` (`cp_shard` gives them); the
    layer moves zigzag tokens to the contiguous layout and back with one all-to-all each way.
    Short-conv halos and the recurrent state of sequences that cross a rank boundary are exchanged
    exactly (linattn.parallel.cp: our exchange over gloo on CPU, fla's CP kernels on CUDA); a rank
    piece may be shorter than the conv width.

    sequence_parallel: with TP > 1 the layer takes and returns a contiguous 1/tp slice of this
    rank's tokens: first the CP shard, then split again over TP (rank tp_rank holds slice tp_rank
    of the CP shard, in the CP layout's local order).

    TP x CP: the groups must form one grid over the world (`linattn.parallel.new_groups(tp, cp)`,
    Megatron order: TP fastest).

    Gradients: replicated weights (norm weights, KDA's f_a_proj / g_a_proj) get their gradient
    summed over TP inside the layer. Nothing is summed over CP (see linattn.parallel.cp).

    forward(hidden_states `[1, T_local, hidden]`, cu_seqlens GLOBAL int32 `[N + 1]`) ->
    `[1, T_local, hidden]`, T_local = T / cp (/ tp under SP). Raises ValueError when T (or a
    sequence length, zigzag) does not divide as the layout needs, or the groups do not tile the world.
    """
    if not isinstance(config, LinearAttentionConfig):
        raise ValueError(f"config must be a LinearAttentionConfig, got {type(config).__name__}")
    return LAYER_CLASSES[config.family](config, **options)
