"""Batch metadata: the grouping of a batch's tokens by adapter slot, built once per forward pass.

Every LoRA layer of a forward pass reads the same token -> slot mapping, so the grouping the kernels
need (tokens sorted by slot, cut into tiles of at most ``block_m`` tokens of one slot) is computed
once, on the device, with a fixed number of tensor ops and no host sync, so it can be captured in a CUDA
graph with the layers that read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorakit.ops._checks import cdiv, host_checks_allowed

# Tile slot values below zero: BASE_SLOT tiles hold base-model tokens (no adapter), EMPTY_SLOT tiles
# are unused capacity (start == end == 0).
BASE_SLOT = -1
EMPTY_SLOT = -2


def block_m_for(num_tokens: int) -> int:
    """Tokens per tile: small tiles for decode (each token may have its own adapter), larger for prefill."""
    return 16 if num_tokens <= 512 else 64


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound on tiles: each non-empty segment (slots and base) wastes at most one partial tile."""
    return cdiv(num_tokens, block_m) + min(num_slots + 1, num_tokens)


@dataclass(frozen=True)
class LoraMeta:
    """How one batch's tokens map to adapter slots, in the form the kernels read.

    token_slot:  int32 [T]   slot of each token, -1 for the base model.
    token_order: int32 [T]   token indices sorted by slot (stable), base tokens first.
    tiles:       int32 [3, n_tiles]  rows (slot, start, end): tile i covers token_order[start:end],
                 all of one slot; slot -1 marks base tokens, slot -2 an unused tile (start == end).
    num_slots:   S, the slot count the mapping was built for.
    block_m:     the most tokens in one tile; kernels use it as their row-block size.
    """

    token_slot: torch.Tensor
    token_order: torch.Tensor
    tiles: torch.Tensor
    num_slots: int
    block_m: int

    @property
    def num_tokens(self) -> int:
        return self.token_slot.shape[0]


def _check_slots(slots: torch.Tensor, num_slots: int) -> None:
    if slots.dim() != 1:
        raise ValueError(f"slots must be a 1-D tensor of slot ids [T], got shape {tuple(slots.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be int32 or int64, got {slots.dtype}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    # Reading values costs a host sync on CUDA (and a graph break when compiling); there the caller
    # that makes the ids (the patched model's ids()) validates them.
    if slots.numel() > 0 and host_checks_allowed(slots):
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(
                f"slots must lie in [-1, {num_slots - 1}] (-1 = base model), got values in [{lo}, {hi}]"
            )


def build_lora_meta(slots: torch.Tensor, num_slots: int, block_m: int | None = None) -> LoraMeta:
    """Group tokens by slot, on the slots' device, without a host sync (traceable by torch.compile)."""
    _check_slots(slots, num_slots)
    num_tokens = slots.shape[0]
    bm = block_m_for(num_tokens) if block_m is None else block_m
    device = slots.device

    key = slots.to(torch.int64) + 1  # 0 = base, 1..S = slots
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    seg_end = counts.cumsum(0)
    seg_start = seg_end - counts
    tiles_per_seg = (counts + bm - 1) // bm
    tile_end_idx = tiles_per_seg.cumsum(0)

    n_tiles = max_tiles(num_tokens, num_slots, bm)
    i = torch.arange(n_tiles, dtype=torch.int64, device=device)
    seg = torch.searchsorted(tile_end_idx, i, right=True)
    used = seg <= num_slots
    seg = seg.clamp(max=num_slots)
    local = i - (tile_end_idx[seg] - tiles_per_seg[seg])
    start = seg_start[seg] + local * bm
    end = torch.minimum(start + bm, seg_end[seg])
    zero = torch.zeros_like(start)
    tiles = torch.stack(
        [
            torch.where(used, seg - 1, torch.full_like(seg, EMPTY_SLOT)),
            torch.where(used, start, zero),
            torch.where(used, end, zero),
        ]
    ).to(torch.int32)
    return LoraMeta(slots.to(torch.int32), order.to(torch.int32), tiles, num_slots, bm)
