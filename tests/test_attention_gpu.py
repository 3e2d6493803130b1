"""The attention kernels compiled on a GPU: every dtype, real sizes, NaN-poisoned memory, CUDA graphs.

Real sizes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, block 16) and Gemma-2's
(head_dim 256, sliding window, softcap). The reference is the float64 one of lorakit.ops.reference.
"""

import pytest
import torch
from hypothesis import given, settings

from helpers import (ATTENTION_TOLERANCE, AttnCase, attn_cases, check_attention, make_attn_case, poison_cuda_cache,
                     run_triton, same_bits)
from lorakit.ops import cdiv, paged_attention, write_kv
from lorakit.ops.reference import attention_ref

pytestmark = pytest.mark.gpu
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LLAMA = dict(block_size=16, num_kv_heads=8, group=4, head_dim=128)


def run_step(case: AttnCase) -> torch.Tensor:
    """write_kv then paged_attention through the registered ops; the written caches are checked bitwise."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    poison_cuda_cache()
    write_kv(k_cache, v_cache, case.key, case.value, case.kv_index)
    assert all(map(same_bits, (k_cache, v_cache), case.written())), "write_kv must write exactly the valid rows"
    return paged_attention(*case.attention_args(k_cache, v_cache))


@given(case=attn_cases(ALL_DTYPES, max_new=80, max_context=300))
@settings(deadline=None)  # examples: the profile's (gpu: 40)
def test_kernels_match_reference_on_gpu(case):
    case = case.to("cuda")
    check_attention(run_step(case), case, "registered op")
    for kind, segments in (("decode", 1), ("prefill", 1), ("decode", 4), ("prefill", 16)):
        poison_cuda_cache(64 << 20)
        check_attention(run_triton(case, kind, segments), case, f"{kind} config, {segments} segment(s)")


def lengths(batch: int, longest: int, seed: int) -> list[int]:
    """Decode lengths in [1, longest], the longest and a length-1 sequence always among them."""
    lens = torch.randint(1, longest + 1, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    lens[0] = longest
    if batch > 1:
        lens[-1] = 1
    return lens


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("batch, longest", [(1, 8192), (1, 300), (16, 8192),
                                            pytest.param(64, 4096, marks=pytest.mark.quick), (256, 8192)])
def test_decode_real_sizes(batch, longest, dtype):
    seqs = [(1, L) for L in lengths(batch, longest, seed=batch)]
    case = make_attn_case(seqs, **LLAMA, dtype=dtype, free_blocks=64, extra_cols=3, seed=batch, device="cuda")
    check_attention(run_step(case), case, f"decode batch {batch}")


PREFILL = [
    [(512, 512)],
    [(4096, 4096)],
    [(2048, 6144)],  # a chunk of prefill after 4096 tokens of context
    [(1024, 1024), (512, 3000), (4096, 4096), (700, 700)],
    [(333, 1357), (1, 8000)] + [(1, 100 + 37 * i) for i in range(62)],  # chunked prefill among 63 decodes
]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("seqs", PREFILL, ids=lambda s: f"{len(s)}seqs-{sum(n for n, _ in s)}tok")
def test_prefill_real_sizes(seqs, dtype):
    case = make_attn_case(seqs, **LLAMA, dtype=dtype, free_blocks=16, extra_cols=2, pad_rows=7, seed=len(seqs),
                          device="cuda")
    check_attention(run_step(case), case, "prefill")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma2_window_and_softcap(dtype):
    """Gemma-2 shapes: head_dim 256, 16 query / 8 KV heads, softcap 50, a 1024-key window inside the sequences."""
    seqs = [(1500, 3000), (1, 5000), (300, 300)]
    case = make_attn_case(seqs, block_size=16, num_kv_heads=8, group=2, head_dim=256, dtype=dtype, softcap=50.0,
                          window=1024, sharpness=3.0, pad_rows=3, seed=2, device="cuda")
    check_attention(run_step(case), case, "gemma-2 shaped")


def fixed_shape_case(seqs, num_tokens: int, num_seqs: int, max_blocks: int, num_blocks: int, seed: int) -> AttnCase:
    """A batch padded to fixed shapes: (0, 0) sequences, padding rows, a fixed block table width and pool."""
    seqs = seqs + [(0, 0)] * (num_seqs - len(seqs))
    need = [cdiv(L, 16) for _, L in seqs]
    return make_attn_case(seqs, **LLAMA, dtype=torch.bfloat16, pad_rows=num_tokens - sum(n for n, _ in seqs),
                          free_blocks=num_blocks - sum(need), extra_cols=max_blocks - max(need), garbage="free",
                          seed=seed, device="cuda")


GRAPH_SHAPES = {
    # (T, S): batches of those shapes, replayed from one graph
    (32, 32): [[(1, 1000)] * 20, [(1, 7), (1, 3000), (1, 1)], [(1, 16 * i + 3) for i in range(32)], []],
    (128, 128): [[(1, 3 * i + 1) for i in range(128)], [(1, 2000)] * 9],
    (256, 8): [[(200, 900), (1, 50), (40, 40)], [(256, 2000)], [(1, 1)] * 8, [(64, 64), (0, 77), (100, 1000)]],
}


@pytest.mark.parametrize("shape", list(GRAPH_SHAPES), ids=lambda s: f"T{s[0]}-S{s[1]}")
def test_cuda_graph_replays_with_changed_metadata(shape):
    """One capture of write_kv + paged_attention; every replay brings new query_start, seq_lens, block tables."""
    num_tokens, num_seqs = shape
    max_blocks, num_blocks = 192, 2600
    batches = [fixed_shape_case(seqs, num_tokens, num_seqs, max_blocks, num_blocks, seed=i)
               for i, seqs in enumerate(GRAPH_SHAPES[shape])]
    static = batches[0]
    static = AttnCase(*(v.clone() if isinstance(v, torch.Tensor) else v for v in vars(static).values()))
    out = {}

    def step():
        write_kv(static.k_cache, static.v_cache, static.key, static.value, static.kv_index)
        out["attn"] = paged_attention(static.query, static.k_cache, static.v_cache, static.block_tables,
                                      static.seq_lens, static.query_start, static.scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i, batch in enumerate(batches + batches[:1]):
        for name in ("query", "key", "value", "kv_index", "k_cache", "v_cache", "block_tables", "seq_lens",
                     "query_start"):
            getattr(static, name).copy_(getattr(batch, name))
        graph.replay()
        torch.cuda.synchronize()
        assert all(map(same_bits, (static.k_cache, static.v_cache), batch.written())), f"replay {i}: write_kv"
        check_attention(out["attn"], batch, f"replay {i}")


def test_split_and_unsplit_agree_at_long_context():
    """Batch 1 at 8192 keys: 32 segments (auto) against the unsplit kernel, both against the reference."""
    case = make_attn_case([(1, 8192)], **LLAMA, dtype=torch.bfloat16, seed=11, device="cuda")
    ref = attention_ref(*case.attention_args())
    for segments in (None, 1, 2, 32):
        out = run_triton(case, None, segments)
        err = (out.double() - ref).norm() / ref.norm()
        assert err <= ATTENTION_TOLERANCE[torch.bfloat16], f"{segments} segments: {err:.2e}"
