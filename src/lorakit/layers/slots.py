"""Slot buffers of one LoRA layer: every adapter's A and B, padded to a max rank that grows.

A layer starts with max rank 0 (no buffers, no work); loading an adapter that targets it grows the
padding to the adapter's rank rounded up to ``rank_multiple``, copying the slots already loaded
bit-exactly. What a slot holds changes with load and unload; the slot count and the layer's shapes never do.
"""

from __future__ import annotations

import torch
from torch import nn


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class LoraSlots(nn.Module):
    """Buffers ranks [S, 1], scales [S, 1], B stored as [S, R_max, out] and A (layout set by subclasses)."""

    def __init__(self, num_slots: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, rank_multiple: int):
        super().__init__()
        self.num_slots = num_slots
        self.in_features = in_features
        self.out_features = out_features
        self.rank_multiple = rank_multiple
        self.r_max = 0
        self.register_buffer("ranks", torch.zeros(num_slots, 1, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("scales", torch.zeros(num_slots, 1, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("lora_A", self._empty_a(0, dtype, device), persistent=False)
        self.register_buffer("lora_B", torch.zeros(num_slots, 0, out_features, dtype=dtype, device=device),
                             persistent=False)

    # Subclasses say how A is laid out: [S, 1, R, in] for linear layers, [S, in, R] for embeddings.
    def _empty_a(self, r_max: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def _a_view(self, a: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
        """The part of buffer ``a`` that holds the first ``rank`` rows of slot's A, as [rank, in]."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.lora_B.dtype

    def grow(self, rank: int) -> None:
        """Make room for rank; loaded slots keep their values exactly."""
        if rank <= self.r_max:
            return
        r_new = round_up(rank, self.rank_multiple)
        a = self._empty_a(r_new, self.dtype, self.lora_B.device)
        b = torch.zeros(self.num_slots, r_new, self.out_features, dtype=self.dtype, device=self.lora_B.device)
        for slot in range(self.num_slots):
            self._a_view(a, slot, self.r_max).copy_(self._a_view(self.lora_A, slot, self.r_max))
        b[:, : self.r_max].copy_(self.lora_B)
        self.lora_A, self.lora_B, self.r_max = a, b, r_new

    def set_slot(self, slot: int, A: torch.Tensor, B: torch.Tensor, scale: float) -> None:
        """Write one adapter: A [r, in], B [out, r] (PEFT's layout), scale = alpha / r (or rsLoRA's)."""
        rank = A.shape[0]
        self.grow(rank)
        self.clear_slot(slot)
        self._a_view(self.lora_A, slot, rank).copy_(A)
        self.lora_B[slot, :rank].copy_(B.T)
        self.ranks[slot, 0] = rank
        self.scales[slot, 0] = scale

    def clear_slot(self, slot: int) -> None:
        self.ranks[slot, 0] = 0
        self.scales[slot, 0] = 0.0
        self._a_view(self.lora_A, slot, self.r_max).zero_()
        self.lora_B[slot].zero_()

    def slot_nbytes(self) -> int:
        return (self.lora_A.nbytes + self.lora_B.nbytes) // self.num_slots

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, slots={self.num_slots}, r_max={self.r_max}"
