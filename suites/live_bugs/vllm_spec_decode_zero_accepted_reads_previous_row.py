"""vLLM 0.33.0 (no upstream report found): in a speculative-decoding call, a row given
`num_accepted_tokens = 0` starts from the previous row's last slot, another sequence's state.

    python suites/live_bugs/vllm_spec_decode_zero_accepted_reads_previous_row.py  # CUDA, or a CPU (interpreter)

`fused_sigmoid_gating_delta_rule_update` (third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:106-110)
and `fused_recurrent_gated_delta_rule` (fused_recurrent.py:107-111) read row n's first state at slot
`ssm_state_indices[n * stride + num_accepted_tokens[n] - 1]`: with 0 accepted, row n - 1's last slot (row 0:
the int before the tensor), without an error. Compared, on a verify call of 2 rows x 2 tokens, indices
[[1, 2], [3, 4]], num_accepted_tokens [1, 0]: row 1 against a float64 loop of the kernel's recurrence from
its own first slot, and from row 0's last state (the interpreter runs row 0's programs first; on a GPU
row 1's load races row 0's store to slot 2).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_gdn_recurrence import KERNELS, draws, header, loop, rel, run_kernel  # noqa: E402

x, pool = draws(T=4)
idx, accepted, cu = (torch.tensor(v, dtype=torch.int32) for v in ([[1, 2], [3, 4]], [1, 0], [0, 2, 4]))
header("verify call: 2 rows x 2 tokens, ssm_state_indices [[1, 2], [3, 4]], num_accepted_tokens [1, 0]")
row0_o, row0_state = loop(x, pool[1], (0, 1))
own_o, own_h = loop(x, pool[3], (2, 3))
prev_o, prev_h = loop(x, row0_state, (2, 3))
for name in KERNELS:
    o, work = run_kernel(name, x, pool, cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=accepted)
    print(f"  {name}: row 0 (1 accepted) vs the loop from slot 1: output {rel(o[0, :2], row0_o):.2e}; "
          f"row 1 (own slots [3, 4], 0 accepted):")
    print(f"    vs the loop from its first slot 3: output {rel(o[0, 2:], own_o):.2e}, slot 4 {rel(work[4], own_h):.2e}")
    print(f"    vs the loop from row 0's last state (slot 2): output {rel(o[0, 2:], prev_o):.2e}, "
          f"slot 4 {rel(work[4], prev_h):.2e} (started from another sequence's state)")
