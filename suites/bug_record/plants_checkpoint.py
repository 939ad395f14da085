"""Planted bugs of a checkpoint client (`clients.checkpoint`, `clients.quantized_checkpoint`): an
exporter's merge or a loader's scale fill that saves or loads linattn's layer across TP sizes the
way a public report's did. Module-level: spawn's ranks get them by reference. The layer, its
forward and its shard functions are right; only the checkpoint round trip
(`assert_checkpoint_round_trip`) sees them: the merged checkpoint or a rank's loaded shard,
located by parameter, section, heads and rows.

Below the plants, where each must be reported (the tests and the registry derive it from the
config and the plant, by formulas of the layouts written here, not by the harness's tables).
"""

from __future__ import annotations

import re

import torch

from clients.quantized_checkpoint import scaled_weights
from linattn.layers import build_layer, parameter_layouts, shard_state_dict, unshard_state_dict
from pytest_linattn.harness.checkpoint_report import runs

__all__ = ["SSM_PARAMETERS", "all_lines", "exported_as_replicated_lines", "fill_first_scale_slot_only",
           "merge_mapping_ssm_parameters_as_replicated", "unfilled_scale_lines"]

# the mixer's SSM-side parameters the export maps (Nemotron-H: mixer norm, A_log, D, dt_bias, conv1d;
# GDN has no D, and its norm is per head dim, replicated: rightly whole on every rank)
SSM_PARAMETERS = ("norm.weight", "A_log", "dt_bias", "conv1d.weight")


def fill_first_scale_slot_only(slots, on_disk):
    """vllm-project/vllm #38517 (issue #38197): `MergedColumnParallelLinear.weight_loader_v2`,
    given a tuple shard_id for a fused weight's `PerTensorScaleParameter`, hard-coded shard_id=0:
    only the first of the per-section scale slots is filled, the others keep their initial value
    (float32's lowest), so every section after the first is dequantized with it."""
    slots[0] = on_disk[0]


def merge_mapping_ssm_parameters_as_replicated(config, saved, placement):
    """NVIDIA/Model-Optimizer #931: the export at TP > 1 maps the mixer's SSM parameters (norm,
    A_log, D, dt_bias, conv1d) as REPLICATE instead of column-TP, so the exporter takes TP rank 0's
    shard of each as the whole parameter (the 3-D conv weight, sharded on dim 0, had no slicing
    case at all). The other parameters are merged right."""
    merged = unshard_state_dict(saved, config)
    for name in SSM_PARAMETERS:
        merged[name] = saved[0][name]
    return merged


# ---- where a plant's report must point ----------------------------------------------------------


def _where(config, name, row):
    """(section or None, "key" / "value", head) of row `row` of the replicated layer's GDN
    parameter `name`, from the family's layout formulas (HF order)."""
    c = config
    H, HV, dk, dv, r, kd = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.v_heads_per_k_head, c.key_dim
    if name in ("A_log", "dt_bias"):
        return None, "value", row
    if name == "in_proj_qkvz.weight":  # per key head: q dk, k dk, v r*dv, z r*dv
        g, o = divmod(row, 2 * dk + 2 * r * dv)
        if o < 2 * dk:
            return "qk"[o // dk], "key", g
        part, o = divmod(o - 2 * dk, r * dv)
        return "vz"[part], "value", g * r + o // dv
    if name == "in_proj_ba.weight":  # per key head: b r, a r
        g, o = divmod(row, 2 * r)
        return "ba"[o // r], "value", g * r + o % r
    if name in ("in_proj_qkv.weight", "conv1d.weight"):  # q H*dk | k H*dk | v HV*dv
        if row < 2 * kd:
            return "qk"[row // kd], "key", row % kd // dk
        return "v", "value", (row - 2 * kd) // dv
    raise ValueError(f"no row formula for {name}")


def _words(config, name, rows) -> str:
    """"section k key heads 0..3 (rows 32..63), ..." of `rows`, in their sections' order."""
    by_section: dict = {}
    for row in sorted(rows):
        section, kind, head = _where(config, name, row)
        by_section.setdefault((section, kind), ([], []))
        by_section[(section, kind)][0].append(head)
        by_section[(section, kind)][1].append(row)
    words = []
    for (section, kind), (heads, idx) in by_section.items():
        heads = sorted(set(heads))
        words.append(f"{f'section {section} ' if section else ''}{kind} head{'s' * (len(heads) > 1)} {runs(heads)} "
                      f"(row{'s' * (len(idx) > 1)} {runs(idx)})")
    return ", ".join(words)


def _held_rows(config, name, tp, tp_rank):
    """The replicated layer's rows of `name` that TP rank `tp_rank` of `tp` holds (its shard of
    row indices)."""
    rows = {n: torch.arange(layout.shape[0], dtype=torch.float64).reshape(-1, *[1] * (len(layout.shape) - 1))
            .expand(layout.shape).contiguous() for n, layout in parameter_layouts(config).items()}
    local = shard_state_dict(rows, config, tp_rank, tp)[name]
    return sorted({int(v) for v in local.reshape(local.shape[0], -1)[:, 0].tolist()})


def unfilled_scale_lines(config, tp, tp_rank) -> list[str]:
    """vLLM #38517's plant: the loaded shard's lines (regexes) of TP rank `tp_rank` at TP `tp`: every
    section after the first of each fused weight with per-section scales, wrong in all its rows
    the rank holds."""
    lines = []
    for name, kind in scaled_weights(config).items():
        if kind != "sections":
            continue
        held = _held_rows(config, name, tp, tp_rank)
        for section in parameter_layouts(config)[name].names[1:]:
            rows = [row for row in held if _where(config, name, row)[0] == section]
            words = _words(config, name, rows).removeprefix(f"section {section} ")
            line = f"loaded shard at tp{tp}, tp_rank {tp_rank}: {name} section {section}: error "
            lines.append("(?m)^" + re.escape(line) + r"\S+" + re.escape(f"; wrong in {words}") + "$")
    return lines


def exported_as_replicated_lines(config, tp) -> list[str]:
    """Model-Optimizer #931's plant: the merged checkpoint's lines (regexes) after a save at TP `tp`
    > 1: each TP-split SSM parameter holds TP rank 0's rows only, the others missing."""
    lines = []
    layouts = parameter_layouts(config)
    in_report_order = [n for n, _ in build_layer(config, device="meta").named_parameters() if n in SSM_PARAMETERS]
    for name in in_report_order:  # the report's order: the layer's parameters
        if layouts[name].split == "replicated":
            continue
        shape = layouts[name].shape
        held = _held_rows(config, name, tp, 0)
        missing = [row for row in range(shape[0]) if row not in held]
        local = (len(held), *shape[1:])
        line = (f"merged checkpoint (saved at tp{tp}): {name}: shape {local}, the reference's {shape}: it holds "
                f"{_words(config, name, held)} only, TP rank 0's shard at tp{tp} (a sharded parameter saved as the "
                f"whole); missing {_words(config, name, missing)}")
        lines.append("(?m)^" + re.escape(line) + "$")
    return lines


def all_lines(lines) -> str:
    """One regex matching a report that holds every line of `lines` (each "(?m)^...$"), in that order
    (the report's: parameter by parameter), from the first to the last: a registry entry's `located`."""
    return "(?m)" + r"[\s\S]*?".join(line.removeprefix("(?m)") for line in lines)
