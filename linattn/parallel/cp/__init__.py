"""Context parallelism (CP) for linear-attention ops: one packed batch of sequences split over
the ranks of a CP group, tokens on dim 1.

    layout      LAYOUTS (contiguous, zigzag: the rule is stated there), cp_shard / cp_unshard,
                cp_token_index, relayout_plan_to_contiguous; padded THD: padded_runs
    context     build_context -> CPContext: this rank's contiguous piece; its ``relayout`` moves
                a layout's tokens to the piece and back (one all-to-all each way)
    comm        the collectives, as autograd functions
    conv        short_conv: the W-1 token halo of sequences that cross a rank boundary
    delta_rule  delta_rule: the recurrent state of sequences that cross a rank boundary
    fla         backend="fla" of both ops: fla's CP kernels

    ctx = cp.build_context(cu_seqlens, cp_group, layout)      # cu_seqlens: GLOBAL
    # padded THD: cp.build_context(cu_seqlens, cp_group, layout, cu_seqlens_padded=...)
    x = ctx.relayout.to_contiguous(x)                         # zigzag: all-to-all; else identity
    y = cp.short_conv(x, weight, activation="silu", cp_context=ctx)
    o = cp.delta_rule(q, k, v, g, beta, op="kda", scale=scale, use_qk_l2norm=True, cp_context=ctx)
    o = ctx.relayout.from_contiguous(o)

The ops take ``backend="exchange"`` (rank-to-rank exchange around the single-process op, any
device) or ``"fla"`` (fla's CP kernels, CUDA); None picks fla for CUDA tensors.

Gradients: nothing is summed over CP. Every parameter gradient (conv weight and bias, and every
parameter upstream or downstream of the ops) is this rank's partial sum over its tokens, completed
by the training loop's gradient all-reduce over the data x context parallel ranks, as for any
token split (Megatron-LM's usual reduction).

Every rank of the CP group must call these ops in the same order, and call backward through them
if any rank does. A ``cp_group`` of None means no CP (one rank), as everywhere in linattn.parallel.
"""

from .context import BACKENDS, CPContext, Relayout, build_context
from .conv import short_conv
from .delta_rule import OPS, delta_rule
from .layout import (LAYOUTS, RelayoutPlan, cp_shard, cp_token_index, cp_unshard, padded_runs,
                     relayout_plan_to_contiguous)

__all__ = [
    "BACKENDS",
    "CPContext",
    "LAYOUTS",
    "OPS",
    "Relayout",
    "RelayoutPlan",
    "build_context",
    "cp_shard",
    "cp_token_index",
    "cp_unshard",
    "delta_rule",
    "padded_runs",
    "relayout_plan_to_contiguous",
    "short_conv",
]
