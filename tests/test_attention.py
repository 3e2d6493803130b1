"""write_kv and paged_attention against a float64 reference, on the CPU path and on the Triton kernels.

The Triton kernels run under the interpreter on a CPU (float32 and float16: the interpreter of triton 3.9
computes bfloat16 dots wrongly) and compiled on a GPU (all dtypes, real sizes: test_attention_gpu.py).
Every case shuffles the cache blocks, fills every cache row no sequence owns with NaN (free blocks and the tail
of each sequence's last block) and puts garbage in the block tables past each sequence's blocks: a kernel
that reads anything it should not returns NaN.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import AttnCase, attn_cases, check_attention, make_attn_case, run_triton, same_bits, triton_on_cpu
from lorakit.ops import attention as attention_mod
from lorakit.ops import paged_attention, write_kv
from lorakit.ops.attention import _launch_write_kv, num_kv_segments

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ------------------------------------------------------------------------------------------ CPU path


@given(case=attn_cases(ALL_DTYPES))
def test_cpu_path_matches_reference(case):
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    write_kv(k_cache, v_cache, case.key, case.value, case.kv_index)
    assert all(map(same_bits, (k_cache, v_cache), case.written())), "write_kv must write exactly the valid rows"
    check_attention(paged_attention(*case.attention_args(k_cache, v_cache)), case, "cpu path")


def test_cpu_path_gqa_heads_share_their_kv_head():
    """Query head h reads KV head h // G (as HF's repeat_kv): with G = 2, heads 0-1 -> 0, heads 2-3 -> 1."""
    case = make_attn_case([(3, 7)], block_size=4, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
                          seed=1)
    out = paged_attention(*case.attention_args())
    k, v = case.written()
    for h in range(4):
        one = replace(case, query=case.query[:, h:h + 1].contiguous())
        kv = h // 2
        single = paged_attention(*one.attention_args(k[:, :, kv:kv + 1].contiguous(), v[:, :, kv:kv + 1].contiguous()))
        torch.testing.assert_close(out[:, h:h + 1], single, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- Triton, interpreted


@triton_on_cpu
@settings(max_examples=20)
@given(case=attn_cases((torch.float32, torch.float16)))
def test_triton_kernels_match_reference_interpreted(case):
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    _launch_write_kv(k_cache, v_cache, case.key, case.value, case.kv_index)
    assert all(map(same_bits, (k_cache, v_cache), case.written())), "write_kv must write exactly the valid rows"
    # Both launch configurations (decode: BLOCK_M 16; prefill: 32 or 64) on any batch, unsplit and split.
    for kind, segments in (("decode", 1), ("prefill", 1), ("decode", 4)):
        check_attention(run_triton(case, kind, segments), case, f"{kind} config, {segments} segment(s)")


@triton_on_cpu
@pytest.mark.parametrize("segments", [1, 4])
def test_triton_long_prefill_with_context_interpreted(segments):
    """Sequences spanning many query blocks (last blocks first) over several KV tiles, window and softcap."""
    case = make_attn_case([(70, 90), (1, 33), (0, 5), (40, 40)], block_size=8, num_kv_heads=2, group=4, head_dim=32,
                          dtype=torch.float32, softcap=2.0, window=37, pad_rows=5, seed=3)
    check_attention(run_triton(case, "prefill", segments), case, f"{segments} segment(s)")


@triton_on_cpu
def test_triton_odd_head_dim_group_and_strided_query_interpreted():
    """head_dim 24 (padded to 32), G = 3 (BLOCK_M rows not a multiple of G), query a view of a fused qkv."""
    case = make_attn_case([(5, 12), (1, 20), (2, 2)], block_size=4, num_kv_heads=2, group=3, head_dim=24,
                          dtype=torch.float16, pad_rows=2, seed=4)
    qkv = torch.randn(case.query.shape[0], 6 + 2 * 2, 24, dtype=torch.float16)
    qkv[:, :6] = case.query
    case = replace(case, query=qkv[:, :6])
    assert not case.query.is_contiguous()
    for kind, segments in (("decode", 1), ("prefill", 2)):
        check_attention(run_triton(case, kind, segments), case, kind)


@triton_on_cpu
def test_triton_sequence_search_in_chunks_interpreted(monkeypatch):
    """More sequences than one search chunk holds: the program-to-sequence search loops over chunks."""
    monkeypatch.setattr(attention_mod, "SEARCH_CHUNK", 4)
    seqs = [(1, 3), (0, 0), (2, 9), (1, 1), (0, 4), (3, 5), (1, 17), (0, 0), (2, 2), (1, 6)]
    case = make_attn_case(seqs, block_size=4, num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32, pad_rows=3,
                          seed=5)
    for kind, segments in (("decode", 1), ("prefill", 2)):
        check_attention(run_triton(case, kind, segments), case, kind)


@triton_on_cpu
def test_triton_empty_batches_interpreted():
    """No sequence with rows (all padding), and T = 0."""
    case = make_attn_case([(0, 0), (0, 6)], block_size=4, num_kv_heads=1, group=2, head_dim=16, dtype=torch.float32,
                          pad_rows=5, seed=6)
    for segments in (1, 2):
        out = run_triton(case, None, segments)
        assert out.shape == (5, 2, 16) and (out == 0).all()
    empty = make_attn_case([(0, 3)], block_size=4, num_kv_heads=1, group=1, head_dim=16, dtype=torch.float32)
    assert run_triton(empty, None, None).shape == (0, 1, 16)


def test_split_only_small_grids():
    """The split is a function of shapes: decode with few sequences splits, large batches and prefill do not."""
    assert num_kv_segments(1, 1, 8, 4, 8192, 64) == 32
    assert num_kv_segments(16, 16, 8, 4, 8192, 64) == 4
    assert num_kv_segments(256, 256, 8, 4, 8192, 64) == 1
    assert num_kv_segments(4096, 2, 8, 16, 8192, 64) == 1
    assert num_kv_segments(1, 1, 8, 4, 64, 64) == 1  # a single tile cannot be split


# ------------------------------------------------------------------------------------------ write_kv


@st.composite
def write_cases(draw):
    num_blocks, block_size = draw(st.integers(1, 6)), draw(st.sampled_from((1, 4, 16)))
    num_tokens = draw(st.integers(0, 12))
    num_rows = num_blocks * block_size
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1 << 16)))
    index = torch.randperm(num_rows, generator=gen)[:num_tokens]
    index = torch.cat([index, torch.full((num_tokens - len(index),), -1)])
    index = torch.where(torch.rand(num_tokens, generator=gen) < 0.3, -1, index)
    index = index[torch.randperm(num_tokens, generator=gen)]
    heads, head_dim = draw(st.sampled_from((1, 3))), draw(st.sampled_from((8, 24)))
    dtype = draw(st.sampled_from((torch.float32, torch.float16)))
    cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)
    cache[0, 0] = float("nan")
    kv = torch.randn(2, num_tokens, heads, head_dim, generator=gen).to(dtype)
    return cache, kv[0], kv[1], index


def check_write(write, cache, key, value, kv_index) -> None:
    k_cache, v_cache = cache.clone(), -cache
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, row in enumerate(kv_index.tolist()):
        if row >= 0:
            want_k.view(-1, *key.shape[1:])[row] = key[t]
            want_v.view(-1, *key.shape[1:])[row] = value[t]
    write(k_cache, v_cache, key, value, kv_index)
    assert same_bits(k_cache, want_k) and same_bits(v_cache, want_v)


@given(args=write_cases())
def test_write_kv_writes_exactly_the_valid_rows(args):
    check_write(write_kv, *args)


@triton_on_cpu
@given(args=write_cases())
def test_write_kv_kernel_writes_exactly_the_valid_rows_interpreted(args):
    check_write(_launch_write_kv, *args)


# ---------------------------------------------------------------------- opcheck, compile, errors


def small_case(**kw) -> AttnCase:
    args = dict(block_size=4, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32, pad_rows=2, seed=7)
    args.update(kw)
    return make_attn_case([(3, 10), (1, 6), (0, 0), (2, 2)], **args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap, window", [(0.0, 0), (3.0, 4)])
def test_opcheck(device, softcap, window):
    case = replace(small_case(), softcap=softcap, window=window).to(device)
    torch.library.opcheck(torch.ops.lorakit.paged_attention.default, case.attention_args())
    k_cache, v_cache = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()  # opcheck compares with NaN != NaN
    torch.library.opcheck(torch.ops.lorakit.write_kv.default,
                          (k_cache, v_cache, case.key, case.value, case.kv_index))


def attention_step(k_cache, v_cache, query, key, value, kv_index, block_tables, seq_lens, query_start):
    """What an attention layer does per step: store the new keys and values, then attend."""
    write_kv(k_cache, v_cache, key, value, kv_index)
    out = paged_attention(query * 1.0, k_cache, v_cache, block_tables, seq_lens, query_start, 0.25, softcap=5.0)
    return out + 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_equals_eager_without_graph_breaks(device):
    torch._dynamo.reset()
    compiled = torch.compile(attention_step, fullgraph=True)
    for seed in range(2):
        case = small_case(seed=seed, dtype=torch.float32 if device == "cpu" else torch.bfloat16).to(device)
        k0, v0 = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()
        args = (case.query, case.key, case.value, case.kv_index, case.block_tables, case.seq_lens,
                case.query_start)
        k1, v1, k2, v2 = k0.clone(), v0.clone(), k0.clone(), v0.clone()
        eager, comp = attention_step(k1, v1, *args), compiled(k2, v2, *args)
        assert torch.equal(eager, comp) and torch.equal(k1, k2) and torch.equal(v1, v2)


def attention_call(case: AttnCase, **override):
    args = dict(zip(("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start", "scale", "softcap",
                     "sliding_window"), case.attention_args()))
    args.update(override)
    return paged_attention(**args)


def test_good_arguments_pass():
    attention_call(small_case())


@pytest.mark.parametrize(
    "override, message",
    [
        (lambda c: dict(query=c.query[None]), r"query must have 3 dimensions, got shape \(1, 8, 4, 16\)"),
        (lambda c: dict(query=c.query.long()), r"query must have dtype in .*got torch.int64"),
        (lambda c: dict(query=c.query.half()), r"k_cache must have dtype in \['torch.float16'\], got torch.float32"),
        (lambda c: dict(query=c.query.transpose(1, 2).contiguous().transpose(1, 2)),
         r"query must be contiguous in dimension 2"),
        (lambda c: dict(query=c.query[:, :3]), r"query's 3 heads must be a multiple of the cache's num_kv_heads 2"),
        (lambda c: dict(query=c.query[..., :8]), r"k_cache must have head_dim 8 \(dimension 3\) like query"),
        (lambda c: dict(v_cache=c.v_cache[:, :, :1]), r"v_cache must have shape \(8, 4, 2, 16\)"),
        (lambda c: dict(k_cache=c.k_cache[:, :3], v_cache=c.v_cache[:, :3]), r"block_size .* must be a power of two"),
        (lambda c: dict(seq_lens=c.seq_lens.long()), r"seq_lens must have dtype in \['torch.int32'\], got torch.int64"),
        (lambda c: dict(query_start=c.query_start[:-1]), r"query_start must have shape \(5,\) .*got \(4,\)"),
        (lambda c: dict(block_tables=c.block_tables[:3]), r"block_tables must have one row per sequence .*\(4\)"),
        (lambda c: dict(block_tables=c.block_tables.long()), r"block_tables must have dtype in \['torch.int32'\]"),
        (lambda c: dict(block_tables=c.block_tables.T.contiguous().T), r"block_tables must be contiguous in dim"),
        (lambda c: dict(scale=0.0), r"scale must be a positive finite number, got 0.0"),
        (lambda c: dict(softcap=-1.0), r"softcap must be a finite number >= 0"),
        (lambda c: dict(sliding_window=-2), r"sliding_window must be an int >= 0"),
        (lambda c: dict(query_start=torch.tensor([1, 3, 4, 4, 6], dtype=torch.int32)), r"query_start\[0\] must be 0"),
        (lambda c: dict(query_start=torch.tensor([0, 3, 2, 4, 6], dtype=torch.int32)),
         r"query_start must be non-decreasing, got query_start\[1:3\] = \[3, 2\]"),
        (lambda c: dict(query_start=torch.tensor([0, 3, 4, 4, 9], dtype=torch.int32)),
         r"query_start\[S\] = 9 must be at most query's T = 8 rows"),
        (lambda c: dict(seq_lens=torch.tensor([10, 6, 0, 99], dtype=torch.int32)),
         r"seq_lens must lie in \[0, max_blocks \* block_size = 16\].*\[0, 99\]"),
        (lambda c: dict(block_tables=torch.where(torch.arange(4)[None] == 0, 77, c.block_tables).int()),
         r"block_tables\[0, 0\] = 77 must name a cache block in \[0, num_blocks = 8\)"),
    ],
)
def test_bad_attention_arguments_name_the_problem(override, message):
    case = small_case()
    with pytest.raises((ValueError, TypeError), match=message):
        attention_call(case, **override(case))


@pytest.mark.parametrize(
    "override, message",
    [
        (lambda c: dict(key=c.key.half()), r"key must have dtype in \['torch.float32'\], got torch.float16"),
        (lambda c: dict(value=c.value[:, :1]), r"value must have shape \(8, 2, 16\)"),
        (lambda c: dict(key=c.key[:, :, :8], value=c.value[:, :, :8]), r"key must have shape \(8, 2, 16\)"),
        (lambda c: dict(kv_index=c.kv_index.int()), r"kv_index must have dtype in \['torch.int64'\]"),
        (lambda c: dict(kv_index=c.kv_index[:5]), r"kv_index must have shape \(8,\)"),
        (lambda c: dict(kv_index=torch.full((8,), 40)), r"kv_index must lie in \[-1, .* = 32\), got .*\[40, 40\]"),
        (lambda c: dict(kv_index=torch.tensor([1, 1, -1, -1, -1, -1, -1, -1])), r"must not name a cache row twice"),
        (lambda c: dict(v_cache=c.v_cache.half()), r"v_cache must have dtype in \['torch.float32'\]"),
    ],
)
def test_bad_write_kv_arguments_name_the_problem(override, message):
    case = small_case()
    args = dict(k_cache=case.k_cache.clone(), v_cache=case.v_cache.clone(), key=case.key, value=case.value,
                kv_index=case.kv_index)
    args.update(override(case))
    with pytest.raises((ValueError, TypeError), match=message):
        write_kv(**args)
