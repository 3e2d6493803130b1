"""LoRA shrink, ``h = x @ A[s].T`` per token, for every slice of a fused projection in one launch.

The kernel walks the tiles of ``LoraMeta`` (runs of tokens of one slot) and reads only the first
``rank[s, i]`` rows of each adapter's A: rank padding costs neither bytes nor launches. The K
dimension may be split over ``split_k`` programs; each writes its own partial sum, so the result is
deterministic and needs no zeroing or atomics. The expand op sums the partials as it reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import (
    CPU_SMS, FLOAT_DTYPES, adapter_tokens_skipped, cdiv, check_block_m, check_meta, check_ranks, check_shape,
    check_tensor, dot, next_power_of_2, pdl_supported,
)


@triton.jit
def _shrink_program(
    x_ptr, a_ptr, h_ptr, ranks_ptr, order_ptr, tiles_ptr, K, R_MAX, pid_r, pid_tile, sub, pid_k,
    stride_xt, stride_as, stride_ai, stride_ar, stride_hk, stride_hi, stride_ht, stride_rs, stride_ri, stride_tiles,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
):
    """One program's share of the shrink: BLOCK_R rank columns (``pid_r``: slice and rank block) of block ``sub`` of
    tile ``pid_tile``, over split ``pid_k`` of K."""
    n_rblocks = tl.cdiv(R_MAX, BLOCK_R)
    slice_id = pid_r // n_rblocks
    r0 = (pid_r % n_rblocks) * BLOCK_R

    slot = tl.load(tiles_ptr + pid_tile)
    start = tl.load(tiles_ptr + stride_tiles + pid_tile)
    end = tl.load(tiles_ptr + 2 * stride_tiles + pid_tile)
    offs_m = start + sub * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tok = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)

    rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * stride_rs + slice_id * stride_ri)
    rank = tl.where(slot >= 0, tl.minimum(rank, R_MAX), 0)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if r0 < rank:
        r_mask = offs_r < rank
        k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        x_rows = x_ptr + tok[:, None] * stride_xt
        a_cols = a_ptr + slot.to(tl.int64) * stride_as + slice_id * stride_ai + offs_r[None, :] * stride_ar
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_cols + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc = dot(xt, at, acc, IEEE)
    # Every (token, rank column) is written by exactly one program per split: zeros for base tokens
    # and rank padding, so the output is fully defined without a memset.
    h_ptrs = h_ptr + pid_k * stride_hk + slice_id * stride_hi + tok[:, None] * stride_ht + offs_r[None, :]
    tl.store(h_ptrs, acc, mask=m_mask[:, None] & (offs_r < R_MAX)[None, :])


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, ranks_ptr, order_ptr, tiles_ptr,
    K, R_MAX,
    stride_xt,
    stride_as, stride_ai, stride_ar,
    stride_hk, stride_hi, stride_ht,
    stride_rs, stride_ri,
    stride_tiles,
    BLOCK_M: tl.constexpr, SUB_TILES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
):
    if PDL:  # launched while the kernel before may still run: wait for it
        tl.extra.cuda.gdc_wait()
    if TRIGGER:  # the expand (launched with PDL) may start now, and wait for this kernel's end
        tl.extra.cuda.gdc_launch_dependents()
    # Axis 0 (fastest) runs over (slice, rank block), so the programs that share a tile of x run together.
    # Axis 1 runs over tiles, each cut into SUB_TILES blocks of BLOCK_M rows for more parallelism.
    _shrink_program(x_ptr, a_ptr, h_ptr, ranks_ptr, order_ptr, tiles_ptr, K, R_MAX,
                    tl.program_id(0), tl.program_id(1) // SUB_TILES, tl.program_id(1) % SUB_TILES, tl.program_id(2),
                    stride_xt, stride_as, stride_ai, stride_ar, stride_hk, stride_hi, stride_ht, stride_rs, stride_ri,
                    stride_tiles, BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, IEEE)


def _block_r(r_max: int) -> int:
    return min(64, max(16, next_power_of_2(r_max)))


# Launch configuration by the metadata's block_m: rows per program (a tile of 64 prefill tokens is
# cut in four), K columns per step, and how far to split K: until the grid holds programs_per_sm
# programs per SM, at most max_split ways, with >= 256 columns of K per program.
SHRINK_CONFIGS = {
    16: dict(BLOCK_M=16, BLOCK_K=128, num_warps=4, num_stages=3, max_split=16, programs_per_sm=2),
    64: dict(BLOCK_M=16, BLOCK_K=128, num_warps=4, num_stages=4, max_split=2, programs_per_sm=2),
}


def _shrink_config(block_m: int) -> dict:
    return SHRINK_CONFIGS[16 if block_m <= 16 else 64]


def shrink_split_k(in_features: int, n_slices: int, r_max: int, n_tiles: int, block_m: int,
                   sms: int = CPU_SMS) -> int:
    """How many ways to split K (each split writes a partial of h that the expand sums once per program)."""
    config = _shrink_config(block_m)
    programs = n_slices * cdiv(r_max, _block_r(r_max)) * n_tiles * (block_m // config["BLOCK_M"])
    split = 1
    while (split < config["max_split"] and programs * split * 2 <= config["programs_per_sm"] * sms
           and in_features // (split * 2) >= 256):
        split *= 2
    return split


def _launch_shrink(x, A, ranks, token_order, tiles, block_m: int, split_k: int, pdl: bool = False,
                   trigger: bool = False) -> torch.Tensor:
    """Launch the shrink kernel into new partials h. ``pdl``: launched with programmatic dependent launch;
    ``trigger``: lets the kernel after it (a PDL expand) launch early; either only where the device supports it."""
    num_tokens, k = x.shape
    _, n_slices, r_max, _ = A.shape
    h = torch.empty((split_k, n_slices, num_tokens, r_max), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or adapter_tokens_skipped():
        return h
    block_r = _block_r(r_max)
    config = {k: v for k, v in _shrink_config(block_m).items() if k not in ("max_split", "programs_per_sm")}
    sub_tiles = block_m // config["BLOCK_M"]
    grid = (n_slices * cdiv(r_max, block_r), tiles.shape[1] * sub_tiles, split_k)
    supported = pdl_supported(x.device)
    pdl, trigger = pdl and supported, trigger and supported
    _shrink_kernel[grid](
        x, A, h, ranks, token_order, tiles,
        k, r_max,
        x.stride(0),
        A.stride(0), A.stride(1), A.stride(2),
        h.stride(0), h.stride(1), h.stride(2),
        ranks.stride(0), ranks.stride(1),
        tiles.stride(0),
        SUB_TILES=sub_tiles, BLOCK_R=block_r, SPLIT_K=split_k, IEEE=x.dtype == torch.float32, PDL=pdl,
        TRIGGER=trigger, **({"launch_pdl": True} if pdl else {}), **config,
    )
    return h


def _check_shrink_args(x, A, ranks, token_slot, token_order, tiles, block_m, split_k) -> None:
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES, device=x.device, unit_stride_dim=1)
    check_tensor("A", A, dim=4, dtypes=(x.dtype,), device=x.device, unit_stride_dim=3)
    num_slots, n_slices, r_max, in_features = A.shape
    if in_features != x.shape[1]:
        raise ValueError(
            f"A must have shape [S, n_slices, R_max, in={x.shape[1]}] to match x [T, in], got {tuple(A.shape)}"
        )
    check_tensor("ranks", ranks, dim=2, dtypes=(torch.int32,), device=x.device)
    check_shape("ranks", ranks, (num_slots, n_slices), "[S, n_slices], one rank per slot and slice")
    check_meta(token_slot, token_order, tiles, x.shape[0], x.device)
    check_block_m(block_m)
    if not 1 <= split_k <= 64:
        raise ValueError(f"split_k must lie in [1, 64], got {split_k}")
    check_ranks(ranks, r_max)


@torch.library.custom_op("lorakit::shrink", mutates_args=())
def shrink(
    x: torch.Tensor,
    A: torch.Tensor,
    ranks: torch.Tensor,
    token_slot: torch.Tensor,
    token_order: torch.Tensor,
    tiles: torch.Tensor,
    block_m: int,
    split_k: int,
    pdl: bool = False,
    trigger: bool = False,
) -> torch.Tensor:
    """LoRA shrink for all slices of a projection; returns split-K partial sums.

    Semantics:
        h = zeros(split_k, n_slices, T, R_max, float32)
        for t, i: s = token_slot[t]; r = ranks[s, i]
            h.sum(0)[i, t, :r] = x[t] @ A[s, i, :r].T     (skipped, left zero, where s == -1)

    x: [T, in] float32/float16/bfloat16; A: [S, n_slices, R_max, in], x's dtype;
    ranks: int32 [S, n_slices], each <= R_max; token_slot, token_order, tiles, block_m: a LoraMeta.
    pdl, trigger: how the CUDA kernel launches (``KernelOptions.pdl``: "shrink" in it, "expand" in it); the
    results do not depend on them.
    """
    _check_shrink_args(x, A, ranks, token_slot, token_order, tiles, block_m, split_k)
    return _shrink_torch(x, A, ranks, token_slot, split_k)


@shrink.register_kernel("cuda")
def _(x, A, ranks, token_slot, token_order, tiles, block_m, split_k, pdl=False, trigger=False):
    _check_shrink_args(x, A, ranks, token_slot, token_order, tiles, block_m, split_k)
    return _launch_shrink(x, A, ranks, token_order, tiles, block_m, split_k, pdl, trigger)


@shrink.register_fake
def _(x, A, ranks, token_slot, token_order, tiles, block_m, split_k, pdl=False, trigger=False):
    return x.new_empty((split_k, A.shape[1], x.shape[0], A.shape[2]), dtype=torch.float32)


def _shrink_torch(x, A, ranks, token_slot, split_k: int) -> torch.Tensor:
    """The CPU path in plain torch: one matmul per (used slot, slice), float32 accumulation."""
    num_tokens = x.shape[0]
    _, n_slices, r_max, _ = A.shape
    h = torch.zeros((split_k, n_slices, num_tokens, r_max), dtype=torch.float32, device=x.device)
    if adapter_tokens_skipped():
        return h
    slots = token_slot.long()
    ranks_host = ranks.tolist()
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        idx = (slots == s).nonzero().squeeze(1)
        xs = x.index_select(0, idx).float()
        for i in range(n_slices):
            r = ranks_host[s][i]
            if r > 0:
                h[0, i, idx, :r] = xs @ A[s, i, :r].float().T
    return h
