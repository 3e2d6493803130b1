"""LoRA custom ops in the ``lorakit`` namespace: Triton kernels on CUDA, plain torch on CPU, fake kernels.

    meta = build_lora_meta(slots, num_slots)            # once per batch, shared by every layer
    add_lora(y, x, A, B, ranks, scales, meta, sizes)    # one layer: y[t] += scale * (x[t] @ A[s].T) @ B[s].T

``torch.ops.lorakit.shrink`` and ``torch.ops.lorakit.expand`` are the registered ops; the functions
here only unpack ``LoraMeta`` and pick ``split_k``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorakit.ops import expand as _expand_mod  # noqa: F401  (registers lorakit::expand)
from lorakit.ops import shrink as _shrink_mod  # noqa: F401  (registers lorakit::shrink)
from lorakit.ops.meta import LoraMeta, LoraMetaBuffers, block_m_for, build_lora_meta
from lorakit.ops.shrink import shrink_split_k

__all__ = ["LoraMeta", "LoraMetaBuffers", "add_lora", "block_m_for", "build_lora_meta", "lora_expand", "lora_shrink"]


def _check_slot_count(meta: LoraMeta, weights: torch.Tensor, name: str) -> None:
    if weights.shape[0] != meta.num_slots:
        raise ValueError(
            f"{name} holds {weights.shape[0]} slots but the LoraMeta was built for num_slots={meta.num_slots}; "
            f"build the metadata with the slot count of the weights"
        )


def lora_shrink(x: torch.Tensor, A: torch.Tensor, ranks: torch.Tensor, meta: LoraMeta,
                split_k: int | None = None) -> torch.Tensor:
    """``torch.ops.lorakit.shrink`` over a LoraMeta: float32 partials [split_k, n_slices, T, R_max]."""
    _check_slot_count(meta, A, "A")
    if split_k is None:
        split_k = shrink_split_k(x.shape[1], A.shape[1], A.shape[2], meta.tiles.shape[1], meta.block_m)
    return torch.ops.lorakit.shrink(x, A, ranks, meta.token_slot, meta.token_order, meta.tiles, meta.block_m,
                                    split_k)


def lora_expand(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                meta: LoraMeta, slice_sizes: Sequence[int]) -> None:
    """``torch.ops.lorakit.expand`` over a LoraMeta: y += scale * h @ B.T per slice, in place."""
    _check_slot_count(meta, B, "B")
    torch.ops.lorakit.expand(y, h, B, ranks, scales, meta.token_slot, meta.token_order, meta.tiles,
                             list(slice_sizes), meta.block_m)


def add_lora(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, ranks: torch.Tensor,
             scales: torch.Tensor, meta: LoraMeta, slice_sizes: Sequence[int] | None = None) -> None:
    """The whole LoRA delta of one (possibly fused) layer, added into y in place.

    Semantics:
        for t, i: s = meta.token_slot[t]; r = ranks[s, i]
            y[t, slice i] += scales[s, i] * (x[t] @ A[s, i, :r].T) @ B[s, slice i, :r].T   (skipped where s == -1)

    x: [T, in]; y: [T, out]; A: [S, n_slices, R_max, in]; B: [S, out, R_max] (store it as
    [S, R_max, out] and pass ``.transpose(1, 2)``: the expand then reads only the first r rows, fully
    coalesced); ranks int32 and scales float32 [S, n_slices]; slice_sizes: the widths of the slices of
    y (default: one slice). The meta must be built for S slots.
    """
    sizes = [y.shape[1]] if slice_sizes is None else list(slice_sizes)
    lora_expand(y, lora_shrink(x, A, ranks, meta), B, ranks, scales, meta, sizes)
