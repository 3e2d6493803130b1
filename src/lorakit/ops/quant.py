"""Linear layers over quantized base weights: ``y = x @ dequant(W).T + b`` computed from the quantized bytes.

    w8, scale = quantize_fp8(weight)                    # e4m3, one float32 scale per output channel
    y = fp8_linear(x, w8, scale, bias)                  # torch.ops.lorakit.fp8_linear

    packed, scale, zero = quantize_int4(weight, 128)    # 4 bits, asymmetric, one scale and zero per 128 inputs
    y = int4_linear(x, packed, scale, zero, 128, bias)  # torch.ops.lorakit.int4_linear

Both are weight-only: x stays in its dtype (bf16 on a GPU) and the weight is widened to it inside the kernel,
so the result is the dequantized base's up to float32 accumulation order, and a LoRA delta trained on the bf16
base lands on the same activations it was trained on (no activation quantization error to compound).

fp8: a Triton kernel on CUDA reads each fp8 weight tile once, widens it to x's dtype in registers and multiplies
on the tensor cores; the per-channel scale (and the bias) are applied in the epilogue, ``(x @ w.T) * scale``,
which is exact for a per-output-channel scale. On the CPU the same in torch (the weight widened to x's dtype).
int4: a Triton kernel on CUDA reads each packed byte once and puts its two codes into the tensor cores exact, the
scale and zero applied after each group's sum (every row of a decode step in one block, K split so that a layer of
4096 channels fills the GPU; a CUDA cores' form for one row is kept for the sweep), in GEMM tiles at 128 rows;
from 129 rows the weight is widened once and multiplied by cuBLAS (fp8: tiles at 128-256, widened from 257). One
layout on every device (``pack_int4_rows``); on the CPU the weight made in float32, one matmul.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lorakit.ops._checks import FLOAT_DTYPES, cdiv, check_tensor, dot, unobserved

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT4_GROUP_SIZES = (32, 64, 128, 256)  # a group's half fills the tensor cores' K of 16 at least


# --- fp8 ---------------------------------------------------------------------------------------------------------

@triton.jit
def _fp8_dot(x_rows, w_rows, m_mask, n_mask, k_lo, k_hi, F16: tl.constexpr, IEEE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if F16:
            acc = tl.dot(xt.to(tl.float16), tl.trans(wt.to(tl.float16)), acc)
        else:
            acc = dot(xt, tl.trans(wt.to(xt.dtype)), acc, IEEE)
    return acc


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # SPLIT_K > 1: axis 1 splits K, each program writes its float32 partial sums to ws [SPLIT_K, M, N] and
    # _split_k_reduce_kernel adds them in a fixed order (deterministic: no atomics), then scales.
    # Programs that share a column block of W run together (GROUP_M row blocks at a time), so W is read from
    # L2 once per group when M spans several row blocks; at decode (one row block) this is the plain order.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # W [N, K] as stored: K contiguous
    # F16: e4m3 widens to float16 in one instruction a pair (to bf16 it takes several: 1.2-1.7x slower on an
    # H200), and bf16 x converts to float16 exactly inside float16's range (8 mantissa bits fit in 11). A value of
    # x past that range (65504) becomes inf there: a tile whose sums are not all finite is computed again in x's
    # dtype, so it gets what bf16 gives (inf or NaN only where x itself has them).
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    acc = _fp8_dot(x_rows, w_rows, m_mask, n_mask, k_lo, k_hi, F16, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    if F16:
        if tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1)) > 0:
            acc = _fp8_dot(x_rows, w_rows, m_mask, n_mask, k_lo, k_hi, False, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_K > 1:
        ws_ptrs = ws_ptr + (tl.program_id(1) * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])
        return
    acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp8_rows_dot(x_rows, w_rows, m_mask, n_mask, K, F16: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # W's tile as the dot's left operand (K contiguous, as the tensor cores read it), x's rows transposed as its
    # right: acc [BLOCK_N, BLOCK_M], a column per row of x
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        wt = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if F16:
            acc = tl.dot(wt.to(tl.float16), tl.trans(xt.to(tl.float16)), acc)
        else:
            acc = dot(wt.to(xt.dtype), tl.trans(xt), acc, IEEE)
    return acc


@triton.jit
def _fp8_decode_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Decode (M <= BLOCK_M): a program per BLOCK_N output channels, every row of x, the whole of K, so each weight
    # byte is read once and no partial sums are written or added (one launch, the same sum every run). Narrow
    # column blocks give the many programs a small layer needs to fill the GPU without splitting K.
    # DOT: on the tensor cores (W's tile the left operand, x's rows padded to BLOCK_M >= 16); else (BLOCK_M = 1)
    # products and sums on the CUDA cores in float32, reduced once at the end.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if DOT:
        acc = _fp8_rows_dot(x_rows, w_rows, m_mask, n_mask, K, F16, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        if F16:  # as _fp8_linear_kernel: a sum past float16's range is computed again in x's dtype
            if tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1)) > 0:
                acc = _fp8_rows_dot(x_rows, w_rows, m_mask, n_mask, K, False, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        wide = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            wt = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
            wide += wt.to(tl.float32) * xt.to(tl.float32)[None, :]
        acc = tl.sum(wide, axis=1)[:, None]  # [BLOCK_N, 1]
    acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _split_k_reduce_kernel(ws_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_SCALE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    # y = sum over the splits of ws [SPLIT_K, M, N] (float32 partials), in order: the same sum every run (no atomics);
    # then the per-channel scale and the bias where given
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs_n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(ws_ptr + (split * M + row).to(tl.int64) * N + offs_n, mask=mask, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    tl.store(out, (w.to(tl.float32) * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# From QUANT_GEMM_ROWS (a decode of 128+ sequences, or a step with a prefill chunk in it) the kernels take 128-row
# GEMM tiles, each weight tile still widened in registers; from FP8_DEQUANT_ROWS the weight is widened once into a
# buffer of x's dtype (3 bytes moved an element) and multiplied by cuBLAS. Where the two cross, measured on an H100
# over an 8B layer's GEMMs (bench/results/quant_round4.md): fp8's tiles take 0.61x the widened path's time at 128
# rows, 0.86x at 256, 1.28x at 300 (a third block of rows); int4's 0.76x at 128, 1.07x at 200.
QUANT_GEMM_ROWS = 128
FP8_DEQUANT_ROWS = 257  # tiles while the rows fill at most two blocks


# The fastest config of each shape class and row range in a sweep on that GPU (bench_quant.py --sweep), as
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, SPLIT_K, kernel): "tiles" (_fp8_linear_kernel), "decode" (_fp8_decode_kernel on
# the tensor cores), "decode-fma" (the same on the CUDA cores, one row). Shape classes: "wide" gate_up (N >= 16384),
# "narrow" o and down (K >= 8192 or N <= 4096: few column blocks), "qkv" the rest; "down" narrows the narrow class at
# 17-64 rows. Row ranges: 1, up to 16, up to 64 (beyond: the tiled kernel at its 64-row tiles).
_FP8_TABLES = {
    # H200, 9175e9b's tree with both kernels (bench/results/bench_quant_sweep_9175e9b_h200.md)
    "H200": {("wide", 1): (1, 16, 256, 2, 1, "decode-fma"), ("qkv", 1): (1, 8, 512, 2, 1, "decode-fma"),
             ("wide", 16): (16, 64, 256, 4, 1, "tiles"), ("narrow", 16): (16, 64, 256, 4, 2, "tiles"),
             ("qkv", 16): (16, 64, 256, 4, 1, "tiles"), ("wide", 64): (64, 128, 128, 3, 1, "decode"),
             ("narrow", 64): (64, 32, 128, 4, 1, "decode"), ("down", 64): (64, 128, 128, 3, 4, "tiles"),
             ("qkv", 64): (64, 128, 128, 3, 4, "tiles")},
    # H100 80GB HBM3, f0972c5 with both kernels (bench/results/bench_quant_sweep_f0972c5_h100.md)
    "H100": {("wide", 1): (1, 16, 256, 2, 1, "decode-fma"), ("qkv", 1): (1, 8, 512, 2, 1, "decode-fma"),
             ("wide", 16): (16, 64, 256, 4, 1, "tiles"), ("narrow", 16): (16, 32, 512, 4, 1, "decode"),
             ("qkv", 16): (16, 64, 256, 4, 1, "tiles"), ("wide", 64): (64, 128, 128, 3, 1, "tiles"),
             ("narrow", 64): (64, 32, 128, 4, 1, "decode"), ("down", 64): (64, 128, 128, 3, 4, "tiles"),
             ("qkv", 64): (64, 32, 128, 3, 1, "decode")},
}


def fp8_config(m: int, n: int, k: int, gpu: str = "H200") -> dict:
    """The kernel and tiles for an [m, k] x [n, k] product (m < FP8_DEQUANT_ROWS): below QUANT_GEMM_ROWS, bound by
    reading W, ``gpu``'s sweep (``_FP8_TABLES``; a GPU not swept takes the H200's); from there GEMM tiles. The
    tensor cores' forms with the float16 dot."""
    if m >= QUANT_GEMM_ROWS:  # GEMM tiles: 128 x 256 for a wide layer, else 128 x 128 with K split in two
        block_n, split_k, stages = (256, 1, 3) if n >= 16384 else (128, 2, 4)
        return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, F16=True, SPLIT_K=split_k, num_warps=8,
                    num_stages=stages)
    table = _FP8_TABLES.get(gpu, _FP8_TABLES["H200"])
    shape = "wide" if n >= 16384 else "narrow" if k >= 8192 or n <= 4096 else "qkv"
    if m == 1:
        keys = [(shape, 1), (shape, 16)]
    elif m <= 16:
        keys = [(shape, 16)]
    else:
        keys = [("down", 64)] if shape == "narrow" and k >= 8192 else []
        keys.append((shape, 64))
    block_m, block_n, block_k, stages, split_k, kernel = next(
        (table[key] for key in keys if key in table), (64, 128, 128, 3, 1, "tiles"))
    if m > 64:  # 65-127 rows: the tiled kernel, 64-row tiles for a wide layer
        block_m, block_n, block_k, stages, split_k, kernel = (64, 128, 128, 3, 1, "tiles") if n >= 16384 else \
            (16, 64, 256, 3, 1, "tiles")
    if kernel == "tiles":
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, F16=True, SPLIT_K=split_k,
                    num_warps=4, num_stages=stages)
    return dict(KERNEL="decode", DOT=kernel == "decode", F16=kernel == "decode", BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=block_k, num_warps=4, num_stages=stages)


def gpu_class(device: torch.device) -> str:
    """The ``_FP8_TABLES`` key of a CUDA device: "H100", "H200", or its name."""
    return _gpu_class(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gpu_class(index: int) -> str:
    name = torch.cuda.get_device_name(index)
    return next((key for key in _FP8_TABLES if key in name), name)


def _check_fp8_args(x, weight, scale, bias) -> None:
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES, device=x.device, unit_stride_dim=1)
    check_tensor("weight", weight, dim=2, dtypes=(FP8,), device=x.device, unit_stride_dim=1)
    check_tensor("scale", scale, dim=1, dtypes=(torch.float32,), device=x.device, unit_stride_dim=0)
    if weight.shape[1] != x.shape[1] or scale.shape[0] != weight.shape[0]:
        raise ValueError(f"fp8_linear: x [M, K={x.shape[1]}] needs weight [N, K] and scale [N], got weight "
                         f"{tuple(weight.shape)} and scale {tuple(scale.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dim=1, dtypes=FLOAT_DTYPES, device=x.device, unit_stride_dim=0)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"fp8_linear: bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")


def _launch_fp8_linear(x, weight, scale, bias, config: dict | None = None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if m >= FP8_DEQUANT_ROWS and config is None and x.dtype != torch.float32:
        return torch.nn.functional.linear(x, _launch_fp8_dequant(weight, scale, x.dtype), bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    config = dict(config or fp8_config(m, n, k, gpu_class(x.device) if x.is_cuda else "H200"))
    config["F16"] = config.get("F16", False) and x.dtype != torch.float32  # float32: IEEE dots, exact
    kernel = config.pop("KERNEL", "tiles")
    if kernel == "decode":
        if m > config["BLOCK_M"] or (not config["DOT"] and config["BLOCK_M"] != 1):
            raise ValueError(f"fp8_linear: the decode kernel takes up to BLOCK_M rows (1 without DOT), got {m} "
                             f"rows and {config}")
        _fp8_decode_kernel[(cdiv(n, config["BLOCK_N"]),)](
            x, weight, scale, bias if bias is not None else scale, y,
            m, n, k,
            x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **config,
        )
        return y
    split_k = config.setdefault("SPLIT_K", 1)
    # the partials of a split K (a float32 tensor stands in, unread, when K is not split)
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else scale
    b = bias if bias is not None else scale
    grid = (cdiv(m, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]), split_k)
    _fp8_linear_kernel[grid](
        x, weight, scale, b, y, ws,
        m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **config,
    )
    if split_k > 1:
        _split_k_reduce_kernel[(m, cdiv(n, 1024))](ws, scale, b, y, m, n, y.stride(0), HAS_SCALE=True,
                                                   HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=1024)
    return y


def _launch_fp8_dequant(weight, scale, dtype) -> torch.Tensor:
    """weight * scale[:, None] in ``dtype``: one read of the fp8 weight, one write."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    _fp8_dequant_kernel[(cdiv(n, 32), cdiv(k, 256))](weight, scale, out, n, k, weight.stride(0), BLOCK_N=32,
                                                     BLOCK_K=256)
    return out


@torch.library.custom_op("lorakit::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (x @ weight.T) * scale + bias in x's dtype, float32 accumulation.

    x: [M, K] float32/float16/bfloat16; weight: [N, K] float8_e4m3fn; scale: float32 [N]; bias: [N] or None.
    """
    _check_fp8_args(x, weight, scale, bias)
    return _fp8_linear_torch(x, weight, scale, bias)


@_fp8_linear_op.register_kernel("cuda")
def _(x, weight, scale, bias=None):
    _check_fp8_args(x, weight, scale, bias)
    return _launch_fp8_linear(x, weight, scale, bias)


@_fp8_linear_op.register_fake
def _(x, weight, scale, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _fp8_linear_torch(x, weight, scale, bias) -> torch.Tensor:
    """The CPU path: the weight widened to x's dtype, one matmul, the scale after it (as the kernel applies it)."""
    y = (x @ weight.to(x.dtype).T).float() * scale
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.lorakit.fp8_linear`` over x of any leading shape [..., K]: [..., N]. An eager call on CUDA
    launches the kernel itself (the dispatcher costs tens of microseconds of host time per call)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x.is_cuda and unobserved(x2, weight, scale):
        y = _launch_fp8_linear(x2, weight, scale, bias)
    else:
        y = torch.ops.lorakit.fp8_linear(x2, weight, scale, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.no_grad()
def quantize_fp8(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], float32 scale [N]): each output channel scaled so its largest magnitude is 448.
    ``absmax``: each channel's largest magnitude if it is not the weight's own (a shard of a wider row)."""
    w = weight.float()
    absmax = w.abs().amax(dim=1) if absmax is None else absmax.float()
    scale = (absmax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    w8 = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8, scale


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (weight.float() * scale.float()[:, None]).to(dtype)


# --- int4 --------------------------------------------------------------------------------------------------------

def check_int4_shape(in_features: int, out_features: int, group_size: int) -> str | None:
    """Why a layer of this shape cannot hold an int4 weight (None: it can)."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} is not one of {list(INT4_GROUP_SIZES)}"
    if in_features % group_size:
        return f"in_features {in_features} does not divide by the group size {group_size}"
    return None


@torch.no_grad()
def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int32 [N, K] in 0..15, scale, zero float32 [K / group, N]): asymmetric per group of ``group_size``
    inputs, w = code * scale + zero (zero: the group's smallest weight; a group's channels contiguous)."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    codes = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
    return codes, scale.squeeze(-1).T.contiguous(), lo.squeeze(-1).T.contiguous()


def pack_int4_rows(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """The int4 layout (``codes``: int [N, K] in 0..15): uint8 [N, K / 2], K contiguous, a group's ``group_size / 2``
    bytes holding its first half's codes in their low four bits and its second half's in their high."""
    n, k = codes.shape
    halves = codes.reshape(n, k // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | halves[:, :, 1] << 4).to(torch.uint8).reshape(n, k // 2).contiguous()


def unpack_int4_rows(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """pack_int4_rows undone: int32 codes [N, K]."""
    n, half_k = packed.shape
    halves = packed.to(torch.int32).reshape(n, 2 * half_k // group_size, 1, group_size // 2)
    return torch.cat([halves & 0xF, halves >> 4], dim=2).reshape(n, 2 * half_k)


def quantize_int4(weight: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K / 2], scale, zero [K / group, N] in ``weight``'s dtype), on ``weight``'s device."""
    codes, scale, zero = int4_codes(weight, group_size)
    return pack_int4_rows(codes, group_size), scale.to(weight.dtype), zero.to(weight.dtype)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the int4 kernel multiplies by: code * scale + zero, in float32, then ``dtype``."""
    codes = unpack_int4_rows(packed, group_size).float()
    w = codes * scale.float().T.repeat_interleave(group_size, dim=1) + zero.float().T.repeat_interleave(group_size, 1)
    return w.to(dtype)


@triton.jit
def _int4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sg, stride_ym,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, MAGIC: tl.constexpr, DOT: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # y = x @ W.T with W[n, k] = code * scale[g, n] + zero[g, n], g = k // GROUP: a program per BLOCK_N output
    # channels and BLOCK_M rows, over the whole of K (or its SPLIT_K-th part: axis 2; float32 partials to
    # ws [SPLIT_K, M, N], added in order by _split_k_reduce_kernel), GROUPS groups a step. A group's GROUP / 2 bytes
    # hold its first half's codes in their low four bits and its second half's in their high (pack_int4_rows), so
    # each half is a plain [BLOCK_N, GROUP / 2] tile beside a contiguous half of x: no interleaving, each byte loaded
    # once.
    # DOT: the codes go into the tensor cores exact as MAGIC + code (the code ORed into the mantissa of MAGIC, a
    # power of two, read as a float: one bit operation where a conversion takes several); the scale and zero come
    # after each group's sum, so every product is exact and every sum float32:
    #   sum_k W[n, k] x[m, k] = scale * sum_k (MAGIC + code) x[m, k] + (zero - MAGIC * scale) * sum_k x[m, k]
    # Else (BLOCK_M = 1) on the CUDA cores: each weight made in float32 (the code through MAGIC 2^23, subtracted
    # back; then code * scale + zero), its product summed in place, one reduction at the end.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    HALF: tl.constexpr = GROUP // 2
    offs_h = tl.arange(0, HALF)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_h[None, :]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_h[None, :]
    bits: tl.constexpr = 0x4300 if MAGIC == 128 else 0x6400  # bfloat16 128.0, float16 1024.0
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    wide = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    # each split a whole number of steps (the host takes a GROUPS that divides K's groups)
    g_per = tl.cdiv(tl.cdiv(K // GROUP, SPLIT_K), GROUPS) * GROUPS
    g_lo = tl.program_id(2) * g_per
    g_hi = tl.minimum(g_lo + g_per, K // GROUP)
    for g0 in range(g_lo, g_hi, GROUPS):
        for i in tl.static_range(GROUPS):
            g = g0 + i
            packed = tl.load(w_rows + g * HALF, mask=n_mask[:, None], other=0)
            x_lo = tl.load(x_rows + g * GROUP, mask=m_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + g * GROUP + HALF, mask=m_mask[:, None], other=0.0)
            scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if DOT:  # (a constexpr is assigned once: bits is set above the unrolled steps)
                w_lo = ((packed & 0xF).to(tl.uint16) | bits).to(x_lo.dtype, bitcast=True)
                w_hi = ((packed >> 4).to(tl.uint16) | bits).to(x_lo.dtype, bitcast=True)
                part = tl.dot(w_lo, tl.trans(x_lo))  # [n, m]
                part = tl.dot(w_hi, tl.trans(x_hi), part)
                xsum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)  # [m]
                acc += part * scale[:, None] + (zero - MAGIC * scale)[:, None] * xsum[None, :]
            else:
                c_lo = ((packed & 0xF).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                c_hi = ((packed >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                wide += (c_lo * scale[:, None] + zero[:, None]) * x_lo.to(tl.float32)  # x's one row broadcast
                wide += (c_hi * scale[:, None] + zero[:, None]) * x_hi.to(tl.float32)
    if not DOT:
        acc += tl.sum(wide, axis=1)[:, None]
    if SPLIT_K > 1:
        ws_ptrs = ws_ptr + (tl.program_id(2) * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=n_mask[:, None] & m_mask[None, :])
        return
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _int4_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sg, GROUP: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    # a program per BLOCK_N channels and one group: W[n, k] = code * scale + zero, in out's dtype
    HALF: tl.constexpr = GROUP // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    offs_h = tl.arange(0, HALF)
    n_mask = offs_n < N
    packed = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + g * HALF + offs_h[None, :],
                     mask=n_mask[:, None], other=0)
    scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_n.to(tl.int64)[:, None] * K + g * GROUP + offs_h[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(out, ((packed & 0xF).to(tl.float32) * scale + zero).to(ty), mask=n_mask[:, None])
    tl.store(out + HALF, ((packed >> 4).to(tl.float32) * scale + zero).to(ty), mask=n_mask[:, None])


# Rows from which the int4 weight is widened once into a buffer of x's dtype and multiplied by cuBLAS (as fp8's
# FP8_DEQUANT_ROWS; from QUANT_GEMM_ROWS below that, the kernel in GEMM tiles).
INT4_DEQUANT_ROWS = 129  # tiles for one block of rows


def int4_config(m: int, n: int) -> dict:
    """The int4 kernel's tiles for ``m`` rows of an [m, k] x [n, k] product (m < INT4_DEQUANT_ROWS). Below
    QUANT_GEMM_ROWS, from a sweep on an H100 (bench/results/quant_round3.md; the H200 has as many SMs and takes the
    same): every row of up to 16 or 64 in one block on the tensor cores, so each weight byte is read once a block of
    rows, two groups a step, K split in four (two for a wide layer past one row, none at 17-64 rows) so a layer of
    4096 channels fills the GPU. From there GEMM tiles."""
    wide = n >= 16384
    if m >= QUANT_GEMM_ROWS:  # GEMM tiles, 128 x 128, one group a step, K split in two but for a wide layer
        return dict(BLOCK_M=128, BLOCK_N=128, GROUPS=1, DOT=True, SPLIT_K=1 if wide else 2, num_warps=8, num_stages=3)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, GROUPS=2, DOT=True, SPLIT_K=2 if wide and m > 1 else 4, num_warps=4,
                    num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=64, GROUPS=2, DOT=True, SPLIT_K=1 if wide else 4, num_warps=4, num_stages=3)


def _check_int4_args(x, weight, scale, zero, group_size, bias) -> None:
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES, device=x.device, unit_stride_dim=1)
    check_tensor("weight", weight, dim=2, dtypes=(torch.uint8,), device=x.device, unit_stride_dim=1)
    k, n = x.shape[1], weight.shape[0]
    if group_size not in INT4_GROUP_SIZES or k % group_size or weight.shape[1] * 2 != k:
        raise ValueError(f"int4_linear: x [M, K={k}] needs a group size in {list(INT4_GROUP_SIZES)} that divides K "
                         f"and weight [N, {k // 2}], got group size {group_size} and weight {tuple(weight.shape)}")
    for name, t in (("scale", scale), ("zero", zero)):
        check_tensor(name, t, dim=2, dtypes=FLOAT_DTYPES, device=x.device, unit_stride_dim=1)
        if t.shape != (k // group_size, n) or t.stride() != scale.stride():
            raise ValueError(f"int4_linear: {name} must be [K / group size, N] = [{k // group_size}, {n}] with "
                             f"scale's strides, got {tuple(t.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dim=1, dtypes=FLOAT_DTYPES, device=x.device, unit_stride_dim=0)
        if bias.shape[0] != n:
            raise ValueError(f"int4_linear: bias must have shape [{n}], got {tuple(bias.shape)}")


def _launch_int4_linear(x, weight, scale, zero, group_size, bias, config: dict | None = None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if config is None and (m >= INT4_DEQUANT_ROWS or x.dtype == torch.float32):
        return torch.nn.functional.linear(x, _launch_int4_dequant(weight, scale, zero, group_size, x.dtype), bias)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"int4_linear: the kernel takes x in float16 or bfloat16, got {x.dtype}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    config = dict(config or int4_config(m, n))
    if not config["DOT"] and config["BLOCK_M"] != 1:
        raise ValueError(f"int4_linear: the CUDA cores' form takes one row a program (BLOCK_M=1), got {config}")
    while (k // group_size) % config["GROUPS"]:  # a step's groups all inside K
        config["GROUPS"] //= 2
    split_k = config.setdefault("SPLIT_K", 1)
    # the partials of a split K (y stands in, unwritten, when K is not split)
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    b = bias if bias is not None else scale
    grid = (cdiv(n, config["BLOCK_N"]), cdiv(m, config["BLOCK_M"]), split_k)
    _int4_kernel[grid](x, weight, scale, zero, b, y, ws, m, n, k, x.stride(0), weight.stride(0), scale.stride(0),
                       y.stride(0), GROUP=group_size, MAGIC=128 if x.dtype == torch.bfloat16 else 1024,
                       HAS_BIAS=bias is not None, **config)
    if split_k > 1:  # the partials added in order, then the bias
        _split_k_reduce_kernel[(m, cdiv(n, 1024))](ws, ws, b, y, m, n, y.stride(0), HAS_SCALE=False,
                                                   HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=1024)
    return y


def _launch_int4_dequant(weight, scale, zero, group_size, dtype) -> torch.Tensor:
    n, k = weight.shape[0], weight.shape[1] * 2
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    _int4_dequant_kernel[(cdiv(n, 32), k // group_size)](weight, scale, zero, out, n, k, weight.stride(0),
                                                          scale.stride(0), GROUP=group_size, BLOCK_N=32)
    return out


@torch.library.custom_op("lorakit::int4_linear", mutates_args=())
def _int4_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias in x's dtype, float32 sums; W[n, k] = code * scale[g, n] + zero[g, n], g = k // group_size.

    x: [M, K] float32/float16/bfloat16; weight: uint8 [N, K / 2] (pack_int4_rows); scale, zero: [K / group_size, N]
    in x's dtype; bias: [N] or None.
    """
    _check_int4_args(x, weight, scale, zero, group_size, bias)
    return _int4_linear_torch(x, weight, scale, zero, group_size, bias)


@_int4_linear_op.register_kernel("cuda")
def _(x, weight, scale, zero, group_size, bias=None):
    _check_int4_args(x, weight, scale, zero, group_size, bias)
    return _launch_int4_linear(x, weight, scale, zero, group_size, bias)


@_int4_linear_op.register_fake
def _(x, weight, scale, zero, group_size, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _int4_linear_torch(x, weight, scale, zero, group_size, bias) -> torch.Tensor:
    """The CPU path: the weight made in float32 (as the kernel makes it), one float32 matmul."""
    y = x.float() @ dequantize_int4(weight, scale, zero, group_size).T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def int4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.lorakit.int4_linear`` over x of any leading shape [..., K]: [..., N]. An eager call on CUDA
    launches the kernel itself (as fp8_linear)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x.is_cuda and unobserved(x2, weight, scale, zero):
        y = _launch_int4_linear(x2, weight, scale, zero, group_size, bias)
    else:
        y = torch.ops.lorakit.int4_linear(x2, weight, scale, zero, group_size, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
