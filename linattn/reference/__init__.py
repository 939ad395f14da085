"""Float64 references for every op: short conv, gated delta rule (GDN), KDA and gated DeltaProduct.

Output is float64 whatever the input dtype (compute_dtype=float32 runs the same math in float32
for the CPU kernels). Packed sequences come in through `cu_seqlens`, with fla's argument order and
shapes. Input rules live in `linattn.checks`.
"""

from .delta_product import gated_delta_product
from .delta_rule import gated_delta_rule, kda
from .dplr import dplr_delta_rule, rwkv7, rwkv7_kk_a
from .gdn2 import gdn2
from .precond import precond_gated_delta_rule, precond_kda
from .short_conv import short_conv

__all__ = ["dplr_delta_rule", "gated_delta_product", "gated_delta_rule", "gdn2", "kda", "precond_gated_delta_rule", "precond_kda", "rwkv7", "rwkv7_kk_a", "short_conv"]
