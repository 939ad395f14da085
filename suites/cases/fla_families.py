"""Parity cases of the fla-op clients of five families (GatedDeltaProduct, GatedDeltaNet2,
RWKV7Attention, PrecondGatedDeltaNet, PrecondKDA: suites/clients/delta_product.py, clients/gdn2.py,
clients/rwkv7.py, clients/precond.py) at head shapes fla's Triton kernels take (head dim 64; the
clients' own SIZES have head dims 4 to 8, below the 16 that Triton's dot needs) and four key
heads, so TP 4 holds one key head per rank.

`family_cases(family, ...)`: the client at every PLACEMENTS entry against the same client
replicated, float64, on the CPU. Weights (fla's layer seeded as the client tests seed it) and the
input / output cotangent are float64, rounded to `round_to` first when given, so a bf16 run and
its float64 reference read the same values. The reference's forward runs under
`linattn.emulation.fla_on_cpu` (fla's ops on linattn's float64 references; their backward is
torch autograd on those references), in the test process only: the ranks run whatever fla ops
the process has (fla's Triton kernels on a GPU).

The CPU suite's shared cases of the same clients at their own tiny SIZES: `cpu_family(family,
seed)` (the replicated client and the client), `cpu_state_path(family)` (the client carrying its
state, and the reference's forward), and the packings CP4_CU, TRAINING_MICRO_BATCHES, STATE_CU.

Imported lazily (it imports fla): importing fla costs seconds.
"""

from __future__ import annotations

import importlib

import torch

from pytest_linattn import ParityCase, Placement
from pytest_linattn.seqlens import packed_seqlens

HIDDEN = 256
# fla's layer arguments per family: 4 key heads x 64 (GVA 2 where the layer has value heads of its own)
SIZES = {
    "delta_product": dict(hidden_size=HIDDEN, head_dim=64, num_heads=4, num_v_heads=8, expand_v=1.0, conv_size=4,
                          num_householder=2, norm_eps=1e-5),
    "gdn2": dict(hidden_size=HIDDEN, head_dim=64, num_heads=4, num_v_heads=8, expand_v=1.0, conv_size=4,
                 allow_neg_eigval=True, norm_eps=1e-5),
    "rwkv7": dict(hidden_size=HIDDEN, head_dim=64, decay_low_rank_dim=32, gate_low_rank_dim=64, a_low_rank_dim=32,
                  v_low_rank_dim=16, norm_eps=1e-5, layer_idx=1, num_hidden_layers=2),
    "precond_gdn": dict(hidden_size=HIDDEN, head_dim=64, num_heads=4, num_v_heads=8, expand_v=1.0, conv_size=4,
                        allow_neg_eigval=True, norm_eps=1e-5),
    "precond_kda": dict(hidden_size=HIDDEN, head_dim=64, num_heads=4, num_v_heads=8, expand_v=1.0, conv_size=4,
                        allow_neg_eigval=True, norm_eps=1e-5),
}
# family -> (module, fla layer, replicated client, client)
CLIENTS = {
    "delta_product": ("clients.delta_product", "fla_delta_product_layer", "replicated_delta_product",
                      "fla_delta_product_client"),
    "gdn2": ("clients.gdn2", "fla_gdn2_layer", "replicated_gdn2", "fla_gdn2_client"),
    "rwkv7": ("clients.rwkv7", "fla_rwkv7_layer", "replicated_rwkv7", "fla_rwkv7_client"),
    "precond_gdn": ("clients.precond", "fla_precond_layer", "replicated_precond", "fla_precond_client"),
    "precond_kda": ("clients.precond", "fla_precond_kda_layer", "replicated_precond_kda", "fla_precond_kda_client"),
}
FAMILIES = tuple(CLIENTS)
# family -> (module, the client carrying its state, the reference's forward for the continuation check or None)
STATE_PATHS = {
    "delta_product": ("clients.delta_product", "fla_delta_product_state_path", None),
    "gdn2": ("clients.gdn2", "fla_gdn2_state_path", None),
    "rwkv7": ("clients.rwkv7", "fla_rwkv7_state_path", None),
    "precond_gdn": ("clients.precond", "fla_precond_state_path", "log_atk_call"),
    "precond_kda": ("clients.precond", "fla_precond_kda_state_path", "log_atk_call"),
}
# every placement the clients support on four ranks (no sequence parallelism: the clients' inputs
# are whole over TP); fla's CP layouts, contiguous and zigzag ("fla-zigzag")
PLACEMENTS = [
    Placement(tp=4),
    Placement(cp=4),
    Placement(cp=4, cp_layout="fla-zigzag"),
    Placement(tp=2, cp=2),
    Placement(tp=2, cp=2, cp_layout="fla-zigzag"),
]


def float64_reference_forward(layer, x, cu_seqlens):
    """The replicated client's forward with fla's ops computed by linattn's float64 references (a
    CPU float64 layer must never reach fla's Triton kernels)."""
    from linattn.emulation import fla_on_cpu

    with fla_on_cpu(torch.float64):
        return layer(x, cu_seqlens)


def _rounded(t, round_to):
    return t if round_to is None else t.to(round_to).double()


def family_cases(family: str, *, tokens: int, seed: int, dtype: torch.dtype, rtol: float,
                 round_to: torch.dtype | None = None, placements=PLACEMENTS) -> list[ParityCase]:
    """One ParityCase per placement of the family's client on one packed batch of `tokens` tokens
    (packed for fla's zigzag over 4 ranks: boundaries on interval edges, a sequence across several
    ranks; valid for CP 2 and contiguous too). Every case shares the weights, the inputs and one
    float64 reference run."""
    module, make_fla_layer, make_replicated, make_client = CLIENTS[family]
    clients = importlib.import_module(module)
    sizes = SIZES[family]
    fla_layer = getattr(clients, make_fla_layer)(seed, sizes)
    with torch.no_grad():
        for p in fla_layer.parameters():
            p.copy_(_rounded(p, round_to))
    reference = getattr(clients, make_replicated)(fla_layer, sizes)
    client = getattr(clients, make_client)(sizes=sizes)
    cu = packed_seqlens(tokens, cp_size=4, layout="fla-zigzag", seed=seed)
    gen = torch.Generator().manual_seed(seed + 50)
    x, dy = (_rounded(torch.randn(1, tokens, HIDDEN, generator=gen, dtype=torch.float64), round_to)
             for _ in range(2))
    return [ParityCase(client, p, reference, cu, x, dy, rtol, dtype, name=f"fla {family}/{p.name}/seed{seed}",
                       reference_forward=float64_reference_forward)
            for p in placements]


# ---- the CPU suite's cases: the clients at their own tiny SIZES, float64, fla's ops emulated --------

# 32 tokens for CP 4 in both of fla's layouts (8 intervals of 4 tokens): a one-token sequence, one
# across three ranks' contiguous pieces (tokens 1..16) and five intervals, a boundary on an edge
CP4_CU = [0, 1, 17, 27, 28, 32]
# two micro-batches of 16 tokens for TP 2 and CP 2: a one-token sequence, sequences across the CP edge
TRAINING_MICRO_BATCHES = [[0, 1, 9, 16], [0, 5, 16]]
# the continuation check's sequences: cut into chunks (1, W-1, W tokens, ...) and 2 decode steps each
STATE_CU = [0, 20, 29, 34]


def cpu_family(family: str, seed: int):
    """(the replicated client, float64, with fla's layer's weights seeded by `seed`; the client) at
    the client's own SIZES."""
    module, make_fla_layer, make_replicated, make_client = CLIENTS[family]
    clients = importlib.import_module(module)
    return getattr(clients, make_replicated)(getattr(clients, make_fla_layer)(seed)), getattr(clients, make_client)()


def cpu_state_path(family: str):
    """(the client's StatePath, the reference's forward for `assert_continuation_parity` or None)."""
    module, make_path, forward = STATE_PATHS[family]
    clients = importlib.import_module(module)
    return getattr(clients, make_path)(), None if forward is None else getattr(clients, forward)
