"""LoRA expand, ``y += scale[s] * h @ B[s].T`` per token, in place, for every slice in one launch.

The slices of a fused projection (q/k/v under GQA, gate/up) are column ranges of one ``y`` and one
``B``; each program takes a tile of tokens of one slot and a range of one slice's columns, sums the
split-K partials of ``h`` once, and streams B and y through a pipelined loop over the columns, reading
B only up to ``rank[s, i]``. A DoRA slot's per-column rescale of the sum (``dora``) is applied in the same
pass, before y is written back: one more float32 read per column and tile, no extra launch.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import (
    FLOAT_DTYPES, MAX_SLICES, adapter_tokens_skipped, cdiv, check_block_m, check_meta, check_ranks, check_shape,
    check_tensor, dot, num_sms, pdl_supported, slice_output,
)


@triton.jit
def _load_h(h_rows, r0, rank, stride_hk, m_mask, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
            SPLIT_K: tl.constexpr, H_CACHE: tl.constexpr):
    """Columns r0 .. r0 + BLOCK_R of h for a tile of rows: the sum of the split-K partials, zero past rank. H_CACHE:
    the loads' cache modifier (".cg", past L1, where h was written by other programs of the same launch)."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    hv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kk in tl.static_range(SPLIT_K):
        hv += tl.load(h_rows + kk * stride_hk + offs_r[None, :],
                      mask=m_mask[:, None] & (offs_r < rank)[None, :], other=0.0, cache_modifier=H_CACHE)
    return hv


@triton.jit
def _expand_columns(y_rows, h_rows, b_base, d_base, n_lo, n_hi, rank, scale, m_mask,
                    stride_hk, stride_bn, stride_br, stride_yn, stride_dk,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    SPLIT_K: tl.constexpr, IEEE: tl.constexpr, HOIST: tl.constexpr, DORA: tl.constexpr,
                    H_CACHE: tl.constexpr):
    """y[rows, n_lo:n_hi] += scale * h[rows, :rank] @ B[n_lo:n_hi, :rank].T, BLOCK_N columns a step.

    HOIST (rank <= BLOCK_R): h is loaded once and only B and y stream through the pipelined loop.
    Otherwise the rank is walked in chunks of BLOCK_R for every block of columns.
    DORA (1: a gain, 2: a gain and a shift, at d_base and d_base + stride_dk): the sum v becomes
    v + gain * v + shift, column by column."""
    if HOIST:
        hv = _load_h(h_rows, 0, rank, stride_hk, m_mask, BLOCK_M, BLOCK_R, SPLIT_K, H_CACHE)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        y_ptrs = y_rows + offs_n[None, :] * stride_yn
        mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_ptrs, mask=mask, other=0.0)
        # DoRA's rescale of these columns, loaded beside y (not after the dot: a short loop pays each late load's
        # latency in full)
        gain = tl.zeros((BLOCK_N,), dtype=tl.float32)
        shift = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if DORA >= 1:
            gain = tl.load(d_base + offs_n, mask=n_mask, other=0.0)
        if DORA == 2:
            shift = tl.load(d_base + stride_dk + offs_n, mask=n_mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HOIST:
            offs_r = tl.arange(0, BLOCK_R)
            bv = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                         mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)
            acc = dot(hv, bv, acc, IEEE)
        else:
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                hc = _load_h(h_rows, r0, rank, stride_hk, m_mask, BLOCK_M, BLOCK_R, SPLIT_K, H_CACHE)
                bv = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                             mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)
                acc = dot(hc, bv, acc, IEEE)
        out = yv.to(tl.float32) + scale * acc
        if DORA >= 1:
            out += gain[None, :] * out
        if DORA == 2:
            out += shift[None, :]
        tl.store(y_ptrs, out.to(yv.dtype), mask=mask)


@triton.jit
def _expand_program(
    Y0, Y1, Y2, Y3, h_ptr, b_ptr, ranks_ptr, scales_ptr, order_ptr, tiles_ptr, d_ptr,
    R_MAX, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3, COLS, pid_g, pid_tile, slice_id,
    stride_hk, stride_hi, stride_ht, stride_hs, stride_bs, stride_bn, stride_br, stride_rs, stride_ri,
    stride_ss, stride_si, stride_tiles, stride_ds, stride_dk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr, DORA: tl.constexpr,
    H_CACHE: tl.constexpr,
):
    """One program's share of the expand: the delta of tile ``pid_tile`` added to columns pid_g*COLS ..
    (pid_g+1)*COLS of slice ``slice_id``."""
    # Slice i writes its own output Y_i (row stride SYT_i, N_i columns) from columns lo.. of B.
    y_ptr, stride_yt, lo, size = slice_output(slice_id, Y0, Y1, Y2, Y3, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3)
    n_lo = pid_g * COLS
    n_hi = tl.minimum(n_lo + COLS, size)

    slot = tl.load(tiles_ptr + pid_tile)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * stride_rs + slice_id * stride_ri)
    rank = tl.where(slot >= 0, tl.minimum(rank, R_MAX), 0)
    if (rank > 0) & (n_lo < size):
        start = tl.load(tiles_ptr + stride_tiles + pid_tile)
        end = tl.load(tiles_ptr + 2 * stride_tiles + pid_tile)
        scale = tl.load(scales_ptr + tl.maximum(slot, 0) * stride_ss + slice_id * stride_si).to(tl.float32)
        scale = tl.where(slot >= 0, scale, 0.0)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tok = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        y_rows = y_ptr + tok[:, None] * stride_yt
        h_rows = h_ptr + slot.to(tl.int64) * stride_hs + slice_id * stride_hi + tok[:, None] * stride_ht
        b_base = b_ptr + slot.to(tl.int64) * stride_bs + lo * stride_bn
        d_base = d_ptr + slot.to(tl.int64) * stride_ds + lo
        # The rank block follows this slot's rank: bytes stop at the rank, FLOPs at the next of 16, 32,
        # 64 or 128, and ranks above 128 walk chunks of 64.
        if rank <= 16:
            _expand_columns(y_rows, h_rows, b_base, d_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, 1, stride_dk,
                            BLOCK_M, BLOCK_N, 16, SPLIT_K, IEEE, True, DORA, H_CACHE)
        elif rank <= 32:
            _expand_columns(y_rows, h_rows, b_base, d_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, 1, stride_dk,
                            BLOCK_M, BLOCK_N, 32, SPLIT_K, IEEE, True, DORA, H_CACHE)
        elif rank <= 64:
            _expand_columns(y_rows, h_rows, b_base, d_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, 1, stride_dk,
                            BLOCK_M, BLOCK_N, 64, SPLIT_K, IEEE, True, DORA, H_CACHE)
        elif rank <= 128:
            _expand_columns(y_rows, h_rows, b_base, d_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, 1, stride_dk,
                            BLOCK_M, BLOCK_N, 128, SPLIT_K, IEEE, True, DORA, H_CACHE)
        else:
            _expand_columns(y_rows, h_rows, b_base, d_base, n_lo, n_hi, rank, scale, m_mask,
                            stride_hk, stride_bn, stride_br, 1, stride_dk,
                            BLOCK_M, BLOCK_N, 64, SPLIT_K, IEEE, False, DORA, H_CACHE)


@triton.jit
def _expand_kernel(
    Y0, Y1, Y2, Y3, h_ptr, b_ptr, ranks_ptr, scales_ptr, order_ptr, tiles_ptr, d_ptr,
    R_MAX, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3, COLS,
    stride_hk, stride_hi, stride_ht, stride_hs,
    stride_bs, stride_bn, stride_br,
    stride_rs, stride_ri,
    stride_ss, stride_si,
    stride_tiles,
    stride_ds, stride_dk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, DORA: tl.constexpr,
):
    # Launched while the kernel before (the shrink) may still run: wait for it before the first load. No early
    # trigger for the kernel after: a PDL shrink that started beside this kernel would take its SMs.
    if PDL:
        tl.extra.cuda.gdc_wait()
    # Program (g, tile, slice) adds the delta of one tile of tokens to columns g*COLS .. (g+1)*COLS of one slice.
    _expand_program(Y0, Y1, Y2, Y3, h_ptr, b_ptr, ranks_ptr, scales_ptr, order_ptr, tiles_ptr, d_ptr,
                    R_MAX, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3, COLS,
                    tl.program_id(0), tl.program_id(1), tl.program_id(2),
                    stride_hk, stride_hi, stride_ht, stride_hs, stride_bs, stride_bn, stride_br, stride_rs, stride_ri,
                    stride_ss, stride_si, stride_tiles, stride_ds, stride_dk,
                    BLOCK_M, BLOCK_N, SPLIT_K, IEEE, DORA, "")


# Launch configuration by the metadata's block_m (decode tiles of 16 tokens, prefill tiles of 64).
# Each program walks COLS columns of one tile in steps of BLOCK_N; the column groups are sized so that
# the grid holds about programs_per_sm programs per SM for the largest possible tile count.
EXPAND_CONFIGS = {
    16: dict(BLOCK_N=128, num_warps=8, num_stages=3, programs_per_sm=4),
    64: dict(BLOCK_N=128, num_warps=8, num_stages=3, programs_per_sm=4),
}


def _launch_expand(ys, h, B, ranks, scales, token_order, tiles, block_m: int, pdl: bool = False,
                   sms: int | None = None, dora: torch.Tensor | None = None, h_slot_stride: int = 0) -> None:
    """Launch the expand kernel: ys[i] += the delta of slice i (then DoRA's rescale where ``dora`` is given).
    ``pdl``: launched with programmatic dependent launch where the device supports it; the grid is sized for
    ``sms`` SMs (default: the device's). ``h_slot_stride``: elements between slots' rows of h, 0 for the shrink's
    partials (one row per token); a slot's own columns of one wide h otherwise (h computed for every slot at
    once, e.g. by a GEMM over every slot's A: bench_structures)."""
    num_tokens = ys[0].shape[0]
    if num_tokens == 0:
        return
    if adapter_tokens_skipped():  # no adapter tokens: the delta is zero
        return
    split_k, n_slices, _, r_max = h.shape
    pad = MAX_SLICES - len(ys)
    widths = [y.shape[1] for y in ys]
    config = dict(EXPAND_CONFIGS[16 if block_m <= 16 else 64])
    per_sm = config.pop("programs_per_sm")
    n_tiles = tiles.shape[1]
    col_blocks = cdiv(max(widths), config["BLOCK_N"])
    groups = max(1, min(col_blocks, cdiv(per_sm * (sms or num_sms(h.device)), n_tiles * n_slices)))
    cols = cdiv(col_blocks, groups) * config["BLOCK_N"]
    grid = (cdiv(max(widths), cols), n_tiles, n_slices)
    pdl = pdl and pdl_supported(h.device)
    _expand_kernel[grid](
        *ys, *[ys[0]] * pad, h, B, ranks, scales, token_order, tiles, B if dora is None else dora,
        r_max, *widths, *[0] * pad, *[y.stride(0) for y in ys], *[0] * pad, cols,
        h.stride(0), h.stride(1), h.stride(2), h_slot_stride,
        B.stride(0), B.stride(1), B.stride(2),
        ranks.stride(0), ranks.stride(1),
        scales.stride(0), scales.stride(1),
        tiles.stride(0),
        *((0, 0) if dora is None else (dora.stride(0), dora.stride(1))),
        BLOCK_M=block_m, SPLIT_K=split_k, IEEE=B.dtype == torch.float32, PDL=pdl,
        DORA=0 if dora is None else dora.shape[1],
        **({"launch_pdl": True} if pdl else {}), **config,
    )


def _check_expand_args(ys, h, B, ranks, scales, token_slot, token_order, tiles, block_m, dora=None) -> None:
    if not isinstance(ys, (list, tuple)) or not 1 <= len(ys) <= MAX_SLICES:
        raise ValueError(f"ys must be a list of 1 to {MAX_SLICES} output tensors (one per slice), got {ys!r:.100}")
    check_tensor("ys[0]", ys[0], dim=2, dtypes=FLOAT_DTYPES, device=ys[0].device, unit_stride_dim=1)
    device, dtype = ys[0].device, ys[0].dtype
    for i, y in enumerate(ys[1:], 1):
        check_tensor(f"ys[{i}]", y, dim=2, dtypes=(dtype,), device=device, unit_stride_dim=1)
    check_tensor("h", h, dim=4, dtypes=(torch.float32,), device=device, unit_stride_dim=3)
    check_tensor("B", B, dim=3, dtypes=(dtype,), device=device)
    split_k, n_slices, num_tokens, r_max = h.shape
    if len(ys) != n_slices:
        raise ValueError(f"ys must hold one output per slice of h ({n_slices}), got {len(ys)}")
    for i, y in enumerate(ys):
        if y.shape[0] != num_tokens:
            raise ValueError(f"ys[{i}] must have {num_tokens} rows (T from h), got shape {tuple(y.shape)}")
    widths = [y.shape[1] for y in ys]
    num_slots = B.shape[0]
    check_shape("B", B, (num_slots, sum(widths), r_max),
                f"[S, sum of the slice widths {widths}, R_max] with R_max from h")
    check_tensor("ranks", ranks, dim=2, dtypes=(torch.int32,), device=device)
    check_shape("ranks", ranks, (num_slots, n_slices), "[S, n_slices], one rank per slot and slice")
    check_tensor("scales", scales, dim=2, dtypes=(torch.float32,), device=device)
    check_shape("scales", scales, (num_slots, n_slices), "[S, n_slices], one scale per slot and slice")
    check_meta(token_slot, token_order, tiles, num_tokens, device)
    check_block_m(block_m)
    check_ranks(ranks, r_max)
    if dora is not None:
        check_tensor("dora", dora, dim=3, dtypes=(torch.float32,), device=device, unit_stride_dim=2)
        if dora.shape[0] != num_slots or dora.shape[1] not in (1, 2) or dora.shape[2] != sum(widths):
            raise ValueError(f"dora must be float32 [S={num_slots}, 1 or 2, {sum(widths)}] (each slot's gain - 1, "
                             f"and optionally its shift, per output column), got shape {tuple(dora.shape)}")


@torch.library.custom_op("lorakit::expand", mutates_args=("ys",))
def expand(
    ys: list[torch.Tensor],
    h: torch.Tensor,
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
    """LoRA expand for all slices of a projection, added in place into one output per slice.

    Semantics:
        for t, i: s = token_slot[t]; r = ranks[s, i]; cols = the columns of B for slice i (B's slices are
        ys' widths, in order)
            v = ys[i][t] + scales[s, i] * h.sum(0)[i, t, :r] @ B[s, cols, :r].T   (skipped where s == -1 or r == 0)
            if dora is given: v = v + dora[s, 0, cols] * v (+ dora[s, 1, cols] where dora has 2 rows)
            ys[i][t] = v

    ys: 1 to 4 tensors [T, out_i] of one dtype (float32/float16/bfloat16), unit column stride, modified
    in place: separate outputs (q, k, v of one input) or column views of one output;
    h: float32 [split_k, n_slices, T, R_max] from shrink; B: [S, sum(out_i), R_max], ys' dtype,
    any strides ([S, R_max, out] storage read as B.transpose(1, 2) is fastest);
    ranks: int32 [S, n_slices]; scales: float32 [S, n_slices]; token_slot, token_order, tiles, block_m: a LoraMeta.
    dora: None, or float32 [S, 1 or 2, sum(out_i)], unit column stride: DoRA's per-column rescale of each slot,
    ``m / ||W + scale B A|| - 1`` and, for a layer with a bias b, ``-(that) * b`` (zeros: a plain LoRA slot).
    The delta is accumulated in float32 and rounded once into ys. pdl: how the CUDA kernel launches
    (``KernelOptions.pdl``: "expand" in it); the results do not depend on it.
    """
    _check_expand_args(ys, h, B, ranks, scales, token_slot, token_order, tiles, block_m, dora)
    _expand_torch(ys, h, B, ranks, scales, token_slot, dora)


@expand.register_kernel("cuda")
def _(ys, h, B, ranks, scales, token_slot, token_order, tiles, block_m, pdl=False, dora=None):
    _check_expand_args(ys, h, B, ranks, scales, token_slot, token_order, tiles, block_m, dora)
    _launch_expand(ys, h, B, ranks, scales, token_order, tiles, block_m, pdl, dora=dora)


@expand.register_fake
def _(ys, h, B, ranks, scales, token_slot, token_order, tiles, block_m, pdl=False, dora=None):
    return None


def _expand_torch(ys, h, B, ranks, scales, token_slot, dora=None) -> None:
    """The CPU path in plain torch: one matmul per (used slot, slice), float32, rounded once into ys."""
    if adapter_tokens_skipped():
        return
    hs = h.sum(0)
    slots = token_slot.long()
    ranks_host, scales_host = ranks.tolist(), scales.tolist()
    offsets = [0, *itertools.accumulate(y.shape[1] for y in ys)]
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = (slots == s).nonzero().squeeze(1)
        for i, y in enumerate(ys):
            r = ranks_host[s][i]
            if r == 0:
                continue
            lo, hi = offsets[i], offsets[i + 1]
            v = y[idx].float() + (hs[i, idx, :r] @ B[s, lo:hi, :r].float().T) * scales_host[s][i]
            if dora is not None:
                v = v + dora[s, 0, lo:hi] * v
                if dora.shape[1] == 2:
                    v = v + dora[s, 1, lo:hi]
            y[idx] = v.to(y.dtype)
