"""Paged KV-cache attention: ``write_kv`` stores a step's keys and values in the block cache, and
``paged_attention`` attends over it, causally, for decode, prefill and chunked prefill alike.

    write_kv(k_cache, v_cache, key, value, kv_index)           # in place; index -1 is skipped
    out = paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale)

Both are ``torch.library`` custom ops in the ``lorakit`` namespace: Triton kernels on CUDA, plain torch on
the CPU (one sequence at a time), fake kernels; ``ops/reference.py`` holds the float64 reference. On CUDA
no metadata value is read on the host and every grid is sized from shapes, so one CUDA graph replays
any batch of the same shapes.

The attention kernel follows the design of vLLM's Triton "unified attention". A program owns one query
block (BLOCK_Q tokens of one sequence) for one KV head: its BLOCK_M = BLOCK_Q * G rows are those tokens
times the G query heads that share the KV head, so GQA decode still feeds the tensor cores. It walks the
sequence's keys in tiles of TILE positions (looked up per key in the block table, so TILE is independent
of the cache's block size) from the sliding-window start of its first row to its last row, with an online
softmax in float32. Axis 0 of the grid holds T // BLOCK_Q + S + 1 programs, a bound on the number of
query blocks; each program finds its sequence by counting the sequence starts
``query_start[s] // BLOCK_Q + s`` at or before its index, programs past a sequence's rows return, and
the programs past sequence S - 1 write the padding rows' zeros. When the grid is small (decode with few
sequences) the keys are split over NUM_SEGMENTS programs per query block, which write float32 partials
(max, sum, unnormalized output) that a second kernel combines.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import (
    CPU_SMS, FLOAT_DTYPES, cdiv, check_shape, check_tensor, dot, host_checks_allowed, next_power_of_2, num_sms,
)

__all__ = ["paged_attention", "write_kv"]


# ---------------------------------------------------------------------------------------------- write_kv


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, index_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token; padding tokens (index -1) return at once.
    tok = tl.program_id(0).to(tl.int64)
    index = tl.load(index_ptr + tok)
    if index < 0:
        return
    block = index // BLOCK_SIZE
    offset = index % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + d, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + d, v, mask=mask)


def _launch_write_kv(k_cache, v_cache, key, value, kv_index) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, kv_index,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_power_of_2(num_heads), BLOCK_D=next_power_of_2(head_dim),
    )


def _check_cache(k_cache, v_cache) -> None:
    like = dict(device=k_cache.device, like="k_cache")
    check_tensor("k_cache", k_cache, dim=4, dtypes=FLOAT_DTYPES, unit_stride_dim=3, **like)
    check_tensor("v_cache", v_cache, dim=4, dtypes=(k_cache.dtype,), unit_stride_dim=3, **like)
    check_shape("v_cache", v_cache, k_cache.shape, "[num_blocks, block_size, num_kv_heads, head_dim] like k_cache")
    block_size = k_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"the caches' block_size (dimension 1 of k_cache {tuple(k_cache.shape)}) must be a power "
                         f"of two, got {block_size}")


def _check_write_kv_args(k_cache, v_cache, key, value, kv_index) -> None:
    _check_cache(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    like = dict(device=k_cache.device, like="k_cache")
    check_tensor("key", key, dim=3, dtypes=(k_cache.dtype,), unit_stride_dim=2, **like)
    check_tensor("value", value, dim=3, dtypes=(k_cache.dtype,), unit_stride_dim=2, **like)
    num_tokens = key.shape[0]
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim), "[T, num_kv_heads, head_dim] of the cache")
    check_shape("value", value, key.shape, "[T, num_kv_heads, head_dim] like key")
    check_tensor("kv_index", kv_index, dim=1, dtypes=(torch.int64,), unit_stride_dim=0, **like)
    check_shape("kv_index", kv_index, (num_tokens,), "one cache row per row of key")
    if not host_checks_allowed(kv_index) or num_tokens == 0:
        return
    lo, hi = int(kv_index.min()), int(kv_index.max())
    if lo < -1 or hi >= num_blocks * block_size:
        raise ValueError(f"kv_index must lie in [-1, num_blocks * block_size = {num_blocks * block_size}), "
                         f"got values in [{lo}, {hi}]")
    valid = kv_index[kv_index >= 0]
    if valid.unique().numel() != valid.numel():
        raise ValueError("kv_index must not name a cache row twice (two tokens would race for it)")


@torch.library.custom_op("lorakit::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kv_index: torch.Tensor) -> None:
    """Store each token's key and value in its row of the cache, in place.

    Semantics:
        for t: if kv_index[t] >= 0:
            b, o = divmod(kv_index[t], block_size)
            k_cache[b, o] = key[t]; v_cache[b, o] = value[t]          (k_cache, v_cache mutated)

    k_cache, v_cache: [num_blocks, block_size (a power of two), num_kv_heads, head_dim], float32/float16/
    bfloat16; key, value: [T, num_kv_heads, head_dim], the caches' dtype; kv_index: int64 [T], each token's
    row of the cache seen as [num_blocks * block_size, ...] (block * block_size + offset), -1 for padding
    tokens, no row twice.
    """
    _check_write_kv_args(k_cache, v_cache, key, value, kv_index)
    _write_kv_torch(k_cache, v_cache, key, value, kv_index)


@write_kv.register_kernel("cuda")
def _(k_cache, v_cache, key, value, kv_index):
    _check_write_kv_args(k_cache, v_cache, key, value, kv_index)
    _launch_write_kv(k_cache, v_cache, key, value, kv_index)


@write_kv.register_fake
def _(k_cache, v_cache, key, value, kv_index):
    return None


# ----------------------------------------------------------------------------------------- attention


@triton.jit
def _tanh(x):
    # From exp2 (no libdevice call, so the interpreter runs it too); saturates to +-1 where exp2 overflows.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _find_sequence(qs_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr, SEARCH: tl.constexpr):
    # The sequence s in [0, num_seqs] whose query blocks hold program pid: sequence s owns programs
    # [start(s), start(s + 1)) with start(s) = query_start[s] // BLOCK_Q + s, strictly increasing, so s is
    # the number of starts at or before pid, minus one. Vector loads: no chain of dependent reads.
    count = tl.zeros([SEARCH], dtype=tl.int32)
    for c in range(0, num_seqs + 1, SEARCH):
        idx = c + tl.arange(0, SEARCH)
        ok = idx <= num_seqs
        start = tl.load(qs_ptr + idx, mask=ok, other=0) // BLOCK_Q + idx
        count += (ok & (start <= pid)).to(tl.int32)
    return tl.sum(count, axis=0) - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, qs_ptr, part_acc_ptr, part_ml_ptr,
    scale, softcap, window, num_seqs, num_tokens, max_blocks,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_mw, stride_mt, stride_mh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    SEARCH: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_sequence(qs_ptr, pid, num_seqs, BLOCK_Q, SEARCH)
    q_start = tl.load(qs_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    head = kv_head * GROUP + offs_m % GROUP  # query head of each row
    if seq == num_seqs:
        # Programs past the last sequence cover rows query_start[S]..T-1 (padding) and write zeros; with
        # split KV the reduce kernel writes them.
        if NUM_SEGMENTS == 1:
            rows = q_start + (pid - q_start // BLOCK_Q - seq) * BLOCK_Q + offs_m // GROUP
            ok = (offs_m < BLOCK_Q * GROUP) & (rows < num_tokens)
            zeros = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :], zeros,
                     mask=ok[:, None] & d_ok[None, :])
        return
    q_end = tl.load(qs_ptr + seq + 1)
    n = q_end - q_start
    # Local block index, last block first: those see the most keys, so they start earliest.
    local = q_end // BLOCK_Q + seq - pid
    if local * BLOCK_Q >= n:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - n
    tok = local * BLOCK_Q + offs_m // GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < n)
    pos = context + tok  # the position of each row's token in its sequence
    rows = q_start + tok
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys of this block: [kv_lo, kv_hi), from the window start of its first row to its last row
    # (never past the block table, so entries beyond a sequence's blocks are never read).
    kv_hi = tl.minimum(context + tl.minimum(n, (local + 1) * BLOCK_Q), max_blocks * BLOCK_SIZE)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context + local * BLOCK_Q - window + 1, 0)
    tile_lo = kv_lo // TILE
    tile_hi = tl.cdiv(tl.maximum(kv_hi, 0), TILE)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
        tile_lo = tile_lo + segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, tile_hi)

    # Scores live in the log2 domain: exp2 is what the hardware computes.
    scale = tl.cast(scale, tl.float32)  # fp32 whatever the caller passed (Inductor may pass fp64)
    softcap = tl.cast(softcap, tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE)
    for i in range(0, tile_hi - tile_lo):  # from 0: Triton pipelines loops with a constant lower bound
        kpos = (tile_lo + i) * TILE + offs_n
        k_ok = (kpos >= kv_lo) & (kpos < kv_hi)
        block = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        offset = kpos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k_rows = k_ptr + block * stride_kb + offset * stride_ko + kv_head * stride_kh
        v_rows = v_ptr + block * stride_vb + offset * stride_vo + kv_head * stride_vh
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), tl.zeros([BLOCK_M, TILE], dtype=tl.float32), IEEE)
        if USE_SOFTCAP:
            s = (softcap * 1.4426950408889634) * _tanh(s * (scale / softcap))
        else:
            s = s * (scale * 1.4426950408889634)
        visible = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at zero
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees no key is zero
        tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Every segment writes max and sum for each of its rows, empty or not; the output only where
        # the sum is positive (the reduce reads nothing else).
        ml = part_ml_ptr + rows * stride_mt + head * stride_mh + segment
        tl.store(ml, m_i, mask=row_ok)
        tl.store(ml + stride_mw, l_i, mask=row_ok)
        part = part_acc_ptr + rows * stride_pt + head * stride_ph + segment * stride_ps
        tl.store(part[:, None] + offs_d[None, :], acc, mask=(row_ok & (l_i > 0))[:, None] & d_ok[None, :])


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, qs_ptr, num_seqs,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mw, stride_mt, stride_mh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    # One program per (row, query head): combine the segments' partial softmaxes; padding rows get zeros.
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    valid = offs_s * 0 + row < tl.load(qs_ptr + num_seqs)  # one flag per segment
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    ml = part_ml_ptr + row * stride_mt + head * stride_mh + offs_s
    m = tl.load(ml, mask=valid, other=float("-inf"))
    l = tl.load(ml + stride_mw, mask=valid, other=0.0)
    used = l > 0
    m_max = tl.max(tl.where(used, m, float("-inf")), axis=0)
    weight = tl.where(used, tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)), 0.0)
    total = tl.sum(l * weight, axis=0)
    part = part_acc_ptr + row * stride_pt + head * stride_ph + offs_s * stride_ps
    acc = tl.load(part[:, None] + offs_d[None, :], mask=used[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# Launch configurations by batch shape and element size. "decode": T <= S (shaped like a decode step, one
# new token per sequence); "prefill": the rest. Either is correct for any batch, only speed differs.
# BLOCK_M grows to the group size G where G is larger; head dims above 128 halve the prefill TILE. Each
# compiles for sm_90 without register spills (checked with ptxas).
ATTENTION_CONFIGS = {
    ("decode", 2): dict(BLOCK_M=16, TILE=64, num_warps=4, num_stages=3),
    ("decode", 4): dict(BLOCK_M=16, TILE=32, num_warps=8, num_stages=3),
    ("prefill", 2): dict(BLOCK_M=64, TILE=64, num_warps=8, num_stages=2),
    ("prefill", 4): dict(BLOCK_M=32, TILE=16, num_warps=8, num_stages=2),
}
# Split KV until the grid holds about this many programs per SM, in at most MAX_SEGMENTS segments.
PROGRAMS_PER_SM = 4
MAX_SEGMENTS = 32
# Sequence starts read per step of the program-to-sequence search (one step up to 1023 sequences).
SEARCH_CHUNK = 1024


def attention_config(num_tokens: int, num_seqs: int, dtype: torch.dtype, head_dim: int) -> dict:
    kind = "decode" if num_tokens <= num_seqs else "prefill"
    config = dict(ATTENTION_CONFIGS[kind, 4 if dtype == torch.float32 else 2])
    if kind == "prefill" and head_dim > 128:
        config["TILE"] = max(16, config["TILE"] // 2)
    return config


def num_kv_segments(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int, max_context: int,
                    tile: int, sms: int = CPU_SMS) -> int:
    """How many ways to split each query block's keys, from shapes only: only small grids are split."""
    busy = min(num_tokens, num_tokens // block_q + num_seqs) * num_kv_heads  # programs that can hold rows
    max_tiles = cdiv(max_context, tile)
    segments = 1
    while (segments < MAX_SEGMENTS and busy * segments * 2 <= PROGRAMS_PER_SM * sms
           and segments * 2 <= max_tiles):
        segments *= 2
    return segments


def _launch_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale: float,
                            softcap: float, sliding_window: int, config: dict | None = None,
                            num_segments: int | None = None) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    config = dict(config or attention_config(num_tokens, num_seqs, query.dtype, head_dim))
    block_m = max(config.pop("BLOCK_M"), next_power_of_2(group))
    block_q = block_m // group
    tile = config.pop("TILE")
    if num_segments is None:
        num_segments = num_kv_segments(num_tokens, num_seqs, num_kv_heads, block_q, max_blocks * block_size, tile,
                                       num_sms(query.device))
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    head_dim_pad = max(16, next_power_of_2(head_dim))
    if num_segments > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_segments, head_dim), dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((2, num_tokens, num_heads, num_segments), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # never touched
    grid = (num_tokens // block_q + num_seqs + 1, num_kv_heads, num_segments)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start, part_acc, part_ml,
        float(scale), float(softcap), int(sliding_window), num_seqs, num_tokens, max_blocks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=tile, NUM_SEGMENTS=num_segments,
        SEARCH=min(SEARCH_CHUNK, next_power_of_2(num_seqs + 1)),
        USE_SOFTCAP=softcap > 0, USE_WINDOW=sliding_window > 0, IEEE=query.dtype == torch.float32, **config,
    )
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, query_start, num_seqs,
            out.stride(0), out.stride(1), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SEGMENTS=num_segments,
        )
    return out


def _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap,
                          sliding_window) -> None:
    like = dict(device=query.device, like="query")
    check_tensor("query", query, dim=3, dtypes=FLOAT_DTYPES, unit_stride_dim=2, **like)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache, dim=4, dtypes=(query.dtype,), unit_stride_dim=3, **like)
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache must have head_dim {head_dim} (dimension 3) like query {tuple(query.shape)}, "
                         f"got shape {tuple(k_cache.shape)}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query's {num_heads} heads must be a multiple of the cache's num_kv_heads "
                         f"{num_kv_heads} (dimension 2 of k_cache)")
    check_tensor("seq_lens", seq_lens, dim=1, dtypes=(torch.int32,), unit_stride_dim=0, **like)
    num_seqs = seq_lens.shape[0]
    check_tensor("query_start", query_start, dim=1, dtypes=(torch.int32,), unit_stride_dim=0, **like)
    check_shape("query_start", query_start, (num_seqs + 1,), "[S + 1] for the S sequences of seq_lens")
    check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,), unit_stride_dim=1, **like)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have one row per sequence of seq_lens ({num_seqs}), "
                         f"got shape {tuple(block_tables.shape)}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    if not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0 (0 disables it), got {sliding_window!r}")
    if host_checks_allowed(query_start):
        _check_metadata_values(query_start, seq_lens, block_tables, num_tokens, block_size, num_blocks)


def _check_metadata_values(query_start, seq_lens, block_tables, num_tokens: int, block_size: int,
                           num_blocks: int) -> None:
    starts = query_start.tolist()
    if starts[0] != 0:
        raise ValueError(f"query_start[0] must be 0, got {starts[0]}")
    for s in range(len(starts) - 1):
        if starts[s + 1] < starts[s]:
            raise ValueError(f"query_start must be non-decreasing, got query_start[{s}:{s + 2}] = "
                             f"{starts[s:s + 2]}")
    if starts[-1] > num_tokens:
        raise ValueError(f"query_start[S] = {starts[-1]} must be at most query's T = {num_tokens} rows")
    if seq_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * block_size
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > capacity:
        raise ValueError(f"seq_lens must lie in [0, max_blocks * block_size = {capacity}] (the block tables' "
                         f"capacity), got values in [{lo}, {hi}]")
    needed = (seq_lens.long() + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < needed[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        s, j = bad.nonzero()[0].tolist()
        raise ValueError(f"block_tables[{s}, {j}] = {int(block_tables[s, j])} must name a cache block in "
                         f"[0, num_blocks = {num_blocks}) (sequence {s} holds {int(seq_lens[s])} positions)")


@torch.library.custom_op("lorakit::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, softcap: float = 0.0,
                    sliding_window: int = 0) -> torch.Tensor:
    """Causal attention of packed query rows over a paged KV cache (decode, prefill, chunked prefill).

    Semantics:
        out = zeros_like(query)
        for s: rows = query_start[s]:query_start[s + 1]; n = len(rows); L = seq_lens[s]
            for i, t in enumerate(rows): p = L - n + i                    (the new tokens are the last n)
                keys = [j for j in range(L) if j <= p and (sliding_window == 0 or j > p - sliding_window)]
                K[j], V[j] = cache[block_tables[s, j // block_size], j % block_size, h // G]  for j in keys
                x = scale * q[t, h] . K[j];  x = softcap * tanh(x / softcap) if softcap > 0
                out[t, h] = softmax_j(x) @ V    (float32; zero where keys is empty)

    query: [T, num_q_heads, head_dim] float32/float16/bfloat16, num_q_heads = G * num_kv_heads;
    k_cache, v_cache: [num_blocks, block_size (a power of two), num_kv_heads, head_dim], query's dtype;
    block_tables: int32 [S, max_blocks] (entries past a sequence's blocks are never read); seq_lens: int32
    [S], total length including the new tokens; query_start: int32 [S + 1], non-decreasing from 0 to at
    most T (rows past query_start[S] are padding and come out zero). Returns [T, num_q_heads, head_dim] in
    query's dtype. A sequence with no rows or seq_lens 0 contributes nothing.
    """
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap,
                          sliding_window)
    return _paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap,
                                  sliding_window)


@paged_attention.register_kernel("cuda")
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap=0.0, sliding_window=0):
    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap,
                          sliding_window)
    return _launch_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap,
                                   sliding_window)


@paged_attention.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale, softcap=0.0, sliding_window=0):
    return torch.empty_like(query)


# ------------------------------------------------------------------------------------------ CPU paths


def _write_kv_torch(k_cache, v_cache, key, value, kv_index) -> None:
    valid = kv_index >= 0
    index = kv_index[valid]
    block_size = k_cache.shape[1]
    blocks, offsets = index // block_size, index % block_size
    k_cache[blocks, offsets] = key[valid]
    v_cache[blocks, offsets] = value[valid]


def _paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start, scale: float,
                           softcap: float, sliding_window: int) -> torch.Tensor:
    """One sequence at a time: gather its blocks, mask by position, softmax in float32."""
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo or seq_len == 0:
            continue
        blocks = block_tables[s, : cdiv(seq_len, block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", query[lo:hi].float(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)[:, None]
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = key_pos <= pos
        if sliding_window > 0:
            visible &= key_pos > pos - sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # rows that see no key: zero
        out[lo:hi] = torch.einsum("hnl,lhd->nhd", probs, v).to(out.dtype)
    return out
