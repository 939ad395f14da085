"""vLLM 0.33.0 (no upstream report found): `causal_conv1d_update` given a padding row at slot -1
(sglang's and older vLLM's PAD_SLOT_ID) reads and writes the conv state one slot before the pool.

    python suites/live_bugs/vllm_causal_conv1d_update_negative_slot.py  # CUDA, or a CPU (interpreter)

The kernel skips a row only when its slot `== null_block_id` (0; layers/mamba/ops/causal_conv1d.py:698-704);
its load mask checks `slot < num_cache_lines` and nothing below 0 (:785), and the store (:808-816) has no
bound: slot -1 loads the W - 1 columns before `conv_state` and stores the shifted window there. Here the
pool is a view of a larger buffer (as vLLM's states are views of the KV cache's raw tensor), so the
row before it stands for the memory before the pool and the out-of-bounds access is observable instead of
undefined. Compared, on a decode call of 3 rows at slots [2, -1, 3]: each row's output and slot against a
float64 loop of the kernel's conv (window = the slot's columns then x, silu), and the row before the pool.
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # vLLM's Triton kernels on a CPU: the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # suites/: the loader of the pinned files

import triton  # noqa: E402
from clients.engines.fetch import VLLM  # noqa: E402
from clients.engines.loader import load_vllm  # noqa: E402

conv = load_vllm("vllm.model_executor.layers.mamba.ops.causal_conv1d")
dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
D, W, P, gen = 8, 4, 5, torch.Generator().manual_seed(0)
buffer = torch.randn(1 + P, D, W - 1, generator=gen)  # [the row before the pool, then the pool's P slots]
x, weight = torch.randn(3, D, generator=gen), torch.randn(D, W, generator=gen)
slots = [2, -1, 3]


def loop(state, xr):
    """float64: window = the slot's W - 1 columns then the token; y = silu(sum(window * weight)); the
    new state is the window's last W - 1 columns."""
    window = torch.cat([state.double(), xr.double()[:, None]], -1)
    return F.silu((window * weight.double()).sum(-1)), window[:, 1:]


def rel(a, b):  # relative Frobenius error
    return ((a.cpu().double() - b).norm() / b.norm()).item()


print(f"vllm {VLLM.version} (its kernel files, sha256 as in the wheel), torch {torch.__version__}, "
      f"triton {triton.__version__}, {dev}{' (TRITON_INTERPRET=1)' if dev == 'cpu' else ''}, float32\n"
      f"causal_conv1d_update: 3 rows, conv_state_indices {slots}, a pool of {P} slots [{D}, {W - 1}] (a view of "
      f"buffer[1:]), validate_data=True")
work = buffer.to(dev).clone()
y = conv.causal_conv1d_update(x.to(dev).clone(), work[1:], weight.to(dev), None, "silu",
                              conv_state_indices=torch.tensor(slots, dtype=torch.int32, device=dev),
                              validate_data=True)
for row, slot in enumerate(slots):
    ref_y, ref_state = loop(buffer[1 + slot], x[row])
    where = "its slot" if slot >= 0 else "the row before the pool (buffer[0])"
    print(f"  row {row} (slot {slot}): output vs the loop from {where}: {rel(y[row], ref_y):.2e}; "
          f"{where} vs the loop's new state: {rel(work[1 + slot], ref_state):.2e}")
untouched = [s for s in range(P) if s not in slots]
print(f"  the row before the pool, which no slot names: max |change| {(work[0].cpu() - buffer[0]).abs().max():.2e} "
      f"(written out of bounds; no error raised); pool slots {untouched} unchanged: "
      f"{all(torch.equal(work[1 + s].cpu(), buffer[1 + s]) for s in untouched)}")
