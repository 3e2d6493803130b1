"""Plain-loop references for the LoRA ops, in float64: the ground truth for tests and benchmarks.

Slow on purpose: one token, one slice at a time, exactly as the semantics read.
"""

from __future__ import annotations

import itertools

from collections.abc import Sequence

import torch


def shrink_ref(x: torch.Tensor, A: torch.Tensor, ranks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h[i, t, :r] = x[t] @ A[s, i, :r].T with s = slots[t], r = ranks[s, i]; zero elsewhere.

    x: [T, in]; A: [S, n_slices, R_max, in]; ranks: [S, n_slices]; slots: [T]. Returns float64
    [n_slices, T, R_max].
    """
    num_tokens = x.shape[0]
    _, n_slices, r_max, _ = A.shape
    h = torch.zeros(n_slices, num_tokens, r_max, dtype=torch.float64)
    for t in range(num_tokens):
        s = int(slots[t])
        if s < 0:
            continue
        for i in range(n_slices):
            r = int(ranks[s, i])
            h[i, t, :r] = x[t].double().cpu() @ A[s, i, :r].double().cpu().T
    return h


def expand_ref(
    y: torch.Tensor,
    h: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """y[t, slice i] + scales[s, i] * h[i, t, :r] @ B[s, slice i, :r].T, in float64; y is not modified.

    y: [T, sum(slice_sizes)]; h: [n_slices, T, R_max]; B: [S, sum(slice_sizes), R_max].
    """
    out = y.double().cpu().clone()
    offsets = [0, *itertools.accumulate(slice_sizes)]
    for t in range(y.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        for i in range(len(slice_sizes)):
            r = int(ranks[s, i])
            lo, hi = offsets[i], offsets[i + 1]
            b = B[s, lo:hi, :r].double().cpu()
            out[t, lo:hi] += float(scales[s, i]) * (h[i, t, :r].double().cpu() @ b.T)
    return out


def lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """The whole delta: y[t] + scale[s] * (x[t] @ A[s].T) @ B[s].T per slice, in float64."""
    return expand_ref(y, shrink_ref(x, A, ranks, slots), B, ranks, scales, slots, slice_sizes)


def lora_ref_by_slot(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    slice_sizes: Sequence[int],
) -> torch.Tensor:
    """``lora_ref`` looping over slots instead of tokens, on the inputs' device: for large shapes."""
    out = y.double().clone()
    offsets = [0, *itertools.accumulate(slice_sizes)]
    slots = slots.long()
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = (slots == s).nonzero().squeeze(1)
        xs = x.index_select(0, idx).double()
        for i in range(len(slice_sizes)):
            r = int(ranks[s, i])
            lo, hi = offsets[i], offsets[i + 1]
            delta = float(scales[s, i]) * (xs @ A[s, i, :r].double().T) @ B[s, lo:hi, :r].double().T
            out[idx, lo:hi] += delta
    return out
