"""One entry per op; the variant (torch on CPU, fla on GPU) is a parameter, never a file to import.

    from linattn.kernels import short_conv, short_conv_step, gated_delta_rule, kda, log_decay, gated_rms_norm, float32_linear

Importing this package does not import fla: the GPU variants import it on first use.
"""

from linattn.kernels._delta_rules import gated_delta_rule, gdn_as_kda_inputs, kda, log_decay
from linattn.kernels._linear import float32_linear
from linattn.kernels._norm import at_least_float32, gated_rms_norm
from linattn.kernels._short_conv import short_conv, short_conv_step

__all__ = ["at_least_float32", "float32_linear", "gated_delta_rule", "gated_rms_norm", "gdn_as_kda_inputs", "kda", "log_decay",
           "short_conv", "short_conv_step"]
