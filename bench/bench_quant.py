"""Quantized bases: the fp8 and int4 GEMMs at Llama-3-8B's shapes, the engine's decode on bf16, fp8 and int4 bases,
and a Llama-3-70B-shaped fp8 model with 8 adapters on one GPU.

1. Kernels: y = x @ W.T for each projection shape of Llama-3-8B (q/k/v and gate/up fused, as the engine runs them)
   at M = 1 .. 2048 rows: bf16 cuBLAS (F.linear), lorakit's fp8 kernel (weight-only), torch._scaled_mm (fp8 x fp8,
   row-wise scales: the tensor cores' fp8 path, activations pre-quantized, as a ceiling) and int4 tinygemm. Weight
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

import gc
import itertools
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from bench_engine import run_engine, weight_bytes  # bench/ is on sys.path when this file runs as a script
from common import (arg_parser, copy_gbps, fmt, make_model, parse_args, rotating_us, setup, setup_line, table,
                    write_adapter, write_report)

from lorakit.engine import Engine
from lorakit.layers.quant import Fp8Linear, Int4Linear, quantize
from lorakit.ops.quant import _launch_fp8_linear, quantize_fp8, quantize_int4

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 16, 64, 256, 2048)
PROMPT, DECODE = 128, 64
LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8)


def kernel_rows(gbps: float, sweep: bool, rows_m=ROWS) -> tuple[list[dict], list[dict]]:
    rows, best = [], []
    for label, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        w8, scale = quantize_fp8(w)
        packed, sz = quantize_int4(w, 128)
        weights = dict(w=w, w8=w8, scale=scale, w8t=w8.T, ws=scale[None, :], packed=packed, sz=sz)
        for m in rows_m:
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            x8, xs = quantize_fp8(x)
            master = dict(weights, x=x, x8=x8, xs=xs[:, None])
            r, b = kernel_row(label, n, k, m, master, gbps, sweep)
            rows.append(r)
            best += b
    return rows, best


def kernel_row(label, n, k, m, master, gbps, sweep) -> tuple[dict, list[dict]]:
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
    wbytes = {"bf16": 2 * n * k, "fp8": n * k, "scaled_mm": n * k, "int4": n * k // 2 + 4 * n * (k // 128)}
    row = dict(shape=label, m=m, n=n, k=k, **{f"{s}_us": t for s, t in us.items()},
               **{f"{s}_pct": 100 * wbytes[s] / (t * 1e-6) / (gbps * 1e9) for s, t in us.items()})
    if sweep and m <= 64:
        tried = []
        if m <= 16:  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, SPLIT_K)
            tiles = [(16, 32, 512, 3, 1), (16, 64, 256, 4, 1), (16, 64, 512, 2, 1), (16, 64, 256, 4, 2),
                     (16, 64, 256, 3, 4), (16, 128, 256, 3, 4), (16, 128, 128, 3, 8)]
        else:
            tiles = [(64, 128, 128, 3, 1), (16, 64, 256, 3, 1), (64, 64, 128, 4, 1), (64, 128, 128, 3, 2),
                     (16, 128, 256, 3, 2), (64, 128, 128, 3, 4)]
        for (block_m, block_n, block_k, stages, split_k), f16 in itertools.product(tiles, (True,)):
            config = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, F16=f16, SPLIT_K=split_k,
                          num_warps=4, num_stages=stages)
            try:
                t = rotating_us(lambda c, config=config: _launch_fp8_linear(c["x"], c["w8"], c["scale"], None,
                                                                            config), only("x", "w8", "scale"))[0]
            except Exception as e:  # a config out of shared memory
                print(f"config {config} failed: {type(e).__name__}", flush=True)
                continue
            tried.append((t, config))
        t, config = min(tried, key=lambda tc: tc[0])
        best.append(dict(shape=label, m=m, us=t, heuristic_us=us["fp8"], **config))
        print(best[-1], flush=True)
    print({key: round(v, 1) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    return row, best


def _or_nan(fn) -> float:
    try:
        return fn()
    except RuntimeError as e:  # torch._scaled_mm refuses a shape (or the device has no fp8 tensor cores)
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
    for scheme in (None, "fp8", "int4"):  # one engine per scheme: base rows replay its base twins
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
    p.add_argument("--no-compile", dest="compile", action="store_false", help="engine rows from plain CUDA graphs")
    p.add_argument("--skip-70b", action="store_true")
    p.add_argument("--kernels-only", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--only-70b", action="store_true", help="the 70B rows alone (no kernels, no 8B engine)")
    p.add_argument("--rows", type=lambda t: tuple(int(v) for v in t.split(",")), default=ROWS,
                   help=f"the kernels' row counts M (default: {','.join(map(str, ROWS))})")
    args = parse_args(p, argv)
    if args.only_70b:
        args.skip_kernels, args.skip_70b, args.kernels_only = True, False, False
    cuda = args.device == "cuda"
    gbps = copy_gbps(1 << 29) if cuda else float("nan")
    kernels, best, engine, seventy = [], [], [], []
    if cuda and not args.skip_kernels:
        kernels, best = kernel_rows(gbps, args.sweep, args.rows)
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
        parts.append("## Kernels: y = x @ W.T at Llama-3-8B's shapes (us; % = weight bytes / time / copy bandwidth)\n\n"
                     + table("| shape (N x K) | M | bf16 cuBLAS | fp8 lorakit | fp8 x fp8 _scaled_mm | int4 tinygemm | "
                             "fp8 vs bf16 | int4 vs bf16 |",
                             ([f"{r['shape']} ({r['n']} x {r['k']})", r["m"],
                               *(f"{fmt(r[f'{k}_us'])} ({fmt(r[f'{k}_pct'], '.0f')} %)"
                                 for k in ("bf16", "fp8", "scaled_mm", "int4")),
                               fmt(r["bf16_us"] / r["fp8_us"], ".2f"), fmt(r["bf16_us"] / r["int4_us"], ".2f")]
                              for r in kernels)))
    if best:
        parts.append("## fp8 decode tiles: the best of the sweep against the heuristic\n\n" + table(
            "| shape | M | best (us) | heuristic (us) | BLOCK_M | BLOCK_N | BLOCK_K | stages | float16 dot | split K |",
            ([b["shape"], b["m"], fmt(b["us"]), fmt(b["heuristic_us"]), b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_K"],
              b["num_stages"], b["F16"], b["SPLIT_K"]] for b in best)))
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
