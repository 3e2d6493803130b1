"""The Triton kernels compiled on a GPU: all dtypes, real sizes, poisoned memory, CUDA graphs."""

import pytest
import torch
from hypothesis import given, settings

from _lora_cases import TOLERANCE, cases, make_case, make_slots, rel_err
from lorakit.ops import add_lora, add_lora_delta, build_lora_meta, lora_delta, lora_shrink, wait_lora_delta
from lorakit.ops.reference import lora_ref_by_slot

from test_ops import check_h, check_y

pytestmark = pytest.mark.gpu
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def poison_cuda_cache(nbytes: int = 1 << 30) -> None:
    """Fill freed allocator blocks with NaN, so an output element a kernel forgets to write shows up."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


@given(case=cases(ALL_DTYPES))
@settings(max_examples=200)
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
    (256, 4096, [14336, 14336], 64, 32, "zipf", 1),
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


def layer_beside(case, W: torch.Tensor, meta) -> torch.Tensor:
    """What compiled LoraLinear does at small T: the delta on the side stream, the base GEMM beside it, the join."""
    delta = lora_delta(case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
    y = case.x @ W.T  # the base layer, long enough that the delta really runs beside it
    wait_lora_delta(delta, case.x, [y])
    return (y.float() + delta).to(y.dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens, in_features, sizes, r_max, num_slots, mapping, min_rank",
                         [r for r in REAL if r[0] <= 256])
def test_delta_beside_the_base_gemm(tokens, in_features, sizes, r_max, num_slots, mapping, min_rank, dtype):
    case = make_case(tokens, in_features, sizes, r_max, num_slots, mapping, dtype, seed=tokens, min_rank=min_rank)
    case = case.to("cuda")
    W = torch.randn(sum(sizes), in_features, device="cuda", dtype=dtype) / in_features ** 0.5
    poison_cuda_cache()
    meta = build_lora_meta(case.slots, num_slots)
    base = case.x @ W.T
    y = layer_beside(case, W, meta)
    ref = lora_ref_by_slot(base, case.x, case.A, case.B, case.ranks, case.scales, case.slots, case.slice_sizes)
    assert rel_err(y, ref) <= TOLERANCE[dtype]
    assert torch.equal(y[case.slots < 0], base[case.slots < 0])
    in_place = base.clone()
    add_lora(in_place, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
    # Beside a GEMM the shrink splits K differently (grids for a quarter of the SMs), so h, rounded to the dtype
    # for the expand's dot, may differ in its last bit: the two paths agree to the dtype's tolerance, not bitwise.
    differ = (y != in_place).float().mean().item()
    assert rel_err(y, in_place) <= TOLERANCE[dtype]
    print(f"{dtype} T={tokens}: {100 * differ:.3f} % of elements differ from add_lora's in-place rounding")


def test_delta_beside_survives_freed_inputs_and_graphs():
    """Inputs freed right after the call, memory reused at once, and the same in a CUDA graph: the side stream
    never reads a reused buffer or races its join."""
    case = make_case(64, 4096, [4096, 1024, 1024], 16, 8, "distinct", torch.bfloat16, seed=3).to("cuda")
    W = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) / 64
    meta = build_lora_meta(case.slots, 8)
    rest = list(vars(case).values())[1:]
    for seed in range(20):
        x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        expected = x @ W.T
        add_lora(expected, x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
        y = layer_beside(type(case)(x, *rest), W, meta)
        del x
        torch.full((1 << 24,), float("nan"), device="cuda")  # reuses whatever was freed
        assert rel_err(y, expected) <= TOLERANCE[torch.bfloat16], seed
    # graphs: capture two layers chained (the second reads the first's output), replay with new inputs
    x_in = case.x.clone()

    def two_layers():
        h = layer_beside(type(case)(x_in, *rest), W, meta)[:, :4096].contiguous()
        return layer_beside(type(case)(h, *rest), W, meta)

    graph, out = capture(two_layers)
    for seed in range(3):
        x_in.copy_(torch.randn(64, 4096, generator=torch.Generator().manual_seed(seed)).to(x_in))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two_layers()), f"graph replay {seed} differs from eager"


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_eager_join_beside_the_base_gemm(dtype):
    """The eager path (linear.OVERLAP_EAGER): the delta beside the GEMM, one add_delta launch for q, k and v."""
    case = make_case(64, 4096, [4096, 1024, 1024], 16, 8, "some-base", dtype, seed=5).to("cuda")
    W = torch.randn(6144, 4096, device="cuda", dtype=dtype) / 64
    meta = build_lora_meta(case.slots, 8)
    base = case.x @ W.T
    delta = lora_delta(case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
    ys = [y.contiguous() for y in torch.split(case.x @ W.T, case.slice_sizes, dim=1)]  # separate outputs, as q/k/v
    add_lora_delta(ys, delta, case.x)
    ref = lora_ref_by_slot(base, case.x, case.A, case.B, case.ranks, case.scales, case.slots, case.slice_sizes)
    assert rel_err(torch.cat(ys, dim=1), ref) <= TOLERANCE[dtype]
