"""fla 0.6.0's delta-rule ops, their gates and l2norm under their first home's name: re-exported from
the modules that emulate them, so ``from linattn.emulation import delta_rules`` keeps working.

    gated_delta_rule  chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, fused_gdn_gate
    kda               chunk_kda, fused_recurrent_kda, fused_kda_gate
    norm              l2norm
    delta_rule_options  what they share: fla's option checks, the refusals, the run on the references

``PATCHES`` here is those ops' entries of the three modules' ``PATCHES`` (fla_on_cpu installs them
from the modules themselves).
"""

from __future__ import annotations

from . import gated_delta_rule as _gated_delta_rule, kda as _kda
from .delta_rule_options import MAX_KEY_DIM, SAFE_GATE_LOWEST
from .gated_delta_rule import chunk_gated_delta_rule, fused_gdn_gate, fused_recurrent_gated_delta_rule
from .kda import chunk_kda, fused_kda_gate, fused_recurrent_kda
from .norm import l2norm

__all__ = [
    "MAX_KEY_DIM", "SAFE_GATE_LOWEST", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
    "fused_recurrent_kda", "fused_kda_gate", "fused_gdn_gate", "l2norm", "PATCHES",
]

PATCHES = {**_gated_delta_rule.PATCHES, **_kda.PATCHES, "fla.modules.norm.l2norm:l2norm": l2norm}
