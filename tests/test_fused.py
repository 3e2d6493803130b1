"""The one-launch LoRA kernel (``ops/fused.py``) against the float64 reference, under the Triton interpreter.

On the CPU the interpreter runs the shrink and expand phases as two launches (its programs run one after another, so
a grid-wide barrier cannot be met); the one-launch form with its barrier runs on a GPU (test_ops_gpu.py).
"""

import os

import pytest
import torch
from hypothesis import given

from _lora_cases import cases, make_case
from helpers import check_y, rel_err, triton_on_cpu
from lorakit.ops import build_lora_meta
from lorakit.ops.fused import launch_fused


def run_fused(case, sms=None, block_m=None):
    meta = build_lora_meta(case.slots, case.A.shape[0], block_m)
    y = case.y.clone()
    launch_fused(list(torch.split(y, case.slice_sizes, dim=1)), case.x, case.A, case.B, case.ranks, case.scales,
                 meta.token_order, meta.tiles, meta.block_m, sms=sms)
    return y


@triton_on_cpu
@given(case=cases((torch.float32, torch.float16), tokens=(1, 2, 3, 7, 33), out_sizes=(1, 3, 24, 67, 300),
                  r_maxes=(1, 5, 16, 40, 130)))
def test_fused_kernel_matches_reference_interpreted(case):
    # 132 programs (an H100's SMs), 1 (every work item in one program) and 5 (items shared unevenly); prefill tiles
    for sms, block_m in ((132, None), (1, None), (5, 64)):
        check_y(run_fused(case, sms, block_m), case)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ranks_above_128_interpreted(dtype):
    case = make_case(7, 40, [300, 20], 150, 3, "some-base", dtype, seed=7, min_rank=129)
    for sms in (None, 1):
        check_y(run_fused(case, sms or 132), case)


@triton_on_cpu
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_applies_doras_rescale_interpreted(rows):
    """DoRA's per-column gain (and shift) in the expand phase, as lorakit::expand applies it."""
    from _lora_cases import TOLERANCE
    from lorakit.ops.reference import lora_ref

    case = make_case(9, 48, [40, 24], 16, 3, "some-base", torch.float32, seed=3)
    dora = torch.randn(3, rows, 64, generator=torch.Generator().manual_seed(1)) * 0.3
    meta = build_lora_meta(case.slots, 3)
    y = case.y.clone()
    launch_fused(list(torch.split(y, case.slice_sizes, dim=1)), case.x, case.A, case.B, case.ranks, case.scales,
                 meta.token_order, meta.tiles, meta.block_m, dora=dora)
    ref = lora_ref(case.y, case.x, case.A, case.B, case.ranks, case.scales, case.slots, case.slice_sizes, dora)
    assert rel_err(y, ref) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("direct", [False, True])
def test_add_lora_takes_the_one_launch_op_up_to_fused_max_tokens(direct, monkeypatch):
    """KernelOptions.fused_max_tokens routes add_lora through lorakit::fused (its torch path on the CPU, or the kernel
    under the interpreter), compiled without graph breaks; larger calls keep shrink + expand."""
    from lorakit.ops import KernelOptions, add_lora

    if direct and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on the CPU need TRITON_INTERPRET=1")
    case = make_case(6, 32, [24, 8], 8, 3, "some-base", torch.float32, seed=5)
    meta = build_lora_meta(case.slots, 3)
    options = KernelOptions(fused_max_tokens=8, direct_devices=frozenset({"cpu"} if direct else set()))
    seen = []
    real = torch.ops.lorakit.fused
    monkeypatch.setattr(torch.ops.lorakit, "fused", lambda *a: seen.append(1) or real(*a), raising=False)
    y = case.y.clone()
    add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes, options=options)
    check_y(y, case)
    assert seen == ([] if direct else [1])
    monkeypatch.undo()
    y = case.y.clone()
    fn = torch.compile(lambda y: add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes,
                                          options=KernelOptions(fused_max_tokens=8)), fullgraph=True)
    fn(y)
    check_y(y, case)
