"""Expert LoRA: the LoRA delta of a stacked MoE expert parameter, ``y[p] += scale * (x[p] @ A[s, e].T) @ B[s, e].T``
for every routed (token, expert) pair p, in one shrink and one expand launch keyed by (slot, expert).

The rows are the layer's (token, expert) pairs; each row's key is ``slot * E + expert`` (-1 for a base-model token),
so a ``LoraMeta`` built over ``S * E`` keys groups the rows into tiles of one (slot, expert) each, and the kernels
are the shrink and expand of ``lorakit.ops`` with A and B indexed by both. Like those, they read A and B only up to
the rank of the tile's (slot, expert), write every element of the partials, and add to y in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import (
    CPU_SMS, FLOAT_DTYPES, adapter_tokens_skipped, cdiv, check_block_m, check_meta, check_ranks, check_shape,
    check_tensor, dot, next_power_of_2, num_sms, unobserved,
)
from lorakit.ops.meta import LoraMeta, build_lora_meta
from lorakit.ops.options import KernelOptions


@triton.jit
def _tile_key(tiles_ptr, pid_tile, stride_tiles, ranks_ptr, stride_rs, stride_re, E, R_MAX):
    """(slot, expert, rank) of a tile: rank 0 for base and empty tiles, clamped to R_MAX."""
    key = tl.load(tiles_ptr + pid_tile)
    slot = tl.where(key >= 0, key // E, 0)
    expert = tl.where(key >= 0, key % E, 0)
    rank = tl.load(ranks_ptr + slot * stride_rs + expert * stride_re)
    rank = tl.where(key >= 0, tl.minimum(rank, R_MAX), 0)
    return slot, expert, rank


@triton.jit
def _expert_shrink_kernel(
    x_ptr, a_ptr, h_ptr, ranks_ptr, order_ptr, tiles_ptr,
    K, R_MAX, E,
    stride_xt,
    stride_as, stride_ae, stride_ar,
    stride_hk, stride_ht,
    stride_rs, stride_re,
    stride_tiles,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Program (rank block, tile, split) computes h[split, rows of the tile, rank block] = x @ A[s, e].T over its
    # part of K; zeros past the rank and for base tiles, so h needs no memset.
    pid_r = tl.program_id(0)
    pid_tile = tl.program_id(1)
    pid_k = tl.program_id(2)
    r0 = pid_r * BLOCK_R
    slot, expert, rank = _tile_key(tiles_ptr, pid_tile, stride_tiles, ranks_ptr, stride_rs, stride_re, E, R_MAX)
    start = tl.load(tiles_ptr + stride_tiles + pid_tile)
    end = tl.load(tiles_ptr + 2 * stride_tiles + pid_tile)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tok = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if r0 < rank:
        r_mask = offs_r < rank
        k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        x_rows = x_ptr + tok[:, None] * stride_xt
        a_cols = (a_ptr + slot.to(tl.int64) * stride_as + expert.to(tl.int64) * stride_ae
                  + offs_r[None, :] * stride_ar)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_cols + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc = dot(xt, at, acc, IEEE)
    h_ptrs = h_ptr + pid_k * stride_hk + tok[:, None] * stride_ht + offs_r[None, :]
    tl.store(h_ptrs, acc, mask=m_mask[:, None] & (offs_r < R_MAX)[None, :])


@triton.jit
def _expert_expand_kernel(
    y_ptr, h_ptr, b_ptr, ranks_ptr, scales_ptr, order_ptr, tiles_ptr,
    N, R_MAX, E, COLS,
    stride_yt,
    stride_hk, stride_ht,
    stride_bs, stride_be, stride_bn, stride_br,
    stride_rs, stride_re,
    stride_ss, stride_se,
    stride_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Program (column group, tile) adds scale * h @ B[s, e, cols, :rank].T to COLS columns of the tile's rows,
    # BLOCK_N a step, the rank in chunks of BLOCK_R (one chunk when R_MAX <= BLOCK_R).
    pid_g = tl.program_id(0)
    pid_tile = tl.program_id(1)
    n_lo = pid_g * COLS
    n_hi = tl.minimum(n_lo + COLS, N)
    slot, expert, rank = _tile_key(tiles_ptr, pid_tile, stride_tiles, ranks_ptr, stride_rs, stride_re, E, R_MAX)
    if (rank > 0) & (n_lo < N):
        start = tl.load(tiles_ptr + stride_tiles + pid_tile)
        end = tl.load(tiles_ptr + 2 * stride_tiles + pid_tile)
        scale = tl.load(scales_ptr + slot * stride_ss + expert * stride_se).to(tl.float32)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        tok = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        y_rows = y_ptr + tok[:, None] * stride_yt
        h_rows = h_ptr + tok[:, None] * stride_ht
        b_base = b_ptr + slot.to(tl.int64) * stride_bs + expert.to(tl.int64) * stride_be
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_hi
            mask = m_mask[:, None] & n_mask[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < rank
                hv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for kk in tl.static_range(SPLIT_K):
                    hv += tl.load(h_rows + kk * stride_hk + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :],
                                  other=0.0)
                bv = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                             mask=r_mask[:, None] & n_mask[None, :], other=0.0)
                acc = dot(hv, bv, acc, IEEE)
            y_ptrs = y_rows + offs_n[None, :]
            yv = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (yv.to(tl.float32) + scale * acc).to(yv.dtype), mask=mask)


# Rows per tile come from the metadata (16 at decode, 64 at prefill); the shrink splits K until the grid holds about
# two programs per SM (at most 16 ways, >= 256 columns each); the expand's column groups give about four per SM.
BLOCK_K, BLOCK_N, MAX_SPLIT = 128, 128, 16


def _block_r(r_max: int) -> int:
    return min(64, max(16, next_power_of_2(r_max)))


def expert_split_k(in_features: int, r_max: int, n_tiles: int, sms: int = CPU_SMS) -> int:
    """How many ways the shrink splits K (each split writes its own partial of h, summed by the expand)."""
    programs = cdiv(r_max, _block_r(r_max)) * n_tiles
    split = 1
    while split < MAX_SPLIT and programs * split * 2 <= 2 * sms and in_features // (split * 2) >= 256:
        split *= 2
    return split


def _launch(y, x, A, B, ranks, scales, token_order, tiles, block_m: int, split_k: int, sms: int | None = None):
    num_tokens, k = x.shape
    _, num_experts, r_max, _ = A.shape
    if num_tokens == 0 or r_max == 0 or adapter_tokens_skipped():
        return
    n = y.shape[1]
    block_r = _block_r(r_max)
    n_tiles = tiles.shape[1]
    h = torch.empty((split_k, num_tokens, r_max), dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    _expert_shrink_kernel[(cdiv(r_max, block_r), n_tiles, split_k)](
        x, A, h, ranks, token_order, tiles,
        k, r_max, num_experts,
        x.stride(0),
        A.stride(0), A.stride(1), A.stride(2),
        h.stride(0), h.stride(1),
        ranks.stride(0), ranks.stride(1),
        tiles.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=BLOCK_K, SPLIT_K=split_k, IEEE=ieee, num_warps=4, num_stages=3,
    )
    col_blocks = cdiv(n, BLOCK_N)
    groups = max(1, min(col_blocks, cdiv(4 * (sms or num_sms(x.device)), n_tiles)))
    cols = cdiv(col_blocks, groups) * BLOCK_N
    _expert_expand_kernel[(cdiv(n, cols), n_tiles)](
        y, h, B, ranks, scales, token_order, tiles,
        n, r_max, num_experts, cols,
        y.stride(0),
        h.stride(0), h.stride(1),
        B.stride(0), B.stride(1), B.stride(2), B.stride(3),
        ranks.stride(0), ranks.stride(1),
        scales.stride(0), scales.stride(1),
        tiles.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_R=block_r, SPLIT_K=split_k, IEEE=ieee, num_warps=4, num_stages=3,
    )


def _check_args(y, x, A, B, ranks, scales, token_key, token_order, tiles, block_m, split_k) -> None:
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES, device=x.device, unit_stride_dim=1)
    check_tensor("y", y, dim=2, dtypes=(x.dtype,), device=x.device, unit_stride_dim=1)
    check_tensor("A", A, dim=4, dtypes=(x.dtype,), device=x.device, unit_stride_dim=3)
    check_tensor("B", B, dim=4, dtypes=(x.dtype,), device=x.device)
    num_slots, num_experts, r_max, in_features = A.shape
    if in_features != x.shape[1]:
        raise ValueError(f"A must have shape [S, E, R_max, in={x.shape[1]}] to match x [P, in], got {tuple(A.shape)}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"y must have one row per row of x ({x.shape[0]}), got shape {tuple(y.shape)}")
    check_shape("B", B, (num_slots, num_experts, y.shape[1], r_max), "[S, E, out, R_max] with S, E, R_max from A "
                "and out from y")
    for name, t, dtype in (("ranks", ranks, torch.int32), ("scales", scales, torch.float32)):
        check_tensor(name, t, dim=2, dtypes=(dtype,), device=x.device)
        check_shape(name, t, (num_slots, num_experts), "[S, E], one per slot and expert")
    check_meta(token_key, token_order, tiles, x.shape[0], x.device)
    check_block_m(block_m)
    if not 1 <= split_k <= 64:
        raise ValueError(f"split_k must lie in [1, 64], got {split_k}")
    check_ranks(ranks, r_max)


@torch.library.custom_op("lorakit::expert_lora", mutates_args=("y",))
def expert_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    token_key: torch.Tensor,
    token_order: torch.Tensor,
    tiles: torch.Tensor,
    block_m: int,
    split_k: int,
) -> None:
    """Expert LoRA of one stacked parameter, added in place.

    Semantics:
        E = A.shape[1]
        for p: k = token_key[p]; s, e = k // E, k % E; r = ranks[s, e]     (skipped where k == -1)
            y[p] += scales[s, e] * (x[p] @ A[s, e, :r].T) @ B[s, e, :, :r].T

    x: [P, in] float32/float16/bfloat16, one row per routed (token, expert) pair; y: [P, out], x's dtype, unit
    column stride, modified in place; A: [S, E, R_max, in]; B: [S, E, out, R_max] (any strides: stored as
    [S, R_max, E * out] and viewed, the expand reads the first r rows of each, coalesced); ranks int32 and
    scales float32 [S, E]; token_key, token_order, tiles, block_m: a LoraMeta built over S * E keys (key =
    slot * E + expert, -1 for base rows). The delta is accumulated in float32 and rounded once into y; split_k: how
    many partials the shrink's K is split into (never changes the result beyond float32 summation order).
    """
    _check_args(y, x, A, B, ranks, scales, token_key, token_order, tiles, block_m, split_k)
    _expert_torch(y, x, A, B, ranks, scales, token_key)


@expert_lora.register_kernel("cuda")
def _(y, x, A, B, ranks, scales, token_key, token_order, tiles, block_m, split_k):
    _check_args(y, x, A, B, ranks, scales, token_key, token_order, tiles, block_m, split_k)
    _launch(y, x, A, B, ranks, scales, token_order, tiles, block_m, split_k)


@expert_lora.register_fake
def _(y, x, A, B, ranks, scales, token_key, token_order, tiles, block_m, split_k):
    return None


def _expert_torch(y, x, A, B, ranks, scales, token_key) -> None:
    """The CPU path in plain torch: one matmul pair per (slot, expert) present, float32, rounded once into y."""
    if adapter_tokens_skipped() or A.shape[2] == 0:
        return
    num_experts = A.shape[1]
    keys = token_key.long()
    ranks_host, scales_host = ranks.tolist(), scales.tolist()
    for key in torch.unique(keys).tolist():
        if key < 0:
            continue
        s, e = divmod(key, num_experts)
        r = ranks_host[s][e]
        if r == 0:
            continue
        idx = (keys == key).nonzero().squeeze(1)
        h = x.index_select(0, idx).float() @ A[s, e, :r].float().T
        delta = (h @ B[s, e, :, :r].float().T) * scales_host[s][e]
        y[idx] = (y[idx].float() + delta).to(y.dtype)


def expert_keys(token_slot: torch.Tensor, experts: torch.Tensor, num_slots: int, num_experts: int) -> LoraMeta:
    """The metadata of a layer's (token, expert) rows: ``token_slot`` [P] (-1 base) and ``experts`` [P] give each
    row the key slot * E + expert, grouped over S * E keys (on the device, no host sync)."""
    slot = token_slot.to(torch.int64)
    key = torch.where(slot >= 0, slot * num_experts + experts.to(torch.int64), -1)
    return build_lora_meta(key, num_slots * num_experts)


def add_expert_lora(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, ranks: torch.Tensor,
                    scales: torch.Tensor, meta: LoraMeta, check: bool = True,
                    options: KernelOptions = KernelOptions()) -> None:
    """``torch.ops.lorakit.expert_lora`` over a LoraMeta from ``expert_keys``: y[p] += the delta of row p's (slot,
    expert). check=False skips the checks of an eager call on a direct device (tensors lorakit built); options: which
    devices' eager calls launch the kernels themselves (``KernelOptions.direct_devices``)."""
    if check and meta.num_slots != A.shape[0] * A.shape[1]:
        raise ValueError(f"the LoraMeta was built for {meta.num_slots} keys but A holds {A.shape[0]} slots x "
                         f"{A.shape[1]} experts; build it with expert_keys(..., num_slots, num_experts)")
    split_k = expert_split_k(x.shape[1], A.shape[2], meta.tiles.shape[1], num_sms(x.device))
    if x.device.type in options.direct_devices and unobserved(y, x, A, B):  # the rule of lorakit.ops._direct
        if check:
            _check_args(y, x, A, B, ranks, scales, meta.token_slot, meta.token_order, meta.tiles, meta.block_m,
                        split_k)
        _launch(y, x, A, B, ranks, scales, meta.token_order, meta.tiles, meta.block_m, split_k)
        return
    torch.ops.lorakit.expert_lora(y, x, A, B, ranks, scales, meta.token_slot, meta.token_order, meta.tiles,
                                  meta.block_m, split_k)
