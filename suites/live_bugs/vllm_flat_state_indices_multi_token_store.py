"""vLLM 0.33.0 (no upstream report found): with one state slot per sequence (1-D `ssm_state_indices`) and
several tokens per sequence, the in-place store puts token t's state into the slot t places on: the next
requests' slots.

    python suites/live_bugs/vllm_flat_state_indices_multi_token_store.py  # CUDA, or a CPU (interpreter)

`fused_sigmoid_gating_delta_rule_update` (third_party/flash_linear_attention/ops/fused_sigmoid_gating.py:157-166)
and `fused_recurrent_gated_delta_rule` (fused_recurrent.py:153-162) store the state after token t at slot
`ssm_state_indices[n * stride_indices_seq + t]` (`stride_indices_tok`, fused_sigmoid_gating.py:237, is never
read); the indices "map the input sequences to the initial/final states" (fused_recurrent.py:576). Compared,
on 2 sequences of 2 and 1 tokens, indices [2, 4]: each against a float64 loop of the kernel's recurrence
from its slot (the interpreter runs sequence 0's programs first; on a GPU the two race on slot 4).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_gdn_recurrence import KERNELS, draws, header, loop, rel, run_kernel  # noqa: E402

x, pool = draws(T=3)
idx, cu = (torch.tensor(v, dtype=torch.int32) for v in ([2, 4], [0, 2, 3]))
header("one call: sequences of 2 and 1 tokens (cu_seqlens [0, 2, 3]), ssm_state_indices [2, 4] (1-D), in place; "
       "each vs a float64 loop from its slot")
seq0_o, seq0_h = loop(x, pool[2], (0, 1))
_, first_h = loop(x, pool[2], (0,))
seq1_o, seq1_h = loop(x, pool[4], (2,))
moved_o, _ = loop(x, seq0_h, (2,))
for name in KERNELS:
    o, work = run_kernel(name, x, pool, cu_seqlens=cu, ssm_state_indices=idx)
    print(f"  {name}:\n    sequence 0 (2 tokens, slot 2): output {rel(o[0, :2], seq0_o):.2e}; "
          f"slot 2 vs its final state {rel(work[2], seq0_h):.2e}, vs after token 0 {rel(work[2], first_h):.2e}")
    print(f"    sequence 1 (1 token, slot 4): output {rel(o[0, 2:], seq1_o):.2e}, slot 4 {rel(work[4], seq1_h):.2e}; "
          f"as if started from sequence 0's final state: output {rel(o[0, 2:], moved_o):.2e}")
