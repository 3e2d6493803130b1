"""shrink and expand against the float64 reference, on the CPU path and on the Triton kernels.

The Triton kernels run under the interpreter on a CPU (float32 and float16: the interpreter of
triton 3.9 computes bfloat16 dots wrongly) and compiled on a GPU (all dtypes, see test_ops_gpu.py).
"""

import pytest
import torch
from hypothesis import given

from _lora_cases import Case, cases, make_case
from helpers import check_h, check_y, triton_on_cpu
from lorakit.ops import KernelOptions, add_lora, build_lora_meta, lora_shrink
from lorakit.ops.expand import _launch_expand
from lorakit.ops.shrink import _launch_shrink

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@given(case=cases(ALL_DTYPES))
def test_ops_match_reference(case):
    meta = build_lora_meta(case.slots, case.A.shape[0])
    check_h(lora_shrink(case.x, case.A, case.ranks, meta), case)
    y = case.y.clone()
    add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes)
    check_y(y, case)


def run_triton(case: Case, split_k: int, block_m: int | None = None,
               sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two kernels launched directly: K split ``split_k`` ways, the expand's grid sized for ``sms`` SMs."""
    meta = build_lora_meta(case.slots.to(case.x.device), case.A.shape[0], block_m)
    h = _launch_shrink(case.x, case.A, case.ranks, meta.token_order, meta.tiles, meta.block_m, split_k)
    y = case.y.clone()
    _launch_expand(list(torch.split(y, case.slice_sizes, dim=1)), h, case.B, case.ranks, case.scales,
                   meta.token_order, meta.tiles, meta.block_m, sms=sms)
    return h, y


@triton_on_cpu
@given(case=cases((torch.float32, torch.float16), tokens=(1, 2, 3, 7, 33), out_sizes=(1, 3, 24, 67, 300),
                  r_maxes=(1, 5, 16, 40, 130)))
def test_triton_kernels_match_reference_interpreted(case):
    # block_m 64: the prefill tiles; one SM: each expand program walks every column block of its tile.
    for split_k, block_m, sms in ((1, None, None), (3, None, 1), (2, 64, None)):
        h, y = run_triton(case, split_k, block_m, sms)
        check_h(h, case)
        check_y(y, case)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_ranks_above_128_interpreted(dtype):
    """Ranks above 128 take the expand's chunked path; every column block in one program too."""
    case = make_case(7, 40, [300, 20], 150, 3, "some-base", dtype, seed=7, min_rank=129)
    for sms in (None, 1):
        h, y = run_triton(case, 2, sms=sms)
        check_h(h, case)
        check_y(y, case)


@triton_on_cpu
def test_eager_calls_launch_the_kernels_directly_unless_something_watches(monkeypatch):
    """Eager calls on a direct device (KernelOptions.direct_devices: CUDA; here the CPU too, interpreted) skip the
    dispatcher: the same checks and kernels, so the same results; under a dispatch mode, with gradients, or
    compiling, they go through torch.ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import lorakit.ops as ops

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func.overloadpacket)] = self.counts.get(str(func.overloadpacket), 0) + 1
            return func(*args, **(kwargs or {}))

    launches = []
    for name in ("_launch_shrink", "_launch_expand"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **k: launches.append(_name) or _real(*a, **k))
    case = make_case(7, 40, [24, 8], 16, 3, "some-base", torch.float32, seed=3)
    meta = build_lora_meta(case.slots, 3)

    def run(options=KernelOptions()):
        y = case.y.clone()
        add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes, options=options)
        return y

    via_op = run()  # the CPU isn't a direct device by default: torch.ops, the torch path
    assert launches == []
    direct = KernelOptions(direct_devices={"cuda", "cpu"})
    check_y(run(direct), case)
    assert launches == ["_launch_shrink", "_launch_expand"]
    with CountOps() as counter:
        assert torch.equal(run(direct), via_op)
    assert counter.counts["lorakit.shrink"] == counter.counts["lorakit.expand"] == 1
    with pytest.raises(ValueError, match="A must have shape"):  # the op's checks, before any launch
        add_lora(case.y.clone(), case.x, case.A[..., :-1], case.B, case.ranks, case.scales, meta, case.slice_sizes,
                 options=direct)
    assert launches == ["_launch_shrink", "_launch_expand"]


@pytest.mark.parametrize("direct", [False, pytest.param(True, marks=triton_on_cpu)], ids=["torch", "triton"])
def test_no_adapter_tokens_silences_every_lora_op(direct):
    """Inside ops.no_adapter_tokens() (the engine's steps of base tokens alone) the LoRA ops do nothing, on the torch
    path and on the kernels' launch path: add_lora leaves y as it was, even for adapter tokens (the caller's promise is
    what makes that right); the innermost call decides, other threads are not affected, and outside the ops compute
    again."""
    import threading

    from lorakit import ops

    options = KernelOptions(direct_devices={"cuda", "cpu"} if direct else {"cuda"})
    case = make_case(9, 40, [24, 8], 16, 3, "some-base", torch.float32, seed=5)
    meta = build_lora_meta(case.slots, 3)

    def run():
        y = case.y.clone()
        add_lora(y, case.x, case.A, case.B, case.ranks, case.scales, meta, case.slice_sizes, options=options)
        return y

    with ops.no_adapter_tokens():
        assert torch.equal(run(), case.y)
        with ops.no_adapter_tokens(False):  # another engine's step inside this one's forward
            check_y(run(), case)
        assert torch.equal(run(), case.y)
        got = []
        other = threading.Thread(target=lambda: got.append(run()))
        other.start()
        other.join()
        check_y(got[0], case)
    check_y(run(), case)
