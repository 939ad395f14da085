"""One entry per op; the variant (torch on CPU, fla on GPU) is a parameter, never a file to import.

    from linattn.kernels import short_conv, gated_delta_rule, kda

Importing this package does not import fla: the GPU variants import it on first use.
"""

from linattn.kernels._delta_rules import gated_delta_rule, kda
from linattn.kernels._short_conv import short_conv

__all__ = ["gated_delta_rule", "kda", "short_conv"]
