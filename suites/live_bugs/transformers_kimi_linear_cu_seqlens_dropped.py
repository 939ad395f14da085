"""transformers 5.17.0, Kimi Linear (no upstream report found): packed documents' `cu_seq_lens_q`
never reaches fla's `chunk_kda`, so the KDA recurrence runs from one document into the next.

    python suites/live_bugs/transformers_kimi_linear_cu_seqlens_dropped.py     # CPU, float64, seconds

`KimiLinearDeltaAttention.forward` (modeling_kimi_linear.py:694) hands `chunk_kimi_delta_attention`
its kwargs as the model got them (`cu_seq_lens_q`, from DataCollatorWithFlattening); where fla is
installed the wrapper (`use_kernel_func_from_hub_with_fallback`, integrations/hub_kernels.py:884)
keeps only the names of fla's `chunk_kda` parameters, whose argument is `cu_seqlens`: the
boundaries are dropped, silently. (Qwen3-Next renames it: `cu_seqlens=kwargs.pop("cu_seq_lens_q")`.)
fla's kernels need a GPU: here a recorder with fla's `chunk_kda` signature stands in for it
(transformers resolves it from `fla.ops.kda` at import, as it resolves fla's own), records what it
receives and computes what fla computes for such a call with transformers' own torch KDA (one
sequence without `cu_seqlens`, a zero state per sequence with it). Compared: document 1's KDA
output as called against the same call given the documents' `cu_seqlens`.
"""
import functools

import fla
import fla.ops.kda
import torch

received = []


@functools.wraps(fla.ops.kda.chunk_kda)  # fla's signature: transformers keeps the kwargs it names
def recorder(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
    received.append(dict(kwargs, q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens))
    return kda(q, k, v, g, beta, cu_seqlens, initial_state=initial_state, output_final_state=output_final_state,
               **kwargs)


def kda(q, k, v, g, beta, cu_seqlens, **kwargs):  # fla's chunk_kda's contract, by transformers' torch KDA
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs = [torch_kda(*(t[:, a:b] for t in (q, k, v, g, beta)), **kwargs) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat([o for o, _ in outs], dim=1), outs[-1][1]


fla.ops.kda.chunk_kda = recorder  # before transformers' Kimi module resolves it
import transformers  # noqa: E402
from transformers import KimiLinearConfig  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as kimi  # noqa: E402

torch_kda = kimi.chunk_kimi_delta_attention.__wrapped__  # transformers' torch chunk_kimi_delta_attention
torch.manual_seed(0)
config = KimiLinearConfig(hidden_size=20, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"])
layer = kimi.KimiLinearDeltaAttention(config, layer_idx=0).double().eval()
for name, p in layer.named_parameters():  # the forget gate's dt_bias and A_log are created empty
    if name.endswith(("dt_bias", "A_log")):
        p.data.uniform_(-1, 1)
cu = torch.tensor([0, 5, 12], dtype=torch.int32)  # two packed documents, as DataCollatorWithFlattening gives them
with torch.no_grad():
    layer(torch.randn(1, 12, 20, dtype=torch.float64), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
          max_length_k=7)
    call = received[-1]
    inputs = [call.pop(name) for name in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    as_called, _ = kda(*inputs, **call)
    per_document, _ = kda(*inputs[:5], cu.long(), **call)
doc1 = slice(5, 12)
err = ((as_called[:, doc1] - per_document[:, doc1]).norm() / per_document[:, doc1].norm()).item()
print(f"transformers {transformers.__version__}, fla {fla.__version__}, torch {torch.__version__}, CPU, float64")
print(f"KimiLinearDeltaAttention called with cu_seq_lens_q={cu.tolist()}: chunk_kda received cu_seqlens="
      f"{inputs[5]}, and {sorted(call)}")
print(f"document 1's KDA output as called vs given the documents' cu_seqlens: relative error {err:.2e} "
      "(0 expected: a document starts from a zero state)")
