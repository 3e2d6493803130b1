"""The LoRA delta beside the base layer: ``lorakit::delta`` runs shrink and expand on a side stream while the
base GEMM runs, ``lorakit::wait_delta`` joins the streams, and the add is plain torch (compiled: fused into the
kernel that reads the base output next).

    delta = torch.ops.lorakit.delta(x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, widths)
    ys = [base(x) for base in siblings]                     # the base GEMMs, on the current stream
    torch.ops.lorakit.wait_delta(delta, x, ys)
    ys = [(y.float() + d).to(y.dtype) for y, d in zip(ys, delta.split(widths, dim=1))]

In a decode step the LoRA kernels are latency-bound (a few microseconds of bytes, two dependent launches), and
the base GEMM of the same layer leaves SMs idle: at batch 64 of a Llama-3-8B layer most GEMMs run 64-100
tiles on 132 SMs. On CUDA the delta's two kernels go to a side stream (high priority) that waits for x; the
base GEMM runs meanwhile; wait_delta makes the current stream wait for the side stream. Captured in a CUDA graph
this is a fork and a join. Measured on an H200 (bench/results/profile_step_*): the side stream's kernels finish
within the base GEMMs of a Llama-3-8B layer at batch 64, but adding the delta in kernels of its own (seven per
layer) costs as much as it saves; compiled, the add rides in the kernels that already read the base outputs (the
rotary embedding, silu * up, the residual add), so LoraLinear takes this path inside torch.compile, and in eager
forwards captured into CUDA graphs (``linear.OVERLAP_EAGER``), joined by ``lorakit::add_delta``: one add launch per
group, 9 % off a decode step with 8 adapters at batch 64 (bench/results/profile_step_eager_6a9a337.md).

The delta is float32 [T, sum(widths)], written (not added) by the expand kernel, zeros on base tokens, so
``y + delta`` is rounded once, as in ``add_lora``'s in-place expand: on the CPU the two paths give the same bits;
on CUDA they agree to the dtype's tolerance (the delta's shrink splits K for a quarter of the SMs, and the in-place
kernel may fuse the multiply-add).
wait_delta takes x only to keep it alive until the join (the side stream reads it; a compiler that planned
memory by the current stream alone could otherwise reuse x's buffer after the base GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import MAX_SLICES, cdiv, check_shape, check_tensor, num_sms, slice_output
from lorakit.ops.expand import _expand_torch, _launch_expand
from lorakit.ops.shrink import _check_shrink_args, _launch_shrink, _shrink_torch, shrink_split_k

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
# Beside a GEMM the delta's grids are sized for this share of the SMs (1/4), not the whole device: the GEMM
# holds the rest, and grids sized to fill every SM only slow it down.
BESIDE_SM_SHARE = 4


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the LoRA deltas of ``device`` run on: one per device, highest priority, so its short kernels
    take SMs as soon as the base GEMM leaves any."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index, priority=torch.cuda.Stream.priority_range()[1])
    return _SIDE_STREAMS[index]


def _check_delta_args(x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, widths) -> None:
    _check_shrink_args(x, A, ranks, token_slot, token_order, tiles, block_m, 1)
    num_slots, n_slices, r_max, _ = A.shape
    if len(widths) != n_slices or not all(isinstance(w, int) and w > 0 for w in widths) or n_slices > MAX_SLICES:
        raise ValueError(f"widths must give one positive output width per slice of A ({n_slices}), got {widths}")
    check_tensor("B", B, dim=3, dtypes=(x.dtype,), device=x.device)
    check_shape("B", B, (num_slots, sum(widths), r_max), f"[S, sum of the slice widths {list(widths)}, R_max]")
    check_tensor("scales", scales, dim=2, dtypes=(torch.float32,), device=x.device)
    check_shape("scales", scales, (num_slots, n_slices), "[S, n_slices], one scale per slot and slice")


def _columns(delta: torch.Tensor, widths) -> list[torch.Tensor]:
    return list(torch.split(delta, list(widths), dim=1))


@torch.library.custom_op("lorakit::delta", mutates_args=())
def delta(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    token_slot: torch.Tensor,
    token_order: torch.Tensor,
    tiles: torch.Tensor,
    block_m: int,
    widths: list[int],
) -> torch.Tensor:
    """The LoRA delta of every slice, float32, on a side stream on CUDA (join it with ``wait_delta``).

    Semantics:
        delta = zeros(T, sum(widths), float32); cols(i) = slice i's columns
        for t, i: s = token_slot[t]; r = ranks[s, i]
            delta[t, cols(i)] = scales[s, i] * (x[t] @ A[s, i, :r].T) @ B[s, cols(i), :r].T   (zero where s == -1)

    x: [T, in]; A: [S, n_slices, R_max, in]; B: [S, sum(widths), R_max] (x's dtype, any strides);
    ranks int32 and scales float32 [S, n_slices]; token_slot, token_order, tiles, block_m: a LoraMeta.
    Shrink and expand compute as ``add_lora``'s, so ``y + delta`` rounded once is its result.
    """
    _check_delta_args(x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, widths)
    out = torch.zeros((x.shape[0], sum(widths)), dtype=torch.float32, device=x.device)
    split_k = shrink_split_k(x.shape[1], A.shape[1], A.shape[2], tiles.shape[1], block_m)
    h = _shrink_torch(x, A, ranks, token_slot, split_k)
    _expand_torch(_columns(out, widths), h, B, ranks, scales, token_slot)
    return out


@delta.register_kernel("cuda")
def _(x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, widths):
    _check_delta_args(x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, widths)
    sms = max(1, num_sms(x.device) // BESIDE_SM_SHARE)
    split_k = shrink_split_k(x.shape[1], A.shape[1], A.shape[2], tiles.shape[1], block_m, sms)
    side = side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        # Allocated on the side stream; freed by the caller after wait_delta has joined the streams, and the side
        # stream's next use of the block waits for that join (every delta starts by waiting for the caller).
        out = torch.empty((x.shape[0], sum(widths)), dtype=torch.float32, device=x.device)
        h = _launch_shrink(x, A, ranks, token_order, tiles, block_m, split_k)
        _launch_expand(_columns(out, widths), h, B, ranks, scales, token_order, tiles, block_m, store=True, sms=sms)
    return out


@delta.register_fake
def _(x, A, B, ranks, scales, token_slot, token_order, tiles, block_m, widths):
    return x.new_empty((x.shape[0], sum(widths)), dtype=torch.float32)


@torch.library.custom_op("lorakit::wait_delta", mutates_args=("delta",))
def wait_delta(delta: torch.Tensor, x: torch.Tensor, ys: list[torch.Tensor]) -> None:
    """Make the current stream wait for the side stream that computes ``delta`` (from ``lorakit::delta(x, ...)``),
    once the base outputs ``ys`` are launched.

    Computes nothing: it is declared to mutate delta so that every later read of delta (the add into the base
    outputs, which torch.compile fuses into the kernel that reads them next) is ordered after the wait, and it
    reads ys so that no compiler moves the wait before the base layers (which would serialize the two streams).
    x is held until here (see the module docstring)."""
    check_tensor("delta", delta, dim=2, dtypes=(torch.float32,), device=x.device)
    if delta.is_cuda:
        torch.cuda.current_stream(delta.device).wait_stream(side_stream(delta.device))


@wait_delta.register_fake
def _(delta, x, ys):
    return None


@triton.jit
def _add_delta_kernel(Y0, Y1, Y2, Y3, d_ptr, T, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3, stride_dt,
                      BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (row block, column block, slice): ys[slice][rows, cols] += delta[rows, lo + cols], float32, rounded once.
    pid_t, pid_n, slice_id = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    y_ptr, stride_yt, lo, size = slice_output(slice_id, Y0, Y1, Y2, Y3, N0, N1, N2, N3, SYT0, SYT1, SYT2, SYT3)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < T)[:, None] & (cols < size)[None, :]
    rows = rows.to(tl.int64)
    d = tl.load(d_ptr + rows[:, None] * stride_dt + lo + cols[None, :], mask=mask, other=0.0)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + d).to(y.dtype), mask=mask)


def _launch_add_delta(ys: list[torch.Tensor], delta: torch.Tensor) -> None:
    num_tokens = delta.shape[0]
    if num_tokens == 0:
        return
    pad = MAX_SLICES - len(ys)
    widths = [y.shape[1] for y in ys]
    block_t, block_n = 16, 256
    grid = (cdiv(num_tokens, block_t), cdiv(max(widths), block_n), len(ys))
    _add_delta_kernel[grid](*ys, *[ys[0]] * pad, delta, num_tokens, *widths, *[0] * pad,
                            *[y.stride(0) for y in ys], *[0] * pad, delta.stride(0), BLOCK_T=block_t, BLOCK_N=block_n,
                            num_warps=4)


def _check_add_args(ys, delta, x) -> None:
    if not isinstance(ys, (list, tuple)) or not 1 <= len(ys) <= MAX_SLICES:
        raise ValueError(f"ys must be a list of 1 to {MAX_SLICES} outputs (one per slice), got {ys!r:.100}")
    check_tensor("delta", delta, dim=2, dtypes=(torch.float32,), device=x.device, unit_stride_dim=1)
    for i, y in enumerate(ys):
        check_tensor(f"ys[{i}]", y, dim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16), device=x.device,
                     unit_stride_dim=1)
        if y.shape[0] != delta.shape[0]:
            raise ValueError(f"ys[{i}] must have the delta's {delta.shape[0]} rows, got shape {tuple(y.shape)}")
    if sum(y.shape[1] for y in ys) != delta.shape[1]:
        raise ValueError(f"the outputs' widths {[y.shape[1] for y in ys]} must add up to the delta's "
                         f"{delta.shape[1]} columns")


@torch.library.custom_op("lorakit::add_delta", mutates_args=("ys",))
def add_delta(ys: list[torch.Tensor], delta: torch.Tensor, x: torch.Tensor) -> None:
    """Eager forwards' join: wait for the side stream's ``delta = lorakit::delta(x, ...)``, then ys[i] += its slice
    i (float32, rounded once), every slice in one launch on CUDA. Compiled forwards use ``wait_delta`` and let the
    add ride in the next kernel instead."""
    _check_add_args(ys, delta, x)
    for y, d in zip(ys, _columns(delta, [y.shape[1] for y in ys])):
        y.add_(d)


@add_delta.register_kernel("cuda")
def _(ys, delta, x):
    _check_add_args(ys, delta, x)
    torch.cuda.current_stream(delta.device).wait_stream(side_stream(delta.device))
    _launch_add_delta(list(ys), delta)


@add_delta.register_fake
def _(ys, delta, x):
    return None
