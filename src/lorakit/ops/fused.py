"""LoRA shrink and expand in one launch: ``ys[i] += scale[s] * (x @ A[s, i].T) @ B[s, slice i].T``.

A decode step's LoRA kernels are bound by their launches, not their bytes (bench/NOTES.md): two dependent launches
per group cost 5-13 us each for 0.5-3 us of data. Here one persistent launch of at most one program per SM does
both: its programs first share out the shrink's work items (the same split-K partials as ``lorakit::shrink``), meet at
a grid-wide barrier, then share out the expand's (as ``lorakit::expand``). The barrier needs every program resident
at once, hence the grid of at most one program per SM. Under the Triton interpreter, which runs programs one after
another, the two phases are two launches instead.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import MAX_SLICES, adapter_tokens_skipped, cdiv, num_sms, pdl_supported
from lorakit.ops.expand import EXPAND_CONFIGS, _check_expand_args, _expand_program, _expand_torch
from lorakit.ops.shrink import _block_r, _check_shrink_args, _shrink_config, _shrink_program, _shrink_torch


@triton.jit
def _grid_barrier(sync_ptr, n_programs):
    """Every program of the launch waits here until all have arrived. ``sync_ptr``: int32 [2], (arrivals, generation),
    left ready for the next launch (the last program to arrive resets the count and moves the generation on)."""
    tl.debug_barrier()
    gen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    if arrived == n_programs - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == gen:
            pass
    tl.debug_barrier()


@triton.jit
def _fused_kernel(
    x_ptr, a_ptr, h_ptr, Y0, Y1, Y2, Y3, b_ptr, ranks_ptr, scales_ptr, order_ptr, tiles_ptr, d_ptr, sync_ptr,
    K, R_MAX, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3, COLS, N_TILES, N_COLGROUPS,
    stride_xt, stride_as, stride_ai, stride_ar, stride_hk, stride_hi, stride_ht,
    stride_bs, stride_bn, stride_br, stride_rs, stride_ri, stride_ss, stride_si, stride_tiles, stride_ds, stride_dk,
    N_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, SUB_TILES: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    DORA: tl.constexpr, PHASE: tl.constexpr,
):
    """PHASE 0: shrink, barrier, expand; 1: the shrink alone; 2: the expand alone (the interpreter's two launches)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    if PHASE != 2:
        n_rb = N_SLICES * tl.cdiv(R_MAX, BLOCK_R)
        n_rows = N_TILES * SUB_TILES
        for item in range(pid, n_rb * n_rows * SPLIT_K, n_programs):
            pid_r = item % n_rb
            row = (item // n_rb) % n_rows
            pid_k = item // (n_rb * n_rows)
            _shrink_program(x_ptr, a_ptr, h_ptr, ranks_ptr, order_ptr, tiles_ptr, K, R_MAX, pid_r, row // SUB_TILES,
                            row % SUB_TILES, pid_k, stride_xt, stride_as, stride_ai, stride_ar, stride_hk, stride_hi,
                            stride_ht, stride_rs, stride_ri, stride_tiles, BLOCK_M // SUB_TILES, BLOCK_R, BLOCK_K,
                            SPLIT_K, IEEE)
    if PHASE == 0:
        _grid_barrier(sync_ptr, n_programs)
    if PHASE != 1:
        for item in range(pid, N_COLGROUPS * N_TILES * N_SLICES, n_programs):
            pid_g = item % N_COLGROUPS
            pid_tile = (item // N_COLGROUPS) % N_TILES
            slice_id = item // (N_COLGROUPS * N_TILES)
            _expand_program(Y0, Y1, Y2, Y3, h_ptr, b_ptr, ranks_ptr, scales_ptr, order_ptr, tiles_ptr, d_ptr,
                            R_MAX, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3, COLS, pid_g, pid_tile, slice_id,
                            stride_hk, stride_hi, stride_ht, 0, stride_bs, stride_bn, stride_br, stride_rs, stride_ri,
                            stride_ss, stride_si, stride_tiles, stride_ds, stride_dk,
                            BLOCK_M, BLOCK_N, SPLIT_K, IEEE, DORA, ".cg")


_SYNC: dict[torch.device, torch.Tensor] = {}


def _sync_buffer(device: torch.device) -> torch.Tensor:
    """The barrier's (arrivals, generation) counters of a device, made once (before any graph capture: the first call
    is a warmup) and left ready by every launch. Launches on one device must not run concurrently on two streams."""
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return _SYNC[device]


def fused_split_k(in_features: int, n_slices: int, r_max: int, n_tiles: int, sub_tiles: int, programs: int) -> int:
    """Split K until the shrink's work items fill the programs (at least 256 columns of K each, at most 16 ways)."""
    items = n_slices * cdiv(r_max, _block_r(r_max)) * n_tiles * sub_tiles
    split = 1
    while split < 16 and items * split * 2 <= programs and in_features // (split * 2) >= 256:
        split *= 2
    return split


def launch_fused(ys: list[torch.Tensor], x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, ranks: torch.Tensor,
                 scales: torch.Tensor, token_order: torch.Tensor, tiles: torch.Tensor, block_m: int,
                 pdl: bool = False, sms: int | None = None, dora: torch.Tensor | None = None) -> None:
    """ys[i] += the LoRA delta of slice i, then DoRA's rescale where ``dora`` is given (``lorakit::expand``), in one
    launch (two under the interpreter, or with LORAKIT_FUSED_PHASES=2 in the environment)."""
    num_tokens = x.shape[0]
    if num_tokens == 0 or adapter_tokens_skipped():
        return
    _, n_slices, r_max, k = A.shape
    sms = sms or num_sms(x.device)
    shrink_cfg = _shrink_config(block_m)
    sub_tiles = block_m // shrink_cfg["BLOCK_M"]
    n_tiles = tiles.shape[1]
    widths = [y.shape[1] for y in ys]
    block_n = EXPAND_CONFIGS[16 if block_m <= 16 else 64]["BLOCK_N"]
    col_blocks = cdiv(max(widths), block_n)
    split_k = fused_split_k(k, n_slices, r_max, n_tiles, sub_tiles, sms)
    groups = max(1, min(col_blocks, cdiv(sms, n_tiles * n_slices)))
    cols = cdiv(col_blocks, groups) * block_n
    n_colgroups = cdiv(max(widths), cols)
    shrink_items = n_slices * cdiv(r_max, _block_r(r_max)) * n_tiles * sub_tiles * split_k
    programs = min(sms, max(shrink_items, n_colgroups * n_tiles * n_slices))
    h = torch.empty((split_k, n_slices, num_tokens, r_max), dtype=torch.float32, device=x.device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("LORAKIT_FUSED_PHASES") == "2"
    pad = MAX_SLICES - len(ys)
    pdl = pdl and pdl_supported(x.device) and not interpret
    args = (
        x, A, h, *ys, *[ys[0]] * pad, B, ranks, scales, token_order, tiles, B if dora is None else dora,
        _sync_buffer(x.device),
        k, r_max, *widths, *[0] * pad, *[y.stride(0) for y in ys], *[0] * pad, cols, n_tiles, n_colgroups,
        x.stride(0), A.stride(0), A.stride(1), A.stride(2), h.stride(0), h.stride(1), h.stride(2),
        B.stride(0), B.stride(1), B.stride(2), ranks.stride(0), ranks.stride(1), scales.stride(0), scales.stride(1),
        tiles.stride(0), *((0, 0) if dora is None else (dora.stride(0), dora.stride(1))),
    )
    meta = dict(N_SLICES=n_slices, BLOCK_M=block_m, SUB_TILES=sub_tiles, BLOCK_R=_block_r(r_max),
                BLOCK_K=shrink_cfg["BLOCK_K"], SPLIT_K=split_k, BLOCK_N=block_n, IEEE=x.dtype == torch.float32,
                DORA=0 if dora is None else dora.shape[1], num_warps=4, num_stages=3)
    if interpret:
        for phase in (1, 2):
            _fused_kernel[(programs,)](*args, PDL=False, PHASE=phase, **meta)
        return
    _fused_kernel[(programs,)](*args, PDL=pdl, PHASE=0, **({"launch_pdl": True} if pdl else {}), **meta)


def add_lora_fused(y, x, A, B, ranks, scales, meta, slice_sizes=None, pdl: bool = True) -> None:
    """``add_lora`` in one launch (the prototype's entry point: eager, CUDA or the interpreter)."""
    from lorakit.ops import split_columns

    outs = split_columns(y, slice_sizes) if isinstance(y, torch.Tensor) else list(y)
    launch_fused(outs, x, A, B, ranks, scales, meta.token_order, meta.tiles, meta.block_m, pdl)


@torch.library.custom_op("lorakit::fused", mutates_args=("ys",))
def fused(
    ys: list[torch.Tensor],
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    token_slot: torch.Tensor,
    token_order: torch.Tensor,
    tiles: torch.Tensor,
    block_m: int,
    pdl: bool = False,
    dora: torch.Tensor | None = None,
) -> None:
    """``lorakit::shrink`` then ``lorakit::expand`` (their semantics and arguments), in one launch on CUDA.

    Semantics:
        for t, i: s = token_slot[t]; r = ranks[s, i]
            ys[i][t] += scales[s, i] * (x[t] @ A[s, i, :r].T) @ B[s, cols of slice i, :r].T   (skipped where s == -1)
            then DoRA's rescale where ``dora`` is given, as ``lorakit::expand`` does it
    """
    _check_shrink_args(x, A, ranks, token_slot, token_order, tiles, block_m, 1)
    h = _shrink_torch(x, A, ranks, token_slot, 1)
    _check_expand_args(ys, h, B, ranks, scales, token_slot, token_order, tiles, block_m, dora)
    _expand_torch(ys, h, B, ranks, scales, token_slot, dora)


@fused.register_kernel("cuda")
def _(ys, x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, pdl=False, dora=None):
    _check_shrink_args(x, A, ranks, token_slot, token_order, tiles, block_m, 1)
    launch_fused(ys, x, A, B, ranks, scales, token_order, tiles, block_m, pdl, dora=dora)


@fused.register_fake
def _(ys, x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, pdl=False, dora=None):
    return None
