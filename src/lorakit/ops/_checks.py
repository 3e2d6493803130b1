"""Argument checks shared by the op launchers: each error names the argument, its value and what was expected."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SLICES = 4
# SMs of an H100 / H200: sizes the grids (split-K, column groups), never affects results.
NUM_SMS_GUESS = 132


def debug_checks() -> bool:
    """Value checks that need a host sync on CUDA (ranks <= R_max) run only with LORAKIT_DEBUG=1."""
    return os.environ.get("LORAKIT_DEBUG", "0") == "1"


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    unit_stride_dim: int | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like x, got {t.device}")
    if unit_stride_dim is not None and t.shape[unit_stride_dim] > 1 and t.stride(unit_stride_dim) != 1:
        raise ValueError(
            f"{name} must be contiguous in dimension {unit_stride_dim}, got strides {t.stride()} "
            f"for shape {tuple(t.shape)}; pass {name}.contiguous()"
        )


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], meaning: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({meaning}), got {tuple(t.shape)}")


def check_meta(token_slot: torch.Tensor, token_order: torch.Tensor, tiles: torch.Tensor, num_tokens: int,
               device: torch.device) -> None:
    check_tensor("token_slot", token_slot, dim=1, dtypes=(torch.int32,), device=device, unit_stride_dim=0)
    check_tensor("token_order", token_order, dim=1, dtypes=(torch.int32,), device=device, unit_stride_dim=0)
    check_tensor("tiles", tiles, dim=2, dtypes=(torch.int32,), device=device, unit_stride_dim=1)
    check_shape("token_slot", token_slot, (num_tokens,), "one slot per token of x")
    check_shape("token_order", token_order, (num_tokens,), "one index per token of x")
    if tiles.shape[0] != 3:
        raise ValueError(f"tiles must have shape [3, n_tiles] (slot, start, end), got {tuple(tiles.shape)}")


def check_ranks(ranks: torch.Tensor, r_max: int) -> None:
    """ranks[s, i] must lie in [0, R_max]; read on the host, so only where that costs no sync."""
    if ranks.device.type != "cpu" and not debug_checks():
        return
    if torch.compiler.is_compiling() or (ranks.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    lo, hi = int(ranks.min()), int(ranks.max())
    if lo < 0 or hi > r_max:
        raise ValueError(f"ranks must lie in [0, R_max={r_max}], got values in [{lo}, {hi}]")


def check_block_m(block_m: int) -> None:
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be one of 16, 32, 64, 128 (from LoraMeta), got {block_m}")
