"""What the op files share: argument checks (each error names the argument, its value and what was expected),
the gate for checks that read values on the host, one Triton dot, and integer rounding."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Sequence

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SLICES = 4
# The SM count sizes the grids (split-K, column groups, attention segments) and never affects results. On a
# CPU (the Triton interpreter) grids are sized as for an H100 / H200; launchers take an ``sms`` to size them for
# fewer.
CPU_SMS = 132


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (CPU_SMS on a CPU)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_SMS


@functools.cache
def _pdl_supported(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and torch.cuda.get_device_capability(index)[0] >= 9)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with programmatic dependent launch (see ``KernelOptions.pdl``):
    compiled for a CUDA device of compute capability 9 or more, by a Triton with ``launch_pdl``."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


_STATE = threading.local()  # no_adapter_tokens' switch, per thread (an engine steps on its own thread)


@contextlib.contextmanager
def no_adapter_tokens(on: bool = True) -> Iterator[None]:
    """Inside (``on``), the caller promises that no token of the LoRA ops it runs uses an adapter (every slot is
    -1), so the ops launch and compute nothing: ``expand`` adds nothing, ``shrink``'s partials are left unwritten
    (expand ignores them). The engine runs (and captures the graphs of) its steps without adapter tokens inside it,
    so base-model traffic pays no LoRA kernels. The ops read it when they run, not when they are traced: one
    compiled forward serves both. It holds for the calling thread, and the innermost call decides (``on=False``
    inside turns the ops back on: another engine stepping inside this one's forward)."""
    before = getattr(_STATE, "skip", False)
    _STATE.skip = bool(on)
    try:
        yield
    finally:
        _STATE.skip = before


def adapter_tokens_skipped() -> bool:
    """True inside ``no_adapter_tokens()`` on this thread: the LoRA ops do nothing."""
    return getattr(_STATE, "skip", False)


def cdiv(n: int, d: int) -> int:
    """n / d rounded up."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """The least power of two that is >= n (>= 1)."""
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is >= n."""
    return cdiv(n, multiple) * multiple


def unobserved(*tensors: torch.Tensor) -> bool:
    """Whether nothing needs to see an op called on ``tensors`` (not compiling; no dispatch or function mode:
    tracing, fake tensors, op counters; plain tensors that need no gradient), so an eager call may launch its kernel
    itself and skip the dispatcher, which costs 35-50 us of host time per op on an H200 (bench/NOTES.md, host
    time)."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and all(type(t) is torch.Tensor and not t.requires_grad for t in tensors))


def host_checks_allowed(t: torch.Tensor) -> bool:
    """Value checks read tensors on the host: always on the CPU, on CUDA (a sync) only with LORAKIT_DEBUG=1;
    never while compiling or capturing a CUDA graph."""
    if torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return t.device.type == "cpu" or os.environ.get("LORAKIT_DEBUG", "0") == "1"


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, float32 accumulation: IEEE-exact for float32 inputs, else on the tensor cores in b's dtype."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b, acc)


@triton.jit
def slice_output(slice_id, Y0, Y1, Y2, Y3, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3):
    """Slice ``slice_id``'s output: (pointer, row stride, its first column among the slices, its width). At most
    four slices, passed as scalars (no device tensor of pointers)."""
    y_ptr = Y0
    stride_yt = SYT0
    lo = 0
    size = N0
    if slice_id >= 1:
        y_ptr = Y1
        stride_yt = SYT1
        lo += N0
        size = N1
    if slice_id >= 2:
        y_ptr = Y2
        stride_yt = SYT2
        lo += N1
        size = N2
    if slice_id >= 3:
        y_ptr = Y3
        stride_yt = SYT3
        lo += N2
        size = N3
    return y_ptr, stride_yt, lo, size


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    like: str = "x",
    unit_stride_dim: int | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like {like}, got {t.device}")
    if unit_stride_dim is not None and t.shape[unit_stride_dim] > 1 and t.stride(unit_stride_dim) != 1:
        raise ValueError(
            f"{name} must be contiguous in dimension {unit_stride_dim}, got strides {t.stride()} "
            f"for shape {tuple(t.shape)}; pass {name}.contiguous()"
        )


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], meaning: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({meaning}), got {tuple(t.shape)}")


def check_meta(token_slot: torch.Tensor, token_order: torch.Tensor, tiles: torch.Tensor, num_tokens: int,
               device: torch.device) -> None:
    check_tensor("token_slot", token_slot, dim=1, dtypes=(torch.int32,), device=device, unit_stride_dim=0)
    check_tensor("token_order", token_order, dim=1, dtypes=(torch.int32,), device=device, unit_stride_dim=0)
    check_tensor("tiles", tiles, dim=2, dtypes=(torch.int32,), device=device, unit_stride_dim=1)
    check_shape("token_slot", token_slot, (num_tokens,), "one slot per token of x")
    check_shape("token_order", token_order, (num_tokens,), "one index per token of x")
    if tiles.shape[0] != 3:
        raise ValueError(f"tiles must have shape [3, n_tiles] (slot, start, end), got {tuple(tiles.shape)}")


def check_ranks(ranks: torch.Tensor, r_max: int) -> None:
    """ranks[s, i] must lie in [0, R_max] (read on the host: see host_checks_allowed)."""
    if not host_checks_allowed(ranks):
        return
    lo, hi = int(ranks.min()), int(ranks.max())
    if lo < 0 or hi > r_max:
        raise ValueError(f"ranks must lie in [0, R_max={r_max}], got values in [{lo}, {hi}]")


def check_block_m(block_m: int) -> None:
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be one of 16, 32, 64, 128 (from LoraMeta), got {block_m}")
