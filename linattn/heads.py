"""Which key head each value head reads when a layer has more value heads than key heads (HV > H,
r = HV / H value heads per key head): the head-pairing convention, by name.

    grouped  value head j reads key head j // r: each key head's r value heads side by side
             (HF transformers' Qwen3-Next and Qwen3.5 modules repeat q and k with
             repeat_interleave; fla's kernels index the key head as i_hv // (HV // H))
    tiled    value head j reads key head j % H: the value heads in r tiles of H, one per key head
             (ggml broadcasts tiled, and llama.cpp's GGUF conversion of Qwen3.5 reorders the value
             heads from the checkpoint's grouped order into this one)

With HV == H both are the identity. A tiled layer is a grouped layer with its value heads
permuted: `to_grouped` / `from_grouped` move the value-head dim between the two orders, so a
kernel that knows only the grouped pairing (fla's) runs a tiled layer's heads in between.
"""

from __future__ import annotations

import torch

from linattn.checks import fail, require

HEAD_PAIRINGS = {
    "grouped": "value head j reads key head j // (num_v_heads / num_k_heads)",
    "tiled": "value head j reads key head j % num_k_heads",
}

__all__ = ["HEAD_PAIRINGS", "check_head_pairing", "from_grouped", "grouped_order", "key_head_of", "to_grouped"]


def check_head_pairing(head_pairing, name: str = "head_pairing") -> str:
    """`head_pairing` if it names a convention, else ValueError naming `name` and the conventions."""
    if not (isinstance(head_pairing, str) and head_pairing in HEAD_PAIRINGS):  # per kernel call: no formatting
        fail(name, "must be one of " + "; ".join(f"{k!r} ({v})" for k, v in HEAD_PAIRINGS.items())
             + f", got {head_pairing!r}")
    return head_pairing


def key_head_of(value_head: int, num_k_heads: int, num_v_heads: int, head_pairing: str) -> int:
    """The key head value head `value_head` reads under `head_pairing`."""
    if check_head_pairing(head_pairing) == "tiled":
        return value_head % num_k_heads
    return value_head // (num_v_heads // num_k_heads)


def grouped_order(num_k_heads: int, num_v_heads: int, head_pairing: str) -> list[int]:
    """For each grouped position p (key head p // r, its (p % r)-th value head), the index of that
    value head in `head_pairing`'s order: the identity for "grouped", `(p % r) * H + p // r` for "tiled"."""
    check_head_pairing(head_pairing)
    H, r = num_k_heads, num_v_heads // num_k_heads
    if head_pairing == "grouped":
        return list(range(num_v_heads))
    return [(p % r) * H + p // r for p in range(num_v_heads)]


def to_grouped(x: torch.Tensor, num_k_heads: int, num_v_heads: int, head_pairing: str, dim: int = 2) -> torch.Tensor:
    """x with its value-head dim `dim` (HV heads, each one entry or a block of equal size) moved from
    `head_pairing`'s order into grouped order."""
    return _permute(x, num_k_heads, num_v_heads, head_pairing, dim, inverse=False)


def from_grouped(x: torch.Tensor, num_k_heads: int, num_v_heads: int, head_pairing: str, dim: int = 2) -> torch.Tensor:
    """Inverse of `to_grouped`: x's value-head dim from grouped order into `head_pairing`'s."""
    return _permute(x, num_k_heads, num_v_heads, head_pairing, dim, inverse=True)


def _permute(x, num_k_heads, num_v_heads, head_pairing, dim, inverse):
    if check_head_pairing(head_pairing) == "grouped" or num_v_heads == num_k_heads:
        return x
    dim = dim % x.dim()
    require(x.shape[dim] % num_v_heads == 0, "x",
            f"dim {dim} ({x.shape[dim]} entries) must hold num_v_heads={num_v_heads} heads of equal size")
    order = grouped_order(num_k_heads, num_v_heads, head_pairing)
    if inverse:  # position of each stored head in grouped order
        order = sorted(range(num_v_heads), key=order.__getitem__)
    index = torch.tensor(order, device=x.device)
    return x.unflatten(dim, (num_v_heads, -1)).index_select(dim, index).flatten(dim, dim + 1)
