"""The emulated ops' cases, shared by the emulation tests (suites/cpu/library/
test_emulation_ops.py, test_emulation_cp.py): the delta-rule ops with their references, every
option set, fresh packed float64 inputs, the gates and betas as fla's docstrings write them, one
call of an emulated op; the CP packings, a rank's tokens in fla's layouts and its CP group."""

import torch
import torch.nn.functional as F

from linattn import reference
from linattn.emulation import delta_rules as emu

F64 = torch.float64
RTOL64, RTOL32, RTOL_CP = 1e-12, 1e-5, 1e-10
H, HV, K, V = 1, 2, 3, 2  # GVA: two value heads per key head
LENGTHS = [1, 6, 3]  # packed, with a length-1 sequence

# op name: (emulated op, reference op, reference mode)
OPS = {
    "chunk_kda": (emu.chunk_kda, reference.kda, "chunk"),
    "fused_recurrent_kda": (emu.fused_recurrent_kda, reference.kda, "recurrent"),
    "chunk_gated_delta_rule": (emu.chunk_gated_delta_rule, reference.gated_delta_rule, "chunk"),
    "fused_recurrent_gated_delta_rule": (emu.fused_recurrent_gated_delta_rule, reference.gated_delta_rule, "recurrent"),
}
GATE = dict(use_gate_in_kernel=True, A_log="A_log", dt_bias="dt_bias")  # strings name input tensors
# option sets for every op; kda_only ones need the per-channel gate's lower bound
OPTIONS = {
    "plain": {},
    "gate": GATE,
    "gate-no-dt-bias": dict(use_gate_in_kernel=True, A_log="A_log"),
    "beta-sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg-eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "l2norm+scale": dict(use_qk_l2norm_in_kernel=True, scale=0.3),
    "state-v-first": dict(state_v_first=True),
    "all": dict(GATE, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_qk_l2norm_in_kernel=True,
                scale=0.7, state_v_first=True),
}
KDA_OPTIONS = {
    "gate-lower-bound": dict(GATE, lower_bound=-3.0, safe_gate=True),
    "gate-lower-bound-no-A_log": dict(use_gate_in_kernel=True, dt_bias="dt_bias", lower_bound=-5.0),
    "safe-gate-precomputed": dict(safe_gate=True, lower_bound=-5.0),
    "all-lower-bound": dict(GATE, lower_bound=-4.0, safe_gate=True, use_beta_sigmoid_in_kernel=True,
                            use_qk_l2norm_in_kernel=True, state_v_first=True),
    "accepted-no-ops": dict(chunk_size=32, disable_recompute=True, use_graph=True, max_num_seqs=len(LENGTHS)),
}
CASES = [(op, name) for op in OPS for name in list(OPTIONS) + (list(KDA_OPTIONS) if "kda" in op else [])]


def packed_inputs(seed, per_channel, lengths=LENGTHS, heads=(H, HV)):
    """Fresh float64 inputs for one packed batch: raw and activated gates and betas, A_log, dt_bias, h0."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    h, hv = heads
    T = sum(lengths)
    g_shape = (1, T, hv, K) if per_channel else (1, T, hv)
    x = dict(q=rand(1, T, h, K), k=F.normalize(rand(1, T, h, K), dim=-1), v=rand(1, T, hv, V),
             g_raw=rand(*g_shape), beta_raw=rand(1, T, hv), A_log=0.5 * rand(hv),
             dt_bias=rand(hv * K if per_channel else hv), h0=rand(len(lengths), hv, K, V))
    x["g"], x["beta"] = F.logsigmoid(x["g_raw"]), torch.sigmoid(x["beta_raw"])
    return x, torch.tensor([0] + lengths).cumsum(0)


def expected_log_decay(x, opts, per_channel):
    """The in-kernel gates as fla's docstrings write them."""
    if not opts.get("use_gate_in_kernel"):
        return x["g"]
    g = x["g_raw"]
    if "dt_bias" in opts:
        g = g + (x["dt_bias"].view(HV, K) if per_channel else x["dt_bias"])
    A = x["A_log"].exp().view(HV, 1) if per_channel else x["A_log"].exp()
    if opts.get("lower_bound") is not None:
        return opts["lower_bound"] * torch.sigmoid(A * g if "A_log" in opts else g)
    return -A * F.softplus(g)


def expected_beta(x, opts):
    if not opts.get("use_beta_sigmoid_in_kernel"):
        return x["beta"]
    return torch.sigmoid(x["beta_raw"]) * (2 if opts.get("allow_neg_eigval") else 1)


def emulated_call(op_name, x, cu, opts, **extra):
    """The emulated op on x with the options (tensor names resolved), h0 in the requested layout."""
    op = OPS[op_name][0]
    kwargs = {n: (x[v] if isinstance(v, str) else v) for n, v in opts.items()}
    g = x["g_raw"] if opts.get("use_gate_in_kernel") else x["g"]
    beta = x["beta_raw"] if opts.get("use_beta_sigmoid_in_kernel") else x["beta"]
    h0 = x["h0"].transpose(-1, -2).contiguous() if opts.get("state_v_first") else x["h0"]
    kwargs = dict(dict(initial_state=h0, output_final_state=True, cu_seqlens=cu), **kwargs, **extra)
    o, S = op(q=x["q"], k=x["k"], v=x["v"], g=g, beta=beta, **kwargs)
    if S is not None and opts.get("state_v_first"):
        S = S.transpose(-1, -2)
    return o, S


# (name, sequence lengths, fla layout) per CP size; sequences cross rank boundaries, one has
# length 1; at CP 4 "short-pieces" gives each rank 2 tokens, fewer than a conv's W-1 = 3 (the
# halo spans 2 ranks)
CP_CASES = {
    2: [("crossing", [1, 9, 6], "contiguous"), ("zigzag", [3, 10, 3], "zigzag")],
    4: [("crossing", [5, 22, 1, 4], "contiguous"), ("short-pieces", [1, 7], "contiguous"),
        ("zigzag", [2, 9, 5], "zigzag")],
}


def local_index(total, rank, cp_size, layout):
    """Global tokens of a rank: one interval (contiguous) or intervals r and 2cp-1-r of the whole batch (fla's zigzag)."""
    part = total // (2 * cp_size)
    intervals = [rank, 2 * cp_size - 1 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]
    return torch.cat([torch.arange(i * part, (i + 1) * part) for i in intervals])


def cp_group(cp_size):
    """This rank's CP group: the world for CP 4; for CP 2, ranks {0, 1} or {2, 3} (a subgroup, so
    group-local ranks differ from global ones). Every rank creates every group, in order."""
    import torch.distributed as dist

    if cp_size == dist.get_world_size():
        return dist.group.WORLD
    groups = [dist.new_group(list(range(first, first + cp_size))) for first in range(0, dist.get_world_size(), cp_size)]
    return groups[dist.get_rank() // cp_size]


def rank_cases(cases_by_cp):
    """On a rank of a spawn over max(CP sizes) ranks: (cp_size, group, case, index) for every case
    of every CP size, with this rank's CP group and the global indices of its tokens."""
    import torch.distributed as dist

    for cp_size, cases in cases_by_cp.items():
        group = cp_group(cp_size)
        rank = dist.get_rank(group)
        for case in cases:
            yield cp_size, group, case, local_index(int(case["cu"][-1]), rank, cp_size, case["layout"])


def cp_groups(world, cp_size):
    """Each CP group's global ranks, as cp_group makes them."""
    return [range(first, first + cp_size) for first in range(0, world, cp_size)]


def assemble(pieces, total, cp_size, layout, summed):
    """One CP group's outputs (dicts, in group-rank order) as one process's: the keys in `summed`
    (per-rank partial sums: parameter gradients) added, token tensors back in global order (dim 1)."""
    order = torch.cat([local_index(total, r, cp_size, layout) for r in range(cp_size)])
    whole = {}
    for key in pieces[0]:
        parts = [p[key] for p in pieces]
        if key in summed:
            whole[key] = torch.stack(parts).sum(0)
        else:
            joined = torch.cat(parts, dim=1)
            whole[key] = torch.empty_like(joined)
            whole[key][:, order] = joined
    return whole
