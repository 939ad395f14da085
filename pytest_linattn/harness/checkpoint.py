"""Checkpoints across TP sizes: a layer saved at one TP size and loaded at another must hold the
replicated layer's weights and compute its outputs and gradients.

For each pair (a, b) of `sizes`:

  1. save at TP a: every rank builds the sharded layer (the client's `ShardedLayer.build`), loads
     its shard of the reference's weights (the layer's own `shard`) and calls the client's
     `save(module, placement, tp_rank)`: what the rank contributes to a checkpoint (its shard;
     or the whole state dict gathered on rank 0 and nothing elsewhere);
  2. merge: the client's `merge(saved, placement)` puts the ranks' pieces (TP rank order)
     together as one checkpoint, and `read(checkpoint)` gives its weights as the replicated
     layer's state dict (a quantized checkpoint dequantized; default: the checkpoint itself);
     checked against the reference's parameters, section by section, within `weight_rtol`
     (default rtol; a quantized checkpoint's error against the full-precision weights);
  3. load at TP b: on every rank of TP b, the client's `load(checkpoint, placement, tp_rank)`
     gives the rank's shard (the built module's names); checked, in the test process, against
     the layer's own `shard` of the checkpoint's weights for that rank, section by section,
     within rtol: a loader must give exactly what the checkpoint holds;
  4. forward and backward at TP b from the loaded shards (the parity harness,
     `assert_parity_cases`: outputs, input gradients, every parameter gradient within rtol, its
     reports) against the replicated layer holding the checkpoint's weights: the reference
     itself for a lossless checkpoint, so a quantized one is held to rtol here too, its
     quantization error judged once, on the weights.

Where the merged checkpoint's weights are unusable (a parameter missing or of another shape), 3
and 4 compare with the reference's weights and layer instead (3 within weight_rtol).

A wrong section is located with the client's `config` (`linattn.layers.parameter_layouts`:
`[q | k | v]` of in_proj_qkv and the conv, `[q | k | v | z]` per key head of Qwen3-Next's
in_proj_qkvz, heads of A_log / dt_bias, ...; `checkpoint_report`): the parameter, the section,
its error, the heads and rows that differ, in the replicated layer's numbering (a rank's loaded
shard is mapped there through the layer's `shard` of an index-valued state dict). A merged
parameter of another shape says which of the reference's rows it holds and, when it is a saving
rank's shard, which. Every failing pair is reported, in one AssertionError. TP only (no CP, no
sequence parallel). This module imports no pytest.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from ..parity import check_rtol
from .cases import ParityCase, ShardedLayer, require_linattn_config, require_module_level
from .checkpoint_rank import RankSave, save_on_rank
from .checkpoint_report import Rows, row_table, shape_line, value_lines
from .placement import Placement, as_cu_seqlens, check_seed, positive_int
from .sharded_parity import assert_parity_cases

__all__ = ["CheckpointIO", "assert_checkpoint_round_trip"]

DEFAULT_SIZES = ((2, 1), (1, 2), (2, 4), (4, 2))


@dataclasses.dataclass(frozen=True)
class CheckpointIO:
    """How a client saves its sharded layer to a checkpoint and loads it back, for
    `assert_checkpoint_round_trip`. Callables module-level (or functools.partial of one): `save`
    and `load` reach spawn's ranks pickled by reference.

    save(module, placement, tp_rank) -> dict | None
        On every rank of the saving placement, the module loaded with its shard: what this rank
        contributes to the checkpoint (a Megatron-style rank's shard; or, as an exporter that
        gathers, the whole state dict on rank 0 and None elsewhere). Tensors come back on the CPU.
    merge(saved, placement) -> checkpoint
        In the test process: the checkpoint from the ranks' contributions, in TP rank order (an
        exporter's merge of per-rank dicts; a quantizing exporter's scales beside the weights).
    load(checkpoint, placement, tp_rank) -> dict
        On every rank of the loading placement (and in the test process, to locate a wrong
        shard): the rank's parameters, named as the built module's (a loader's shard of each
        tensor, quantized ones dequantized). A pure function of its arguments.
    read(checkpoint) -> dict
        The checkpoint's weights as the replicated layer's state dict (the reference's names and
        shapes; a quantized checkpoint dequantized). Default: the checkpoint is that dict.
    config: the layer's `linattn.layers.LinearAttentionConfig` when its parameters are laid out
        as linattn's (`parameter_layouts`): a report then names sections and heads. None: rows.
    """

    save: Callable
    merge: Callable
    load: Callable
    read: Callable | None = None
    config: object | None = None

    def __post_init__(self):
        words = {"save": "save(module, placement, tp_rank) -> dict", "merge": "merge(saved, placement) -> checkpoint",
                 "load": "load(checkpoint, placement, tp_rank) -> dict"}
        for field, call in words.items():
            if not callable(getattr(self, field)):
                raise ValueError(f"CheckpointIO.{field} must be callable ({call}), got {getattr(self, field)!r}")
        if self.read is not None and not callable(self.read):
            raise ValueError(f"CheckpointIO.read must be callable (read(checkpoint) -> state dict) or None, "
                             f"got {self.read!r}")
        require_linattn_config(self, "its parameters laid out as linattn's")
        require_module_level(self)


def _check_sizes(sizes) -> list[tuple[int, int]]:
    __tracebackhide__ = True
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(f"sizes must be a non-empty sequence of (save TP size, load TP size) pairs, got {sizes!r}")
    pairs = []
    for i, pair in enumerate(sizes):
        if (not isinstance(pair, Sequence) or len(pair) != 2
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in pair)):
            raise ValueError(f"sizes[{i}] must be a pair of positive ints (save TP size, load TP size), got {pair!r}")
        pairs.append((int(pair[0]), int(pair[1])))
    return pairs


def assert_checkpoint_round_trip(spawn, layer: ShardedLayer, reference: torch.nn.Module, cu_seqlens, *,
                                 io: CheckpointIO, sizes: Sequence[tuple[int, int]] = DEFAULT_SIZES,
                                 hidden_size: int, seed: int, rtol: float, weight_rtol: float | None = None,
                                 dtype: torch.dtype = torch.float64, reference_forward: Callable | None = None,
                                 name: str = "") -> None:
    """For every (a, b) of `sizes`: save `layer` at TP a (`io.save`, `io.merge`), check the merged
    checkpoint's weights (`io.read`) against `reference`'s per section within `weight_rtol`
    (default `rtol`; a quantized checkpoint's error), load it at TP b (`io.load`), check each
    rank's loaded shard against the layer's `shard` of the checkpoint's weights and run forward and
    backward there against the replicated layer holding the checkpoint's weights, both within
    `rtol` (the module docstring). x and dy `[1, T, hidden_size]` from N(0, 1) seeded by `seed`;
    `dtype` the ranks'. AssertionError naming each failing pair with its located lines; ValueError
    for bad input, before any rank runs."""
    __tracebackhide__ = True
    if not isinstance(layer, ShardedLayer):
        raise ValueError(f"layer must be a ShardedLayer, got {type(layer).__name__}")
    if layer.shard is None:
        raise ValueError("ShardedLayer.shard is required by the checkpoint round trip: the saving ranks are loaded "
                         "with their shard of the reference's weights, and a loaded shard is checked against it")
    layer.require_unshard("the checkpoint round trip (its forward and backward at the loading TP size)")
    if not isinstance(io, CheckpointIO):
        raise ValueError(f"io must be a CheckpointIO, got {type(io).__name__}")
    if not isinstance(reference, torch.nn.Module):
        raise ValueError(f"reference must be a torch.nn.Module, got {type(reference).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    pairs = _check_sizes(sizes)
    cu = as_cu_seqlens(cu_seqlens)
    positive_int(hidden_size, "hidden_size")
    check_seed(seed)
    rtol = check_rtol(rtol)
    weight_rtol = rtol if weight_rtol is None else check_rtol(weight_rtol)
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(1, int(cu[-1]), hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    weights = {n: p.detach() for n, p in reference.named_parameters()}

    saved = {a: _save(spawn, layer, io, weights, a, dtype, weight_rtol) for a in dict.fromkeys(a for a, _ in pairs)}
    failed, blocks, passed = [], [], []
    for a, b in pairs:
        checkpoint, held, lines = saved[a]
        case = f"{name + '/' if name else ''}tp{a}->tp{b}/seed{seed}"
        parity = ""
        if checkpoint is not None:
            # the checkpoint's own weights where usable (the loader must give exactly them), else the reference's
            base, tol = (held, rtol) if held is not None else (weights, weight_rtol)
            loaded, usable = _load_lines(layer, io, checkpoint, base, Placement(tp=b), tol)
            lines = lines + loaded
            if usable:
                replicated = reference if held is None else _holding(reference, held)
                loading = dataclasses.replace(layer, shard=functools.partial(_loaded_shard, io.load, checkpoint))
                trip = ParityCase(loading, Placement(tp=b), replicated, cu, x, dy, rtol, dtype, name=case,
                                  reference_forward=reference_forward)
                parity = _parity(spawn, trip)
            else:
                lines.append(f"no forward ran at tp{b}: a rank's loaded shard is unusable")
        if lines or parity:
            failed.append(f"tp{a}->tp{b}")
            blocks.append("\n".join([f"{case}: saved at tp{a}, loaded at tp{b}", *lines])
                          + (f"\n\n{parity}" if parity else ""))
        else:
            passed.append(f"tp{a}->tp{b}")
    if failed:
        label = f"{name}/seed{seed}" if name else f"seed{seed}"
        raise AssertionError(f"checkpoint round trip failed for {label}: {len(failed)} of {len(pairs)} size pair(s) "
                             f"fail: {', '.join(failed)}" + (f" (passed: {', '.join(passed)})" if passed else "")
                             + "\n\n" + "\n\n".join(blocks))


def _save(spawn, layer, io, weights, a, dtype, weight_rtol):
    """(the merged checkpoint, or None where the merge raised; its weights as the reference's
    state dict, or None where unusable; the failing lines) of the save at TP a."""
    __tracebackhide__ = True
    placement = Placement(tp=a)
    pieces = spawn(save_on_rank, a, RankSave(layer, io.save, placement, weights, dtype))
    for r, piece in enumerate(pieces):
        if piece is not None and not isinstance(piece, dict):
            raise ValueError(f"CheckpointIO.save must return a dict (what TP rank {r} contributes to the checkpoint) "
                             f"or None, got {type(piece).__name__}")
    where = f"merged checkpoint (saved at tp{a}): "
    try:
        checkpoint = io.merge([p if p is not None else {} for p in pieces], placement)
    except Exception as exc:  # noqa: BLE001 - the client's merge failing is a finding: reported
        return None, None, [f"merge at tp{a} raised {type(exc).__name__}: {exc}"]
    try:
        full = io.read(checkpoint) if io.read is not None else checkpoint
    except Exception as exc:  # noqa: BLE001
        return checkpoint, None, [f"{where}read raised {type(exc).__name__}: {exc}"]
    if not isinstance(full, dict):
        raise ValueError(f"the merged checkpoint must be a dict of the reference's parameters, or give "
                         f"CheckpointIO.read (read(checkpoint) -> state dict), got {type(full).__name__}")
    lines = [f"{where}missing {n}" for n in weights if n not in full]
    lines += [f"{where}unexpected {n} (no parameter of the reference)" for n in full if n not in weights]
    usable = not lines
    for n, w in weights.items():
        if n not in full:
            continue
        got, rows = full[n], row_table(io.config, n, w.shape)
        if not isinstance(got, torch.Tensor):
            lines.append(f"{where}{n} is a {type(got).__name__}, not a tensor")
            usable = False
        elif tuple(got.shape) != tuple(w.shape):
            owner = functools.partial(_owner, layer, weights, placement, n)
            lines.append(where + shape_line(n, got.detach().cpu(), w, weight_rtol, rows, owner))
            usable = False
        else:
            lines += [where + line for line in value_lines(n, got.detach().cpu().double() - w.double(), w,
                                                           weight_rtol, rows)]
    held = {n: full[n].detach().cpu().to(w.dtype) for n, w in weights.items()} if usable else None
    return checkpoint, held, lines


def _holding(reference: torch.nn.Module, held: dict) -> torch.nn.Module:
    """A copy of the replicated layer holding the checkpoint's weights."""
    replicated = copy.deepcopy(reference)
    with torch.no_grad():
        for n, p in replicated.named_parameters():
            p.copy_(held[n])
    return replicated


def _owner(layer, weights, placement, name, tensor) -> str:
    """"TP rank r's shard at tp{a}" when `tensor` is exactly that rank's shard of parameter `name`."""
    for r in range(placement.tp):
        piece = layer.shard(weights, placement, r).get(name)
        if (isinstance(piece, torch.Tensor) and piece.shape == tensor.shape
                and torch.equal(piece.detach().cpu().double(), tensor.double())):
            return f"TP rank {r}'s shard at tp{placement.tp}"
    return ""


def _index_map(layer, weights, placement, tp_rank):
    """{local name: (reference name per element, flat index per element)} of the rank's shard:
    the layer's `shard` of a state dict whose every element holds its own (parameter, index)
    code; None where the shard does more than move elements (its codes are no codes)."""
    names = list(weights)
    coded = {n: (torch.arange(w.numel(), dtype=torch.float64) + i * 2.0 ** 32).reshape(w.shape)
             for i, (n, w) in enumerate(weights.items())}
    try:
        local = layer.shard(coded, placement, tp_rank)
    except Exception:  # noqa: BLE001 - a shard that only takes real weights: rows of the shard instead
        return None
    out = {}
    for n, t in local.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float64:  # a cast loses the codes
            return None
        t = t.detach().cpu().flatten()
        if not bool((t == t.round()).all()):
            return None
        pid, flat = (t // 2.0 ** 32).long(), (t % 2.0 ** 32).long()
        if bool(((pid < 0) | (pid >= len(names))).any()):
            return None
        sizes = torch.tensor([weights[m].numel() for m in names])
        if bool((flat >= sizes[pid]).any()):
            return None
        out[n] = (pid, flat)
    return names, out


def _load_lines(layer, io, checkpoint, weights, placement, rtol):
    """(each TP rank's loaded shard's failing lines, whether every rank's is usable: the built
    module's names and shapes) for the load at `placement`."""
    __tracebackhide__ = True
    lines, usable = [], True
    for r in range(placement.tp):
        where = f"loaded shard at tp{placement.tp}, tp_rank {r}: "
        right = layer.shard(weights, placement, r)
        try:
            got = io.load(checkpoint, placement, r)
        except Exception as exc:  # noqa: BLE001 - a loader failing on the checkpoint is a finding: reported
            lines.append(f"load at tp{placement.tp}, tp_rank {r} raised {type(exc).__name__}: {exc}")
            usable = False
            continue
        if not isinstance(got, dict):
            raise ValueError(f"CheckpointIO.load must return a dict (the rank's parameters), got {type(got).__name__}")
        wrong = [f"{where}missing {n}" for n in right if n not in got]
        wrong += [f"{where}unexpected {n} (no parameter of the built module)" for n in got if n not in right]
        wrong += [f"{where}{n} of shape {tuple(got[n].shape)}, the rank's parameter has {tuple(t.shape)}"
                  for n, t in right.items() if n in got and tuple(getattr(got[n], "shape", ())) != tuple(t.shape)]
        if wrong:
            lines += wrong
            usable = False
            continue
        diffs = {n: got[n].detach().cpu().double() - right[n].detach().cpu().double() for n in right}
        mapped = _index_map(layer, weights, placement, r)
        if mapped is None:  # rows of the rank's parameter, not of the reference's
            for n, d in diffs.items():
                lines += [where + line for line in value_lines(f"{n} (the rank's own rows)", d, right[n].detach().cpu(),
                                                               rtol, Rows.plain(d.shape))]
            continue
        names, index = mapped
        for i, n in enumerate(names):
            w = weights[n].detach().cpu().double()
            diff, held = torch.zeros(w.numel(), dtype=torch.float64), torch.zeros(w.numel(), dtype=torch.bool)
            for local, (pid, flat) in index.items():
                mine = pid == i
                diff[flat[mine]] = diffs[local].flatten()[mine]
                held[flat[mine]] = True
            if bool(held.any()):
                rows = row_table(io.config, n, w.shape)
                lines += [where + line for line in value_lines(n, diff.reshape(w.shape), w, rtol, rows,
                                                               held.reshape(w.shape))]
    return lines, usable


def _loaded_shard(load, checkpoint, full, placement, tp_rank):
    """ShardedLayer.shard of the loading ranks: the client's load of the checkpoint (`full`, the
    reference's weights, unused)."""
    return load(checkpoint, placement, tp_rank)


def _parity(spawn, case: ParityCase) -> str:
    """The parity harness's report of the forward and backward at the loading TP size, or ""."""
    try:
        assert_parity_cases(spawn, [case])
    except AssertionError as exc:
        # its note on shard and unshard disagreeing is the loaded-shard lines, in the checkpoint's words
        return "\n\n".join(part for part in str(exc).split("\n\n")
                            if not part.startswith("shard and unshard disagree"))
    return ""
