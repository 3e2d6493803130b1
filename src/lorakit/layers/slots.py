"""Slot buffers of LoRA layers: every adapter's A and B, padded to a max rank that grows.

One ``LoraSlots`` holds the slots of n slices: one module, or sibling modules that read the same input
(q/k/v, gate/up) and so share one shrink and one expand launch. It starts with max rank 0 (no buffers,
no work); loading an adapter grows the padding to the adapter's rank rounded up to ``rank_multiple``,
copying the slots already loaded bit-exactly. What a slot holds changes with load and unload (written by
``lorakit.layers.image``); the slot count and the shapes never do.

A DoRA adapter's rescale lives beside A and B: ``dora`` [S, 1 or 2, sum(out_sizes)] float32, each slot's
``m / ||W + scale B A|| - 1`` per output column and, for a layer with a bias, ``-(that) * bias`` (zeros for a
slot of plain LoRA). It is allocated when the first DoRA adapter comes (``enable_dora``), like a rank growth.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from lorakit.ops import round_up


class LoraSlots(nn.Module):
    """Buffers ranks and scales [S, n], B stored as [S, R_max, sum(out_sizes)] and A (layout set by subclasses)."""

    def __init__(self, num_slots: int, in_features: int, out_sizes: Sequence[int], dtype: torch.dtype,
                 device: torch.device, rank_multiple: int):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.out_offsets = [0, *itertools.accumulate(self.out_sizes)]
        self.rank_multiple = rank_multiple
        self.r_max = 0
        n = len(self.out_sizes)
        self.register_buffer("ranks", torch.zeros(num_slots, n, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("scales", torch.zeros(num_slots, n, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("lora_A", self._empty_a(0, dtype, device), persistent=False)
        self.register_buffer("lora_B", torch.zeros(num_slots, 0, sum(self.out_sizes), dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("dora", torch.zeros(num_slots, 0, sum(self.out_sizes), dtype=torch.float32,
                                                 device=device), persistent=False)

    # Subclasses say how A is laid out: [S, n, R, in] for linear layers, [S, in, R] for embeddings (the rank
    # is dimension 2 in both).
    def _empty_a(self, r_max: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.lora_B.dtype

    @property
    def num_slots(self) -> int:
        return self.ranks.shape[0]

    def grow(self, rank: int) -> None:
        """Make room for rank; loaded slots keep their values exactly."""
        if rank <= self.r_max:
            return
        r_new = round_up(rank, self.rank_multiple)
        a = self._empty_a(r_new, self.dtype, self.lora_B.device)
        b = torch.zeros(self.num_slots, r_new, self.lora_B.shape[2], dtype=self.dtype, device=self.lora_B.device)
        a.narrow(2, 0, self.r_max).copy_(self.lora_A)
        b[:, : self.r_max].copy_(self.lora_B)
        self.lora_A, self.lora_B, self.r_max = a, b, r_new

    def slot_tensors(self, slot: int) -> tuple[torch.Tensor, ...]:
        """What one slot holds (zeroed, the slot holds nothing)."""
        return self.ranks[slot], self.scales[slot], self.lora_A[slot], self.lora_B[slot], self.dora[slot]

    # DoRA: the base layers' weights and biases the rescale is computed from (``lorakit.layers.dora``).

    def base_weight(self, index: int) -> torch.Tensor:
        """Slice ``index``'s base weight as [out, in] (an embedding's as [num_embeddings, dim]), dequantized."""
        raise NotImplementedError

    def base_bias(self, index: int) -> torch.Tensor | None:
        return None

    @property
    def dora_rows(self) -> int:
        """1 (a gain per column) or 2 (and a shift: some slice has a bias) once DoRA is enabled, else 0."""
        return self.dora.shape[1]

    def enable_dora(self) -> bool:
        """Allocate the DoRA buffer (zeros: every slot plain LoRA); True if it was allocated now."""
        if self.dora_rows:
            return False
        rows = 2 if any(self.base_bias(i) is not None for i in range(len(self.out_sizes))) else 1
        self.dora = torch.zeros(self.num_slots, rows, self.out_offsets[-1], dtype=torch.float32,
                                device=self.lora_B.device)
        return True

    def dora_or_none(self, index: int | None = None) -> torch.Tensor | None:
        """The DoRA buffer for the kernels (of slice ``index`` alone, if given), None while no DoRA adapter came."""
        if not self.dora_rows:
            return None
        if index is None:
            return self.dora
        return self.dora[:, :, self.out_offsets[index]: self.out_offsets[index + 1]]

    def extra_repr(self) -> str:
        dora = ", dora" if self.dora_rows else ""
        return f"in={self.in_features}, out={self.out_sizes}, slots={self.num_slots}, r_max={self.r_max}{dora}"
