"""LoRA expand, ``y += scale[s] * h @ B[s].T`` per token, in place, for every slice in one launch.

The slices of a fused projection (q/k/v under GQA, gate/up) are column ranges of one ``y`` and one
``B``; each program takes a tile of tokens of one slot and a range of one slice's columns, sums the
split-K partials of ``h`` once, and streams B and y through a pipelined loop over the columns, reading
B only up to ``rank[s, i]``.
"""

from __future__ import annotations

import itertools

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import (
    FLOAT_DTYPES,
    MAX_SLICES,
    check_block_m,
    check_meta,
    check_ranks,
    check_shape,
    check_tensor,
)


@triton.jit
def _load_h(h_rows, r0, rank, stride_hk, m_mask, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
            SPLIT_K: tl.constexpr):
    """Columns r0 .. r0 + BLOCK_R of h for a tile of rows: the sum of the split-K partials, zero past rank."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    hv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kk in tl.static_range(SPLIT_K):
        hv += tl.load(h_rows + kk * stride_hk + offs_r[None, :],
                      mask=m_mask[:, None] & (offs_r < rank)[None, :], other=0.0)
    return hv


@triton.jit
def _dot(hv, bv, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(hv, bv, acc, input_precision="ieee")
    return tl.dot(hv.to(bv.dtype), bv, acc)


@triton.jit
def _expand_columns(y_rows, h_rows, b_base, n_lo, n_hi, rank, scale, m_mask,
                    stride_hk, stride_bn, stride_br, stride_yn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    SPLIT_K: tl.constexpr, IEEE: tl.constexpr, HOIST: tl.constexpr):
    """y[rows, n_lo:n_hi] += scale * h[rows, :rank] @ B[n_lo:n_hi, :rank].T, BLOCK_N columns a step.

    HOIST (rank <= BLOCK_R): h is loaded once and only B and y stream through the pipelined loop.
    Otherwise the rank is walked in chunks of BLOCK_R for every block of columns."""
    if HOIST:
        hv = _load_h(h_rows, 0, rank, stride_hk, m_mask, BLOCK_M, BLOCK_R, SPLIT_K)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        y_ptrs = y_rows + offs_n[None, :] * stride_yn
        mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_ptrs, mask=mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HOIST:
            offs_r = tl.arange(0, BLOCK_R)
            bv = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                         mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)
            acc = _dot(hv, bv, acc, IEEE)
        else:
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                hc = _load_h(h_rows, r0, rank, stride_hk, m_mask, BLOCK_M, BLOCK_R, SPLIT_K)
                bv = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                             mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)
                acc = _dot(hc, bv, acc, IEEE)
        tl.store(y_ptrs, (yv.to(tl.float32) + scale * acc).to(yv.dtype), mask=mask)


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, ranks_ptr, scales_ptr, order_ptr, tiles_ptr,
    R_MAX, N0, N1, N2, N3, COLS,
    stride_yt, stride_yn,
    stride_hk, stride_hi, stride_ht,
    stride_bs, stride_bn, stride_br,
    stride_rs, stride_ri,
    stride_ss, stride_si,
    stride_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
):
    # Program (g, tile, slice) adds the delta of one tile of tokens to columns g*COLS .. (g+1)*COLS of one slice.
    pid_g = tl.program_id(0)
    pid_tile = tl.program_id(1)
    slice_id = tl.program_id(2)
    # Column range of this slice in y and B; at most four slices, passed as scalars (no device tensor).
    lo = 0
    size = N0
    if slice_id >= 1:
        lo += N0
        size = N1
    if slice_id >= 2:
        lo += N1
        size = N2
    if slice_id >= 3:
        lo += N2
        size = N3
    n_lo = pid_g * COLS
    n_hi = tl.minimum(n_lo + COLS, size)

    slot = tl.load(tiles_ptr + pid_tile)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * stride_rs + slice_id * stride_ri)
    rank = tl.where(slot >= 0, tl.minimum(rank, R_MAX), 0)
    if (rank > 0) & (n_lo < size):
        start = tl.load(tiles_ptr + stride_tiles + pid_tile)
        end = tl.load(tiles_ptr + 2 * stride_tiles + pid_tile)
        scale = tl.load(scales_ptr + slot * stride_ss + slice_id * stride_si).to(tl.float32)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tok = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        y_rows = y_ptr + tok[:, None] * stride_yt + lo * stride_yn
        h_rows = h_ptr + slice_id * stride_hi + tok[:, None] * stride_ht
        b_base = b_ptr + slot.to(tl.int64) * stride_bs + lo * stride_bn
        # The rank block follows this slot's rank: bytes stop at the rank, FLOPs at the next of 16, 32,
        # 64 or 128, and ranks above 128 walk chunks of 64.
        if rank <= 16:
            _expand_columns(y_rows, h_rows, b_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, stride_yn,
                            BLOCK_M, BLOCK_N, 16, SPLIT_K, IEEE, True)
        elif rank <= 32:
            _expand_columns(y_rows, h_rows, b_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, stride_yn,
                            BLOCK_M, BLOCK_N, 32, SPLIT_K, IEEE, True)
        elif rank <= 64:
            _expand_columns(y_rows, h_rows, b_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, stride_yn,
                            BLOCK_M, BLOCK_N, 64, SPLIT_K, IEEE, True)
        elif rank <= 128:
            _expand_columns(y_rows, h_rows, b_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, stride_yn,
                            BLOCK_M, BLOCK_N, 128, SPLIT_K, IEEE, True)
        else:
            _expand_columns(y_rows, h_rows, b_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, stride_yn,
                            BLOCK_M, BLOCK_N, 64, SPLIT_K, IEEE, False)


# Launch configuration by the metadata's block_m (decode tiles of 16 tokens, prefill tiles of 64).
# Each program walks COLS columns of one tile in steps of BLOCK_N; the column groups are sized so that
# the grid holds about programs_per_sm programs per SM for the largest possible tile count.
EXPAND_CONFIGS = {
    16: dict(BLOCK_N=128, num_warps=8, num_stages=3, programs_per_sm=4),
    64: dict(BLOCK_N=128, num_warps=8, num_stages=3, programs_per_sm=4),
}
_NUM_SMS_GUESS = 132  # H100 / H200; only sizes the grid, never affects results


def _launch_expand(y, h, B, ranks, scales, token_order, tiles, slice_sizes: Sequence[int], block_m: int) -> None:
    num_tokens = y.shape[0]
    if num_tokens == 0:
        return
    split_k, n_slices, _, r_max = h.shape
    sizes = list(slice_sizes) + [0] * (MAX_SLICES - len(slice_sizes))
    config = dict(EXPAND_CONFIGS[16 if block_m <= 16 else 64])
    per_sm = config.pop("programs_per_sm")
    n_tiles = tiles.shape[1]
    col_blocks = triton.cdiv(max(slice_sizes), config["BLOCK_N"])
    groups = max(1, min(col_blocks, triton.cdiv(per_sm * _NUM_SMS_GUESS, n_tiles * n_slices)))
    cols = triton.cdiv(col_blocks, groups) * config["BLOCK_N"]
    grid = (triton.cdiv(max(slice_sizes), cols), n_tiles, n_slices)
    _expand_kernel[grid](
        y, h, B, ranks, scales, token_order, tiles,
        r_max, *sizes, cols,
        y.stride(0), y.stride(1),
        h.stride(0), h.stride(1), h.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        ranks.stride(0), ranks.stride(1),
        scales.stride(0), scales.stride(1),
        tiles.stride(0),
        BLOCK_M=block_m, SPLIT_K=split_k, IEEE=y.dtype == torch.float32, **config,
    )


def _check_expand_args(y, h, B, ranks, scales, token_slot, token_order, tiles, slice_sizes, block_m) -> None:
    check_tensor("y", y, dim=2, dtypes=FLOAT_DTYPES, device=y.device)
    check_tensor("h", h, dim=4, dtypes=(torch.float32,), device=y.device, unit_stride_dim=3)
    check_tensor("B", B, dim=3, dtypes=(y.dtype,), device=y.device)
    split_k, n_slices, num_tokens, r_max = h.shape
    if not 1 <= len(slice_sizes) <= MAX_SLICES or any(n < 1 for n in slice_sizes):
        raise ValueError(f"slice_sizes must hold 1 to {MAX_SLICES} positive widths, got {list(slice_sizes)}")
    if len(slice_sizes) != n_slices:
        raise ValueError(f"slice_sizes must give one width per slice of h ({n_slices}), got {list(slice_sizes)}")
    out = sum(slice_sizes)
    check_shape("y", y, (num_tokens, out), "[T, sum(slice_sizes)] with T from h")
    num_slots = B.shape[0]
    check_shape("B", B, (num_slots, out, r_max), "[S, sum(slice_sizes), R_max] with R_max from h")
    check_tensor("ranks", ranks, dim=2, dtypes=(torch.int32,), device=y.device)
    check_shape("ranks", ranks, (num_slots, n_slices), "[S, n_slices], one rank per slot and slice")
    check_tensor("scales", scales, dim=2, dtypes=(torch.float32,), device=y.device)
    check_shape("scales", scales, (num_slots, n_slices), "[S, n_slices], one scale per slot and slice")
    check_meta(token_slot, token_order, tiles, num_tokens, y.device)
    check_block_m(block_m)
    check_ranks(ranks, r_max)


@torch.library.custom_op("lorakit::expand", mutates_args=("y",))
def expand(
    y: torch.Tensor,
    h: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    token_slot: torch.Tensor,
    token_order: torch.Tensor,
    tiles: torch.Tensor,
    slice_sizes: list[int],
    block_m: int,
) -> None:
    """LoRA expand for all slices of a projection, added into y in place.

    Semantics:
        for t, i: s = token_slot[t]; r = ranks[s, i]; cols = columns of slice i (widths slice_sizes)
            y[t, cols] += scales[s, i] * h.sum(0)[i, t, :r] @ B[s, cols, :r].T   (skipped where s == -1)

    y: [T, sum(slice_sizes)] float32/float16/bfloat16, modified in place (any strides);
    h: float32 [split_k, n_slices, T, R_max] from shrink; B: [S, sum(slice_sizes), R_max], y's dtype,
    any strides ([S, R_max, out] storage read as B.transpose(1, 2) is fastest);
    ranks: int32 [S, n_slices]; scales: float32 [S, n_slices]; token_slot, token_order, tiles, block_m: a LoraMeta.
    The delta is accumulated in float32 and rounded once into y.
    """
    _check_expand_args(y, h, B, ranks, scales, token_slot, token_order, tiles, slice_sizes, block_m)
    _expand_torch(y, h, B, ranks, scales, token_slot, slice_sizes)


@expand.register_kernel("cuda")
def _(y, h, B, ranks, scales, token_slot, token_order, tiles, slice_sizes, block_m):
    _check_expand_args(y, h, B, ranks, scales, token_slot, token_order, tiles, slice_sizes, block_m)
    _launch_expand(y, h, B, ranks, scales, token_order, tiles, slice_sizes, block_m)


@expand.register_fake
def _(y, h, B, ranks, scales, token_slot, token_order, tiles, slice_sizes, block_m):
    return None


def _expand_torch(y, h, B, ranks, scales, token_slot, slice_sizes: Sequence[int]) -> None:
    """The CPU path in plain torch: one matmul per (used slot, slice), float32, rounded once into y."""
    hs = h.sum(0)
    slots = token_slot.long()
    ranks_host, scales_host = ranks.tolist(), scales.tolist()
    offsets = [0, *itertools.accumulate(slice_sizes)]
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = (slots == s).nonzero().squeeze(1)
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            r = ranks_host[s][i]
            if r == 0:
                continue
            delta = (hs[i, idx, :r] @ B[s, lo:hi, :r].float().T) * scales_host[s][i]
            y[idx, lo:hi] = (y[idx, lo:hi].float() + delta).to(y.dtype)
