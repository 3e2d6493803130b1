"""The best public multi-LoRA kernel times on one H200: what ``bench_ops.py`` compares lorakit against.

Copied from /work/shared/perf-anchors-h200.md ("best public" table). Measured 2026-11-30 on one NVIDIA
H200 with torch 2.11 and triton 3.6: the released Triton LoRA kernels of vLLM 0.33.0 and SGLang 0.5.23
(``csgmv``, ``sgemm``, ``triton_v2``), the dense base GEMM and two naive PyTorch baselines. Each time is per
call, replayed from a CUDA graph rotating over independent copies of the problem (>= 256 MB in all) so
no call finds its data in the 60 MB L2. (That file does not say how the PEFT-style loop, which syncs with
the host, was timed.)

The problem: ``y[t] += scale * (x[t] @ A[s].T) @ B[s].T`` with ``s = slot[t]``, bf16, h_in = 4096, a pool of
max(L, 8) slots, every adapter at rank r. decode: T tokens spread over L adapters, shuffled; prefill:
T = 4096 tokens in L contiguous segments. Batch metadata is built outside the timed region.
floor_us = (x once + each used adapter's A and B once + y read and written) / 4270 GB/s (measured copy rate).
All times in microseconds.
"""

from __future__ import annotations

from typing import NamedTuple

H_IN = 4096
COPY_GBPS = 4270.0  # device-to-device copy rate measured in the same run (read + write bytes)


class Anchor(NamedTuple):
    mode: str           # "decode" or "prefill"
    T: int              # tokens in the batch
    L: int              # distinct adapters used by the batch
    r: int              # rank of every adapter
    h_out: int          # output features (h_in is always H_IN)
    best_us: float      # fastest public kernel pair
    which: str          # which implementation was fastest
    floor_us: float     # byte floor at COPY_GBPS
    base_gemm_us: float  # x @ W.T, the dense layer itself
    peft_loop_us: float  # PEFT-style loop: boolean mask per adapter, two matmuls, index put
    gather_bmm_us: float  # A[slots], B[slots] gathered per token, then two bmm


ANCHORS: tuple[Anchor, ...] = (
    #      mode        T     L    r  h_out   best  which                         floor   gemm     peft  gather
    Anchor('decode',      1,   1, 16,  4096,   9.0, 'vLLM 0.33',                 0.07,  13.2,    16.0,    16.0),
    Anchor('decode',     16,   1, 16,  4096,   8.5, 'vLLM 0.33',                 0.15,  14.3,    33.0,    29.0),
    Anchor('decode',     16,   8, 16,  4096,  10.0, 'SGLang 0.5.23 triton_v2',   0.58,  14.0,   133.0,    33.0),
    Anchor('decode',     16,  16, 16,  4096,  10.4, 'SGLang 0.5.23 triton_v2',   1.07,  14.1,   247.0,    38.0),
    Anchor('decode',     64,   1, 16,  4096,   9.3, 'vLLM 0.33',                 0.43,  12.8,    18.0,    37.0),
    Anchor('decode',     64,   8, 16,  4096,  10.8, 'SGLang 0.5.23 triton_v2',   0.86,  13.1,   191.0,    38.0),
    Anchor('decode',     64,  32, 16,  4096,  13.5, 'SGLang 0.5.23 triton_v2',   2.33,  12.9,  3430.0,    39.0),
    Anchor('decode',     64,  64, 16,  4096,  17.3, 'SGLang 0.5.23 triton_v2',   4.30,  13.0,  6823.0,    41.0),
    Anchor('decode',    256,   1, 16,  4096,  12.0, 'SGLang 0.5.23 triton_v2',   1.53,  17.4,    25.0,    73.0),
    Anchor('decode',    256,   8, 16,  4096,  12.4, 'SGLang 0.5.23 triton_v2',   1.97,  16.5,   133.0,    75.0),
    Anchor('decode',    256,  32, 16,  4096,  14.8, 'SGLang 0.5.23 triton_v2',   3.44,  17.3,  3522.0,    80.0),
    Anchor('decode',    256, 128, 16,  4096,  30.0, 'SGLang 0.5.23 triton_v2',   9.33,  19.2, 13110.0,    88.0),
    Anchor('prefill',  4096,   1, 16,  4096,  47.1, 'SGLang 0.5.23 triton_v2',  23.64, 185.0,   195.0,   898.0),
    Anchor('prefill',  4096,   8, 16,  4096,  47.6, 'SGLang 0.5.23 triton_v2',  24.07, 183.5,   283.0,   932.0),
    Anchor('decode',      1,   1, 64,  4096,   9.6, 'SGLang 0.5.23 triton_v2',   0.25,  13.7,    16.0,    18.0),
    Anchor('decode',     16,   1, 64,  4096,   9.8, 'vLLM 0.33',                 0.34,  14.2,    33.0,    53.0),
    Anchor('decode',     16,   8, 64,  4096,  12.0, 'SGLang 0.5.23 triton_v2',   2.06,  14.3,   135.0,    57.0),
    Anchor('decode',     16,  16, 64,  4096,  14.1, 'SGLang 0.5.23 triton_v2',   4.02,  14.3,  2486.0,    63.0),
    Anchor('decode',     64,   1, 64,  4096,  11.5, 'vLLM 0.33',                 0.61,  13.1,    18.0,    52.0),
    Anchor('decode',     64,   8, 64,  4096,  14.0, 'SGLang 0.5.23 triton_v2',   2.33,  13.0,   192.0,    54.0),
    Anchor('decode',     64,  32, 64,  4096,  21.3, 'SGLang 0.5.23 triton_v2',   8.23,  13.0,  3425.0,    61.0),
    Anchor('decode',     64,  64, 64,  4096,  30.9, 'SGLang 0.5.23 triton_v2',  16.09,  12.9,  6785.0,    66.0),
    Anchor('decode',    256,   1, 64,  4096,  19.1, 'SGLang 0.5.23 triton_v2',   1.72,  17.6,    26.0,   161.0),
    Anchor('decode',    256,   8, 64,  4096,  20.5, 'SGLang 0.5.23 triton_v2',   3.44,  18.9,   135.0,   165.0),
    Anchor('decode',    256,  32, 64,  4096,  23.1, 'SGLang 0.5.23 triton_v2',   9.33,  17.2,  3168.0,   173.0),
    Anchor('decode',    256, 128, 64,  4096,  51.2, 'SGLang 0.5.23 triton_v2',  32.91,  18.4, 13000.0,   195.0),
    Anchor('prefill',  4096,   1, 64,  4096,  54.5, 'SGLang 0.5.23 triton_v2',  23.82, 184.6,   195.0,  2144.0),
    Anchor('prefill',  4096,   8, 64,  4096,  56.4, 'SGLang 0.5.23 triton_v2',  25.54, 183.9,   286.0,  2218.0),
    Anchor('decode',      1,   1, 16, 14336,   9.2, 'SGLang 0.5.23 triton_v2',   0.15,  31.3,    16.0,    17.0),
    Anchor('decode',     16,   1, 16, 14336,   9.1, 'vLLM 0.33',                 0.38,  31.2,    34.0,    43.0),
    Anchor('decode',     16,   8, 16, 14336,  11.0, 'SGLang 0.5.23 triton_v2',   1.35,  31.5,   139.0,    47.0),
    Anchor('decode',     16,  16, 16, 14336,  12.0, 'SGLang 0.5.23 triton_v2',   2.46,  33.6,  1498.0,    52.0),
    Anchor('decode',     64,   1, 16, 14336,  10.2, 'vLLM 0.33',                 1.12,  34.3,    23.0,    55.0),
    Anchor('decode',     64,   8, 16, 14336,  12.0, 'SGLang 0.5.23 triton_v2',   2.09,  34.3,   196.0,    55.0),
    Anchor('decode',     64,  32, 16, 14336,  18.9, 'SGLang 0.5.23 triton_v2',   5.40,  34.6,  3295.0,    59.0),
    Anchor('decode',     64,  64, 16, 14336,  26.4, 'SGLang 0.5.23 triton_v2',   9.82,  34.7,  5974.0,    62.0),
    Anchor('decode',    256,   1, 16, 14336,  16.6, 'SGLang 0.5.23 triton_v2',   4.07,  44.4,    48.0,   149.0),
    Anchor('decode',    256,   8, 16, 14336,  17.0, 'SGLang 0.5.23 triton_v2',   5.04,  44.4,   156.0,   152.0),
    Anchor('decode',    256,  32, 16, 14336,  21.3, 'SGLang 0.5.23 triton_v2',   8.35,  44.8,  3194.0,   155.0),
    Anchor('decode',    256, 128, 16, 14336,  48.9, 'SGLang 0.5.23 triton_v2',  21.61,  44.3,  8796.0,   168.0),
    Anchor('prefill',  4096,   1, 16, 14336,  99.7, 'SGLang 0.5.23 triton_v2',  63.01, 668.4,   562.0,  1974.0),
    Anchor('prefill',  4096,   8, 16, 14336,  96.6, 'SGLang 0.5.23 triton_v2',  63.98, 657.4,   624.0,  2050.0),
    Anchor('decode',      1,   1, 64, 14336,   9.8, 'SGLang 0.5.23 triton_v2',   0.57,  31.1,    16.0,    20.0),
    Anchor('decode',     16,   1, 64, 14336,  10.5, 'vLLM 0.33',                 0.80,  31.4,    34.0,    80.0),
    Anchor('decode',     16,   8, 64, 14336,  15.3, 'SGLang 0.5.23 triton_v2',   4.67,  31.2,   140.0,    93.0),
    Anchor('decode',     16,  16, 64, 14336,  19.6, 'SGLang 0.5.23 triton_v2',   9.09,  31.1,  1080.0,   110.0),
    Anchor('decode',     64,   1, 64, 14336,  12.3, 'vLLM 0.33',                 1.53,  33.9,    23.0,   101.0),
    Anchor('decode',     64,   8, 64, 14336,  16.3, 'SGLang 0.5.23 triton_v2',   5.40,  33.8,   198.0,   106.0),
    Anchor('decode',     64,  32, 64, 14336,  30.9, 'SGLang 0.5.23 triton_v2',  18.66,  33.8,  2044.0,   119.0),
    Anchor('decode',     64,  64, 64, 14336,  49.9, 'SGLang 0.5.23 triton_v2',  36.35,  33.7,  3935.0,   130.0),
    Anchor('decode',    256,   1, 64, 14336,  21.9, 'SGLang 0.5.23 triton_v2',   4.48,  44.7,    47.0,   335.0),
    Anchor('decode',    256,   8, 64, 14336,  22.9, 'SGLang 0.5.23 triton_v2',   8.35,  44.3,   158.0,   345.0),
    Anchor('decode',    256,  32, 64, 14336,  34.6, 'SGLang 0.5.23 triton_v2',  21.61,  44.6,  2496.0,   361.0),
    Anchor('decode',    256, 128, 64, 14336,  94.3, 'SGLang 0.5.23 triton_v2',  74.66,  44.4,  8383.0,   409.0),
    Anchor('prefill',  4096,   1, 64, 14336, 116.6, 'SGLang 0.5.23 triton_v2',  63.42, 672.7,   560.0,  4898.0),
    Anchor('prefill',  4096,   8, 64, 14336, 127.1, 'SGLang 0.5.23 triton_v2',  67.29, 670.1,   624.0,  4980.0),
)
