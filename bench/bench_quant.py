"""Quantized bases: the fp8 and int4 GEMMs at Llama-3-8B's shapes, the engine's decode on bf16, fp8 and int4 bases,
and a Llama-3-70B-shaped fp8 model with 8 adapters on one GPU.

1. Kernels: y = x @ W.T for each projection shape of Llama-3-8B (q/k/v and gate/up fused, as the engine runs them)
   at M = 1 .. 2048 rows: bf16 cuBLAS (F.linear), lorakit's fp8 kernel (weight-only), torch._scaled_mm (fp8 x fp8,
   row-wise scales: the tensor cores' fp8 path, activations pre-quantized, as a ceiling), torch's int4 tinygemm
   and lorakit's int4 kernel. Weight
   bytes / time against the copy bandwidth measured in the same run. ``--sweep`` also times the fp8 kernel's decode
   tiles (M <= 64, split-K included) over a list of configs and reports the best, to set ``fp8_config``.
2. Engine: Llama-3-8B shape, random weights, compiled decode graphs (``--no-compile``: plain graphs), base and 8
   rank-16 adapters on all 7 projections, batch 1 and 64; each scheme in an engine of its own, its tok/s against
   bf16's in the same run. Byte floor per step: the weights as stored + KV + the adapters, / copy bandwidth.
3. 70B: 80 layers, hidden 8192, MLP 28672, 64 heads, 8 KV heads, random fp8 weights made layer by layer on the GPU
   (no bf16 copy ever exists), 8 adapters: memory, and decode tok/s at batch 1 and 64 from CUDA graphs.

    PYTHONPATH=src python bench/bench_quant.py --out DIR [--sweep] [--no-compile] [--skip-70b] [--kernels-only | --skip-kernels]
    PYTHONPATH=src python bench/bench_quant.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
import triton
import triton.language as tl
from bench_engine import run_engine, weight_bytes  # bench/ is on sys.path when this file runs as a script
from common import (arg_parser, copy_gbps, fmt, make_model, parse_args, rotating_us, setup, setup_line, table,
                    write_adapter, write_report)

from lorakit.engine import Engine
from lorakit.layers.quant import Fp8Linear, Int4Linear, quantize
from lorakit.ops.quant import (QUANT_GEMM_ROWS, _launch_fp8_dequant, _launch_fp8_linear, _launch_int4_dequant,
                               _launch_int4_linear, int4_codes, quantize_fp8, quantize_int4)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 16, 64, 128, 256, 2048)
KERNELS = ("bf16", "fp8", "scaled_mm", "int4", "int4 triton", "fp8 widened", "int4 widened")  # the columns (widened:
# from QUANT_GEMM_ROWS rows only)
PROMPT, DECODE = 128, 64
LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8)


@triton.jit
def _read_kernel(src_ptr, out_ptr, numel, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # each program reads STEPS blocks of int32 words and writes one word: a read of the bytes and nothing else
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for step in tl.static_range(STEPS):
        offs = base + step * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < numel, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def read_us(nbytes: int) -> float:
    """A read of ``nbytes`` in one launch, timed as the kernels are (rotating copies in a CUDA graph): the floor of
    a GEMM bound by reading its weight at this size, launch and ramp included (the copy bandwidth is measured on
    GiBs, where they vanish)."""
    numel = nbytes // 4
    times = []
    for block, steps in ((1024, 4), (2048, 8)):  # the faster of two shapes
        grid = (-(-numel // (block * steps)),)

        def make(i, grid=grid):
            return dict(src=torch.ones(numel, dtype=torch.int32, device="cuda"),
                        out=torch.empty(grid[0], dtype=torch.int32, device="cuda"))

        times.append(rotating_us(lambda c, grid=grid, block=block, steps=steps: _read_kernel[grid](
            c["src"], c["out"], numel, BLOCK=block, STEPS=steps, num_warps=4), make)[0])
    return min(times)


def tinygemm_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's tinygemm layout of w's int4 codes (lorakit's before 50's round 2): (packed, scales_zeros [K / 128, N,
    2]), w = (code - 8) * scale + zero_tg."""
    codes, scale, zero = int4_codes(w, 128)
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # two codes a byte, the even one high
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
    return packed, torch.stack([scale, zero + 8 * scale], dim=-1).to(w.dtype).contiguous()


def kernel_rows(gbps: float, sweep: bool, rows_m=ROWS, libraries: bool = False, sweep_int4: bool = False,
                sweep_rows=None) -> tuple[list[dict], list[dict]]:
    rows, best = [], []
    for label, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        w8, scale = quantize_fp8(w)
        packed, sz = tinygemm_int4(w)
        q4, s4, z4 = quantize_int4(w, 128)
        weights = dict(w=w, w8=w8, scale=scale, w8t=w8.T, ws=scale[None, :], packed=packed, sz=sz,
                       q4=q4, s4=s4, z4=z4)
        floors = dict(read_fp8_us=read_us(n * k), read_int4_us=read_us(n * k // 2 + 4 * n * (k // 128)))
        for m in rows_m:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            x8, xs = quantize_fp8(x)
            master = dict(weights, x=x, x8=x8, xs=xs[:, None])
            swept = sweep_rows is None or m in sweep_rows
            r, b = kernel_row(label, n, k, m, master, gbps, sweep and swept, libraries, sweep_int4 and swept)
            r.update(floors)
            rows.append(r)
            best += b
    return rows, best


def kernel_row(label, n, k, m, master, gbps, sweep, libraries=False, sweep_int4=False) -> tuple[dict, list[dict]]:
    """One shape's times; each timed copy is a clone of ``master``'s tensors that the call reads."""
    def only(*keys):
        return lambda i: {key: master[key].clone() if key != "w8t" else master["w8"].clone().T for key in keys}

    best = []
    us = {
        "bf16": rotating_us(lambda c: F.linear(c["x"], c["w"]), only("x", "w"))[0],
        "fp8": rotating_us(lambda c: _launch_fp8_linear(c["x"], c["w8"], c["scale"], None),
                           only("x", "w8", "scale"))[0],
        "scaled_mm": _or_nan(lambda: rotating_us(lambda c: torch._scaled_mm(c["x8"], c["w8t"], c["xs"], c["ws"],
                                                                            out_dtype=torch.bfloat16),
                                                 only("x8", "w8t", "xs", "ws"))[0]),
        "int4": rotating_us(lambda c: torch.ops.aten._weight_int4pack_mm(c["x"], c["packed"], 128, c["sz"]),
                            only("x", "packed", "sz"))[0],
    }
    # lorakit's int4 (the Triton kernel; GEMM tiles from QUANT_GEMM_ROWS, then the weight widened and cuBLAS)
    us["int4 triton"] = _or_nan(lambda: rotating_us(
        lambda c: _launch_int4_linear(c["x"], c["q4"], c["s4"], c["z4"], 128, None), only("x", "q4", "s4", "z4"))[0])
    if m >= QUANT_GEMM_ROWS:  # the weight widened once into a bf16 buffer, then cuBLAS (served from *_DEQUANT_ROWS)
        bf16 = torch.bfloat16
        us["fp8 widened"] = rotating_us(lambda c: F.linear(c["x"], _launch_fp8_dequant(c["w8"], c["scale"], bf16)),
                                        only("x", "w8", "scale"))[0]
        us["int4 widened"] = rotating_us(
            lambda c: F.linear(c["x"], _launch_int4_dequant(c["q4"], c["s4"], c["z4"], 128, bf16)),
            only("x", "q4", "s4", "z4"))[0]
    if sweep_int4 and (m <= 64 or m >= QUANT_GEMM_ROWS):
        tried = [(_or_nan(lambda config=config: rotating_us(
            lambda c: _launch_int4_linear(c["x"], c["q4"], c["s4"], c["z4"], 128, None, config),
            only("x", "q4", "s4", "z4"))[0]), config) for config in int4_configs(m)]
        for t, config in sorted((tc for tc in tried if not math.isnan(tc[0])), key=lambda tc: tc[0])[:6]:
            print(f"int4 triton {label} m={m}: {t:.1f} us {config}", flush=True)
        for family in ("int4 triton, tensor cores", "int4 triton, CUDA cores"):
            mine = [tc for tc in tried if tc[1]["DOT"] == family.endswith("tensor cores") and not math.isnan(tc[0])]
            if mine:
                t, config = min(mine, key=lambda tc: tc[0])
                best.append(dict(shape=label, m=m, family=family, us=t, heuristic_us=us["int4 triton"],
                                 pct=100 * (n * k // 2 + 4 * n * (k // 128)) / (t * 1e-6) / (gbps * 1e9),
                                 config=dict(config, BLOCK_K=128 * config["GROUPS"])))
                print(best[-1], flush=True)
    wbytes = {"bf16": 2 * n * k, "fp8": n * k, "scaled_mm": n * k, "int4": n * k // 2 + 4 * n * (k // 128),
              "int4 triton": n * k // 2 + 4 * n * (k // 128), "fp8 widened": n * k,
              "int4 widened": n * k // 2 + 4 * n * (k // 128)}
    if libraries:
        for name, (make, call, nbytes) in library_kernels().items():
            us[name] = _or_nan(lambda: rotating_us(call, lambda i: make(master["w"].clone(), master["x"].clone()))[0])
            wbytes[name] = nbytes(n, k)
    row = dict(shape=label, m=m, n=n, k=k, **{f"{s}_us": t for s, t in us.items()},
               **{f"{s}_pct": 100 * wbytes[s] / (t * 1e-6) / (gbps * 1e9) for s, t in us.items()})
    if sweep and (m <= 64 or m >= QUANT_GEMM_ROWS):
        tried = []
        for config in sweep_configs(m):
            try:
                t = rotating_us(lambda c, config=config: _launch_fp8_linear(c["x"], c["w8"], c["scale"], None,
                                                                            config), only("x", "w8", "scale"))[0]
            except Exception as e:  # a config out of shared memory
                print(f"config {config} failed: {type(e).__name__}", flush=True)
                continue
            tried.append((t, config))
        for family in sorted({config_family(config) for _, config in tried}):
            t, config = min((tc for tc in tried if config_family(tc[1]) == family), key=lambda tc: tc[0])
            best.append(dict(shape=label, m=m, family=family, us=t, heuristic_us=us["fp8"],
                             pct=100 * n * k / (t * 1e-6) / (gbps * 1e9), config=config))
            print(best[-1], flush=True)
    print({key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    return row, best


@functools.cache
def library_kernels() -> dict:
    """Other libraries' weight-only decode GEMMs, those installed: name -> (make(w bf16 [N, K], x) -> the state a
    call reads, call(state) -> y, weight bytes(n, k)). Each is checked once against x @ w.T (its quantization error
    only) before it is timed: a kernel that returns garbage is left out, not timed."""
    found = {}
    try:
        import gemlite
        from gemlite.helper import A16W8_FP8, A16Wn

        gemlite.set_autotune("fast")

        def gemlite_fp8(w, x):
            w8, scale = quantize_fp8(w)
            return dict(x=x, w8=w8, layer=A16W8_FP8(device=w.device, dtype=torch.bfloat16).from_weights(
                w8, bias=None, scales=scale[:, None].to(torch.bfloat16)))  # w8: counted by rotating_us

        def gemlite_int4(w, x):
            n, k = w.shape
            g = w.float().view(n, k // 128, 128)
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            scale = ((hi - lo) / 15).clamp(min=1e-6)
            zero = (-lo / scale).round()
            codes = (g / scale + zero).round().clamp(0, 15).to(torch.uint8).view(n, k)
            packed = codes[:, ::2] | codes[:, 1::2] << 4  # the bytes it holds, for rotating_us's count of copies
            return dict(x=x, packed=packed, layer=A16Wn(device=w.device, dtype=torch.bfloat16).from_weights(
                codes, scale.view(n, -1).to(torch.bfloat16), zero.view(n, -1).to(torch.bfloat16), W_nbits=4,
                group_size=128))

        found["gemlite fp8"] = (gemlite_fp8, lambda c: c["layer"](c["x"]), lambda n, k: n * k + 2 * n)
        found["gemlite int4"] = (gemlite_int4, lambda c: c["layer"](c["x"]), lambda n, k: n * k // 2 + 4 * n * (k // 128))
    except Exception as e:  # not installed, or it cannot load here
        print(f"gemlite: {type(e).__name__}: {e}".splitlines()[0], flush=True)
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm)
        from fbgemm_gpu.experimental.gen_ai.quantize import quantize_int4_preshuffle

        def fbgemm_fp8(w, x):  # per-tensor scale: its only fp8 weight-only GEMV
            w8, scale = torch.ops.fbgemm.quantize_fp8_per_tensor(w)
            return dict(x=x, w8=w8, scale=scale)

        def fbgemm_int4(w, x):
            wq, (scale, zero) = quantize_int4_preshuffle(w, dtype="bf16")
            return dict(x=x, wq=wq, scale=scale, zero=zero)

        found["fbgemm fp8 gemv"] = (fbgemm_fp8, lambda c: torch.ops.fbgemm.bf16fp8bf16_fast_gemv(c["x"], c["w8"],
                                                                                                 c["scale"]),
                                    lambda n, k: n * k)
        found["fbgemm int4 (cutlass, preshuffled)"] = (
            fbgemm_int4, lambda c: torch.ops.fbgemm.bf16i4bf16_shuffled(c["x"], c["wq"], c["scale"], c["zero"]),
            lambda n, k: n * k // 2 + 4 * n * (k // 128))
    except Exception as e:
        print(f"fbgemm_gpu genai: {type(e).__name__}: {e}".splitlines()[0], flush=True)
    checked = {}
    for name, (make, call, nbytes) in found.items():
        try:
            gen = torch.Generator(device="cuda").manual_seed(1)
            w = torch.randn(512, 1024, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            x = torch.randn(3, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)
            err = float((call(make(w, x)).float() - x.float() @ w.float().T).norm() / (x.float() @ w.float().T).norm())
            print(f"{name}: relative error against the bf16 weight {err:.3g}", flush=True)
            if err < 0.2:
                checked[name] = (make, call, nbytes)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}".splitlines()[0], flush=True)
    return checked


def int4_configs(m: int) -> list[dict]:
    """The Triton int4 kernel's configs a sweep times at ``m`` rows (GROUPS: groups of 128 inputs a step, unrolled;
    SPLIT_K: K's groups in that many programs, their partials added in order). Round 3's sweep (H100) took 64
    channels, 2 groups and split K 4 nearly everywhere: its neighbours (32 channels, 1 and 4 groups, split K 8) too."""
    if m >= QUANT_GEMM_ROWS:  # GEMM tiles, as cuBLAS takes
        return [dict(BLOCK_M=block_m, BLOCK_N=block_n, GROUPS=groups, DOT=True, SPLIT_K=split_k, num_warps=warps,
                     num_stages=stages)
                for block_m, block_n, groups, warps, stages in ((64, 128, 1, 4, 3), (128, 128, 1, 8, 3),
                                                                (128, 128, 2, 8, 2), (128, 64, 1, 4, 4),
                                                                (128, 256, 1, 8, 2), (64, 64, 2, 4, 4))
                for split_k in ((1, 2) if m <= 256 else (1,))]
    block_m = 16 if m <= 16 else 64
    stages = (lambda groups: 4 if groups <= 2 else 3) if m <= 16 else (lambda groups: 3 if groups <= 2 else 2)
    configs = [dict(BLOCK_M=block_m, BLOCK_N=block_n, GROUPS=groups, DOT=True, SPLIT_K=split_k, num_warps=4,
                    num_stages=stages(groups))
               for block_n, groups, split_k in itertools.product((32, 64) if m <= 16 else (32, 64, 128), (1, 2, 4),
                                                                 (1, 2, 4, 8))]
    if m == 1:
        configs += [dict(BLOCK_M=1, BLOCK_N=block_n, GROUPS=groups, DOT=False, SPLIT_K=split_k, num_warps=4,
                         num_stages=3)
                    for block_n, groups, split_k in itertools.product((16, 32), (2, 4), (4, 8))]
    return configs


def sweep_configs(m: int) -> list[dict]:
    """The fp8 kernel's configs a sweep times at ``m`` rows: the tiled kernel's (split K included) and, up to 16
    rows, the decode kernel's (a program per column block over the whole of K; on the tensor cores, or for one row
    on the CUDA cores)."""
    configs = []
    if m >= QUANT_GEMM_ROWS:  # GEMM tiles, as cuBLAS takes
        return [dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, F16=True, SPLIT_K=split_k,
                     num_warps=warps, num_stages=stages)
                for block_m, block_n, block_k, warps, stages in ((64, 128, 128, 4, 3), (128, 128, 64, 8, 4),
                                                                 (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
                                                                 (128, 64, 128, 4, 4), (64, 256, 64, 8, 4))
                for split_k in ((1, 2) if m <= 256 else (1,))]
    if m <= 16:  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, SPLIT_K)
        tiles = [(16, 32, 512, 3, 1), (16, 64, 256, 4, 1), (16, 64, 512, 2, 1), (16, 64, 256, 4, 2),
                 (16, 64, 256, 3, 4), (16, 128, 128, 3, 8)]
    else:
        tiles = [(64, 128, 128, 3, 1), (16, 64, 256, 3, 1), (64, 64, 128, 4, 1), (64, 128, 128, 3, 2),
                 (16, 128, 256, 3, 2), (64, 128, 128, 3, 4)]
    for block_m, block_n, block_k, stages, split_k in tiles:
        configs.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, F16=True, SPLIT_K=split_k,
                            num_warps=4, num_stages=stages))
    if m <= 16:
        for block_n, block_k, stages, warps in itertools.product((16, 32, 64), (256, 512), (3, 4), (4,)):
            configs.append(dict(KERNEL="decode", DOT=True, F16=True, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                num_warps=warps, num_stages=stages))
    elif m <= 64:  # every row in one block: W read once
        for block_n, block_k, stages in itertools.product((32, 64, 128), (128, 256), (3, 4)):
            configs.append(dict(KERNEL="decode", DOT=True, F16=True, BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k,
                                num_warps=4, num_stages=stages))
    if m == 1:
        for block_n, block_k, stages in itertools.product((8, 16, 32), (256, 512), (2, 4)):
            configs.append(dict(KERNEL="decode", DOT=False, F16=False, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k,
                                num_warps=4, num_stages=stages))
    return configs


def config_family(config: dict) -> str:
    if config.get("KERNEL") != "decode":
        return "tiles, split K" if config["SPLIT_K"] > 1 else "tiles"
    return "decode, tensor cores" if config["DOT"] else "decode, CUDA cores"


def _or_nan(fn) -> float:
    try:
        return fn()
    except Exception as e:  # torch._scaled_mm refuses a shape (no fp8 tensor cores), a config out of resources
        print(f"skipped: {e}".splitlines()[0], flush=True)
        return float("nan")


def make_quantized(config: transformers.PretrainedConfig, scheme: str | None, device: str) -> torch.nn.Module:
    """A random model of ``config`` in bf16 (float32 on the CPU), its linear layers made one at a time on ``device``
    and quantized at once (``scheme``): the full-precision model never exists, so a 70B fp8 model fits one GPU."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    head = model.get_output_embeddings()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and module is not head:
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                     device=device, dtype=dtype)
            with torch.no_grad():
                linear.weight.normal_(0, 0.02, generator=gen)
                if linear.bias is not None:
                    linear.bias.zero_()
            layer = linear if scheme is None else (Fp8Linear if scheme == "fp8" else Int4Linear).from_linear(linear)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            del linear
    for module in model.modules():  # what is left on the meta device: embeddings, head, norms, rotary buffers
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.device.type == "meta" for t in own):
            module.to_empty(device=device, recurse=False)
    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq"):  # rotary embeddings: made again, as their __init__ computes their buffers
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, type(module)(module.config).to(device))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) or module is head:
                module.weight.normal_(0, 0.02, generator=gen)
            elif hasattr(module, "weight") and isinstance(module.weight, torch.Tensor) and module.weight.dim() == 1:
                module.weight.fill_(1.0)  # RMSNorm
    return model.eval()


def engine_rows(args, gbps: float, tmp: Path) -> list[dict]:
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    layers = 2 if args.tiny else 32
    rows = []
    torch.manual_seed(0)
    model = make_model(layers, args.tiny, args.device)
    adapters = {f"u{i}": write_adapter(model, tmp / f"u{i}", 16, seed=i) for i in range(8)}
    lora_bytes = sum(m.in_features + m.out_features for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in
                     ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) * 16 * 2
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    model = None
    batches = (1, 64)
    for scheme in [None] + [s for s in args.schemes if s != "bf16"]:  # an engine per scheme: base rows replay twins
        torch.manual_seed(0)
        model = make_model(layers, args.tiny, args.device)
        if scheme is not None:
            quantize(model, scheme)
        base_bytes = weight_bytes(model)
        engine = Engine(model, max_loras=8, max_rank=16, max_num_seqs=64, max_seq_len=PROMPT + DECODE + 8,
                        max_num_batched_tokens=4096, compile=args.compile and cuda, graph_sizes=list(batches),
                        adapters=adapters)
        for label, names in (("base", [None]), ("8 adapters, rank 16", list(adapters))):
            for batch in batches:
                used = names[: min(len(names), batch)]
                lora = lora_bytes * len([n for n in used if n])
                result = run_engine(engine, batch, used, DECODE, cfg.vocab_size, sync)
                floor_ms = 1e3 * (base_bytes + batch * kv_per_token * (PROMPT + DECODE // 2) + lora) / (gbps * 1e9)
                rows.append(dict(scheme=scheme or "bf16", what=label, batch=batch, weight_gb=base_bytes / 1e9,
                                 **result, floor_ms=floor_ms, roofline_pct=100 * floor_ms / result["step_ms"]))
                print(rows[-1], flush=True)
        engine = model = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for r in rows:
        bf16 = next(b for b in rows if b["scheme"] == "bf16" and b["what"] == r["what"] and b["batch"] == r["batch"])
        r["vs_bf16"] = r["tok_s"] / bf16["tok_s"]
    return rows


def seventy_b_rows(args, gbps: float, tmp: Path, shape: dict = LLAMA_70B) -> list[dict]:
    """The 70B rows (``shape``: a smaller Llama config for a CPU smoke run)."""
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = transformers.LlamaConfig(**shape)
    model = make_quantized(config, "fp8", args.device)
    weights = weight_bytes(model)
    resident = torch.cuda.memory_allocated() if cuda else float("nan")
    adapters = {f"b{i}": write_adapter(model, tmp / f"b{i}", 16, seed=i) for i in range(8)}
    engine = Engine(model, max_loras=8, max_rank=16, max_num_seqs=64, max_seq_len=PROMPT + DECODE + 8,
                    max_num_batched_tokens=4096, graph_sizes=[1, 64], adapters=adapters, quantization="fp8")
    rows = []
    for batch, names in ((1, [None]), (1, ["b0"]), (64, [None]), (64, list(adapters))):
        result = run_engine(engine, batch, names, DECODE, config.vocab_size, sync)
        floor_ms = 1e3 * weights / (gbps * 1e9)
        rows.append(dict(batch=batch, adapters=len([n for n in names if n]), **result, weight_gb=weights / 1e9,
                         floor_ms=floor_ms, roofline_pct=100 * floor_ms / result["step_ms"]))
        print(rows[-1], flush=True)
    rows[0]["resident_gb"] = resident / 1e9
    rows[0]["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
    rows[0]["gpu_total_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else float("nan")
    return rows


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--sweep", action="store_true", help="also time the fp8 kernel's decode tiles over a config grid")
    p.add_argument("--sweep-int4", action="store_true", help="also time the Triton int4 kernel over a config grid")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="engine rows from plain CUDA graphs")
    p.add_argument("--skip-70b", action="store_true")
    p.add_argument("--schemes", type=lambda t: t.split(","), default=["fp8", "int4"],
                   help="the quantized bases of the engine rows, beside bf16 (default: fp8,int4)")
    p.add_argument("--kernels-only", action="store_true")
    p.add_argument("--libraries", action="store_true",
                   help="also time other libraries' weight-only kernels where installed (gemlite, fbgemm_gpu genai)")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--only-70b", action="store_true", help="the 70B rows alone (no kernels, no 8B engine)")
    p.add_argument("--rows", type=lambda t: tuple(int(v) for v in t.split(",")), default=ROWS,
                   help=f"the kernels' row counts M (default: {','.join(map(str, ROWS))})")
    p.add_argument("--sweep-rows", type=lambda t: tuple(int(v) for v in t.split(",")), default=None,
                   help="the row counts the sweeps time (default: all of --rows)")
    args = parse_args(p, argv)
    if args.only_70b:
        args.skip_kernels, args.skip_70b, args.kernels_only = True, False, False
    cuda = args.device == "cuda"
    gbps = copy_gbps(1 << 29) if cuda else float("nan")
    kernels, best, engine, seventy = [], [], [], []
    if cuda and not args.skip_kernels:
        kernels, best = kernel_rows(gbps, args.sweep, args.rows, args.libraries, args.sweep_int4, args.sweep_rows)
    with tempfile.TemporaryDirectory() as tmp:
        if not (args.kernels_only or args.only_70b):
            engine = engine_rows(args, gbps, Path(tmp))
        if cuda and not (args.skip_70b or args.kernels_only or args.tiny):
            seventy = seventy_b_rows(args, gbps, Path(tmp))
    s = setup("device", "torch", "triton", "transformers", "commit", "date_utc", device=args.device, copy_gbps=gbps,
              compile=args.compile, prompt=PROMPT, decode=DECODE)
    parts = [f"# Quantized bases: kernels, the 8B engine, 70B on one GPU\n\n{setup_line(s)}; copy {gbps:.0f} GB/s "
             f"measured in the same run.\n"]
    if kernels:
        libs = [key[:-3] for key in kernels[0]
                if key.endswith("_us") and key[:-3] not in KERNELS and not key.startswith("read_")]
        parts.append("## Kernels: y = x @ W.T at Llama-3-8B's shapes (us; % = weight bytes / time / copy bandwidth)\n\n"
                     + table("| shape (N x K) | M | bf16 cuBLAS | fp8 lorakit | fp8 x fp8 _scaled_mm | int4 tinygemm | int4 lorakit | "
                             "fp8 widened + cuBLAS | int4 widened + cuBLAS | "
                             + "".join(f"{lib} | " for lib in libs) + "fp8 vs bf16 | int4 vs bf16 | read of the fp8 "
                             "bytes (us) | fp8 / read | read of the int4 bytes (us) |",
                             ([f"{r['shape']} ({r['n']} x {r['k']})", r["m"],
                               *(f"{fmt(r.get(f'{k}_us', float('nan')))} ({fmt(r.get(f'{k}_pct', float('nan')), '.0f')} %)"
                                 for k in (*KERNELS, *libs)),
                               fmt(r["bf16_us"] / r["fp8_us"], ".2f"), fmt(r["bf16_us"] / r["int4 triton_us"], ".2f"),
                               fmt(r["read_fp8_us"]), fmt(r["read_fp8_us"] / r["fp8_us"], ".2f"),
                               fmt(r["read_int4_us"])]
                              for r in kernels))
                     + "\n\nread: one kernel reading the weight's bytes (and nothing else) in one launch, timed as the "
                     "GEMMs are: the floor of a GEMM bound by its weight at this size, launch and ramp included.")
    if best:
        parts.append("## Each kernel family's best config in the sweep against the default (fp8; int4 Triton where "
                     "swept)\n\n" + table(
            "| shape | M | family | best (us) | % of copy | heuristic (us) | BLOCK_M | BLOCK_N | BLOCK_K | stages | "
            "warps | split K |",
            ([b["shape"], b["m"], b["family"], fmt(b["us"]), fmt(b["pct"], ".0f"), fmt(b["heuristic_us"]),
              b["config"]["BLOCK_M"], b["config"]["BLOCK_N"], b["config"]["BLOCK_K"], b["config"]["num_stages"],
              b["config"]["num_warps"], b["config"].get("SPLIT_K", 1)] for b in best)))
    if engine:
        mode = "compiled decode graphs" if args.compile and cuda else "CUDA graphs"
        parts.append(f"## Engine decode, Llama-3-8B shape, {mode}\n\n" + table(
            "| base weights | what | batch | weights (GB) | decode tok/s | step (ms) | byte floor (ms) | % of roofline | "
            "vs bf16 |",
            ([r["scheme"], r["what"], r["batch"], fmt(r["weight_gb"], ".2f"), fmt(r["tok_s"], ".0f"),
              fmt(r["step_ms"], ".2f"), fmt(r["floor_ms"], ".2f"), fmt(r["roofline_pct"], ".0f"),
              fmt(r["vs_bf16"], ".2f")] for r in engine)))
    if seventy:
        first = seventy[0]
        parts.append(f"## Llama-3-70B shape, fp8, 8 rank-16 adapters, CUDA graphs\n\nWeights {first['weight_gb']:.1f} "
                     f"GB; resident after the model was made {first['resident_gb']:.1f} GB, peak "
                     f"{first['peak_gb']:.1f} GB of {first['gpu_total_gb']:.1f} GB.\n\n" + table(
                         "| batch | adapters | decode tok/s | step (ms) | weight floor (ms) | % of roofline |",
                         ([r["batch"], r["adapters"], fmt(r["tok_s"], ".0f"), fmt(r["step_ms"], ".2f"),
                           fmt(r["floor_ms"], ".2f"), fmt(r["roofline_pct"], ".0f")] for r in seventy)))
    write_report(args.out, "bench_quant", "\n\n".join(parts),
                 dict(setup=s, kernels=kernels, sweep=best, engine=engine, llama70b=seventy))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
