"""The Triton kernels compiled on a GPU: all dtypes, real sizes, poisoned memory, CUDA graphs."""

import pytest
import torch
from hypothesis import given

from _lora_cases import TOLERANCE, cases, make_case, make_slots
from helpers import check_h, check_y, poison_cuda_cache, rel_err
from lorakit.ops import KernelOptions, add_lora, build_lora_meta, lora_shrink
from lorakit.ops.reference import lora_ref_by_slot

pytestmark = pytest.mark.gpu
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@given(case=cases(ALL_DTYPES))  # examples: the profile's (gpu: 40, about 40 s on the H200)
def test_kernels_match_reference_on_gpu(case):
    case = case.to("cuda")
    poison_cuda_cache(64 << 20)
    meta = build_lora_meta(case.slots, case.A.shape[0])
    check_h(lora_shrink(case.x, case.A, case.ranks, meta), case)
    y = case.y.clone()
    add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
    check_y(y, case)


REAL = [
    # tokens, in, slice widths, R_max, slots, mapping, min rank
    (1, 4096, [4096], 16, 8, "distinct", 16),
    (16, 4096, [4096, 1024, 1024], 64, 16, "distinct", 1),
    pytest.param(256, 4096, [14336, 14336], 64, 32, "zipf", 1, marks=pytest.mark.quick),
    (256, 4096, [4096], 128, 128, "distinct", 8),
    (77, 4096, [4096, 1024, 1024], 128, 8, "some-base", 0),
    (4096, 4096, [14336], 64, 8, "uniform", 64),
    (4096, 4096, [4096, 1024, 1024], 16, 4, "identical", 16),
    (64, 2048, [2048, 5632], 256, 4, "uniform", 100),  # ranks above 128 walk the rank in chunks
]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens, in_features, sizes, r_max, num_slots, mapping, min_rank", REAL)
def test_real_sizes(tokens, in_features, sizes, r_max, num_slots, mapping, min_rank, dtype):
    case = make_case(tokens, in_features, sizes, r_max, num_slots, mapping, dtype, seed=tokens, min_rank=min_rank)
    case = case.to("cuda")
    poison_cuda_cache()
    meta = build_lora_meta(case.slots, num_slots)
    y = case.y.clone()
    add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
    ref = lora_ref_by_slot(case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, case.slice_sizes)
    assert rel_err(y, ref) <= TOLERANCE[dtype]
    base = case.slots < 0
    assert torch.equal(y[base], case.y[base])


def capture(fn):
    """(a CUDA graph of fn, its output), after one warm-up call on a side stream (kernels compiled before capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.quick
def test_cuda_graph_builds_metadata_inside():
    """One capture, many mappings: the metadata build itself is captured (no host sync, fixed shapes), so a replay
    after the slots change in place groups the new mapping."""
    num_tokens, num_slots = 33, 5
    case = make_case(num_tokens, 128, [96], 16, num_slots, "uniform", torch.float16, seed=4).to("cuda")
    slots = case.slots.clone()
    y = case.y.clone()

    def step():
        add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, build_lora_meta(slots, num_slots))

    graph, _ = capture(step)
    gen = torch.Generator().manual_seed(1)
    for mapping in ("zipf", "some-base", "distinct", "identical", "all-base", "uniform"):
        slots.copy_(make_slots(mapping, num_tokens, num_slots, gen))
        y.copy_(case.y)
        graph.replay()
        ref = lora_ref_by_slot(case.y, case.x, case.A, case.B, case.ranks, case.scales, slots, case.slice_sizes)
        assert rel_err(y, ref) <= TOLERANCE[torch.float16], mapping


def test_rank_above_r_max_is_refused_in_debug_mode(monkeypatch):
    monkeypatch.setenv("LORAKIT_DEBUG", "1")
    case = make_case(4, 64, [32], 8, 2, "uniform", torch.bfloat16, seed=5).to("cuda")
    ranks = torch.full_like(case.ranks, 9)
    with pytest.raises(ValueError, match=r"ranks must lie in \[0, R_max=8\]"):
        add_lora(case.y.clone(), case.x, case.A, case.B, ranks, case.scales, build_lora_meta(case.slots, 2))


@pytest.mark.parametrize("tokens, in_features, sizes, r_max, num_slots, mapping, min_rank", REAL[:5])
def test_programmatic_dependent_launch_gives_the_same_bits(tokens, in_features, sizes, r_max, num_slots, mapping,
                                                            min_rank):
    """KernelOptions.pdl changes how the kernels launch, never what they compute: off, the default (the expand), and
    both kernels give the same bits, eagerly and replayed from a CUDA graph."""
    case = make_case(tokens, in_features, sizes, r_max, num_slots, mapping, torch.bfloat16, seed=tokens,
                     min_rank=min_rank).to("cuda")
    meta = build_lora_meta(case.slots, num_slots)
    outs = []
    for pdl in (frozenset(), frozenset({"expand"}), frozenset({"shrink", "expand"})):
        options = KernelOptions(pdl=pdl)
        y = case.y.clone()
        add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes, options=options)
        outs.append(y)
        g = case.y.clone()
        graph, _ = capture(lambda: add_lora(g, case.x, case.A, case.B, case.ranks, case.scales, meta,
                                            case.slice_sizes, options=options))
        g.copy_(case.y)
        graph.replay()
        torch.cuda.synchronize()
        outs.append(g)
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


FUSED = [  # decode-sized calls: tokens, in, slice widths, R_max, slots, mapping, min rank
    (1, 4096, [4096, 1024, 1024], 16, 8, "distinct", 16),
    pytest.param(64, 4096, [14336, 14336], 16, 8, "distinct", 16, marks=pytest.mark.quick),
    (64, 14336, [4096], 64, 32, "some-base", 1),
    (16, 4096, [4096], 128, 4, "zipf", 0),
]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens, in_features, sizes, r_max, num_slots, mapping, min_rank", FUSED)
def test_fused_one_launch_matches_reference_and_replays(tokens, in_features, sizes, r_max, num_slots, mapping,
                                                         min_rank, dtype):
    """lorakit::fused's one launch (a grid-wide barrier between shrink and expand): against the float64 reference,
    then 50 replays of a CUDA graph of 8 launches back to back (the barrier's counters reused) give the same bits."""
    from lorakit.ops.fused import launch_fused

    case = make_case(tokens, in_features, sizes, r_max, num_slots, mapping, dtype, seed=tokens, min_rank=min_rank)
    case = case.to("cuda")
    poison_cuda_cache()
    meta = build_lora_meta(case.slots, num_slots)

    def run(y):
        launch_fused(list(torch.split(y, sizes, dim=1)), case.x, case.A, case.B, case.ranks, case.scales,
                     meta.token_order, meta.tiles, meta.block_m, pdl=True)
        return y

    y = run(case.y.clone())
    ref = lora_ref_by_slot(case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, case.slice_sizes)
    assert rel_err(y, ref) <= TOLERANCE[dtype]
    base = case.slots < 0
    assert torch.equal(y[base], case.y[base])
    ys = [case.y.clone() for _ in range(8)]
    graph, _ = capture(lambda: [run(v) for v in ys])
    for _ in range(50):
        for v in ys:
            v.copy_(case.y)
        graph.replay()
    torch.cuda.synchronize()
    for v in ys:
        assert torch.equal(v, y)
