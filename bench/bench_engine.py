"""Decode throughput of the engine: a Llama-3-8B-shaped model with random bf16 weights, many adapters per batch.

For batch 1, 16 and 64, each request a 128-token prompt then ``--decode`` greedy tokens: the base model alone;
8 and 32 distinct rank-16 adapters on all 7 projections (requests spread evenly over them); ranks mixed in
8..64; and, as the baseline users have today, transformers + PEFT ``generate`` with ``adapter_names=``.
With ``--compile``, the compiled rows also take three options off against the defaults, in the same run, each in
an engine of its own: the base twins of the decode graphs (``base_twins=False``: base steps replay the graphs with
their empty LoRA kernels), the fused sibling GEMMs (``fuse_siblings=False``: one GEMM per projection), and
programmatic dependent launch (the model patched with ``KernelOptions(pdl=frozenset())``).
Decode steps only are timed (prefill excluded), wall clock per step (each step ends by reading the sampled
tokens). Roofline per row: (weight bytes + KV bytes read per step + the used adapters' bytes) / the copy
bandwidth measured in the same run.

    PYTHONPATH=src python bench/bench_engine.py --out DIR [--decode 64] [--quick]
    PYTHONPATH=src python bench/bench_engine.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (TARGETS, arg_parser, copy_gbps, fmt, make_model, parse_args, setup, setup_line, table,
                    write_adapter, write_report)  # bench/ is on sys.path when this file runs as a script

import lorakit
from lorakit.engine import Engine, SamplingParams
from lorakit.ops import KernelOptions

PROMPT = 128
EIGHT = [f"u{i}" for i in range(8)]
COMPILED = {  # key: label, adapters, batches (None: all), engine options; the last three against the defaults
    "base": ("base", [None], None, {}),
    "8": ("8 adapters, rank 16", EIGHT, None, {}),
    "32": ("32 adapters, rank 16", [f"u{i}" for i in range(32)], None, {}),
    "no-twins": ("base, graphs with (empty) LoRA kernels", [None], [1, 64], dict(base_twins=False)),
    "unfused": ("base, one GEMM per projection", [None], [1, 64], dict(fuse_siblings=False)),
    "no-pdl": ("8 adapters, rank 16, PDL off", EIGHT, [64], dict(kernels=KernelOptions(pdl=frozenset()))),
}


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every parameter but the embedding table (only a few rows are read)."""
    emb = model.get_input_embeddings().weight
    return sum(p.nbytes for p in model.parameters() if p is not emb) + (
        emb.nbytes if model.get_output_embeddings().weight is emb else 0)


def adapter_bytes(model, rank: int) -> int:
    return sum(m.in_features + m.out_features for n, m in model.named_modules()
               if n.rsplit(".", 1)[-1] in TARGETS and isinstance(m, torch.nn.Linear)) * rank * 2


def run_engine(engine: Engine, batch: int, names: list, decode: int, vocab: int, sync) -> dict:
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True),
                           names[i % len(names)])
    steps = []
    while engine.has_unfinished():
        decode_step = bool(engine.scheduler.running) and not engine.scheduler.waiting and all(
            r.num_computed == r.num_tokens - 1 for r in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decode_step and len(engine.scheduler.running) == batch:
            steps.append(time.perf_counter() - start)
    sync()
    step = statistics.median(steps[2:] or steps)
    return dict(step_ms=1e3 * step, tok_s=batch / step, steps=len(steps))


def run_peft(model_fn, folders: list[Path], batch: int, decode: int, vocab: int, sync) -> dict:
    """transformers + PEFT generate with adapter_names= (a mixed batch), eager: what users have today."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(model_fn(), folders[0], adapter_name="a0")
    for i, folder in enumerate(folders[1:], 1):
        model.load_adapter(folder, adapter_name=f"a{i}")
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, PROMPT), generator=gen).to(model.device)
    names = [f"a{i % len(folders)}" for i in range(batch)]
    with torch.no_grad():
        def go(n):
            sync()
            start = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, adapter_names=names)
            sync()
            return time.perf_counter() - start
        go(2)
        t_short, t_long = go(2), go(2 + decode)
    model = None
    gc.collect()
    torch.cuda.empty_cache()
    step = (t_long - t_short) / decode
    return dict(step_ms=1e3 * step, tok_s=batch / step, steps=decode)


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--decode", type=int, default=64, help="decode tokens per request")
    p.add_argument("--peft-decode", type=int, default=8, help="decode tokens for the PEFT baseline (it is slow)")
    p.add_argument("--quick", action="store_true", help="batch 64 only")
    p.add_argument("--compile", action="store_true",
                   help="also compiled: base, 8 and 32 adapters at every batch; base at batch 1 and 64 without base "
                        "twins and without fused sibling GEMMs; 8 adapters at batch 64 without PDL")
    p.add_argument("--compile-only", action="store_true", help="only the compiled rows")
    p.add_argument("--cases", type=lambda v: v.split(","), default=list(COMPILED),
                   help=f"the compiled rows to run, of {','.join(COMPILED)} (default: all)")
    p.add_argument("--batches", type=lambda v: tuple(int(b) for b in v.split(",")), default=None,
                   help="batch sizes (default: 1,16,64; 64 with --quick)")
    args = parse_args(p, argv)
    if unknown := set(args.cases) - set(COMPILED):
        p.error(f"--cases: unknown {sorted(unknown)}; the compiled rows are {','.join(COMPILED)}")
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    layers = 2 if args.tiny else 32
    gbps = copy_gbps(1 << 29) if cuda else float("nan")
    batches = args.batches or ((64,) if args.quick else (1, 16, 64))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = make_model(layers, args.tiny, args.device)
        vocab = model.config.vocab_size
        n_uniform = 32
        uniform = [write_adapter(model, Path(tmp) / f"u{i}", 16, seed=i) for i in range(n_uniform)]
        mixed_ranks = [8, 16, 32, 64, 8, 24, 48, 16]
        mixed = [write_adapter(model, Path(tmp) / f"m{i}", r, seed=100 + i) for i, r in enumerate(mixed_ranks)
                 if not args.compile_only]
        base_bytes = weight_bytes(model)
        per_rank = adapter_bytes(model, 1)  # counted before an engine wraps the projections
        cfg = model.config
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
        cases = [("base", [None], 0), ("8 adapters, rank 16", [f"u{i}" for i in range(8)], 8),
                 ("32 adapters, rank 16", [f"u{i}" for i in range(32)], 32),
                 ("8 adapters, ranks 8..64", [f"m{i}" for i in range(8)], 8)]
        if args.compile_only:
            cases, args.compile = [], True
        for k, (label, names, count) in enumerate(cases):
            if k:  # a fresh, unpatched model for each case
                torch.manual_seed(0)
                model = make_model(layers, args.tiny, args.device)
            engine = Engine(model, max_loras=32, max_rank=64, max_num_seqs=64, max_seq_len=PROMPT + args.decode + 8,
                            max_num_batched_tokens=4096,
                            adapters={f"u{i}": f for i, f in enumerate(uniform)} | {f"m{i}": f for i, f in enumerate(mixed)})
            for batch in batches:
                used = names[: min(len(names), batch)]
                ranks = [16] * len(used) if "rank 16" in label else mixed_ranks[: len(used)]
                lora = per_rank * sum(ranks) if count else 0
                result = run_engine(engine, batch, used, args.decode, vocab, sync)
                kv = batch * kv_per_token * (PROMPT + args.decode // 2)
                floor_ms = 1e3 * (base_bytes + kv + lora) / (gbps * 1e9)
                rows.append(dict(what=f"lorakit, {label}", batch=batch, adapters=len([n for n in used if n]),
                                 **result, floor_ms=floor_ms, roofline_pct=100 * floor_ms / result["step_ms"]))
                print(rows[-1], flush=True)
            engine = model = None
            gc.collect()  # the patched model and its handle refer to each other
            if cuda:
                torch.cuda.empty_cache()
        if args.compile:  # decode graphs captured from torch.compile (one compile per batch size)
            for key in args.cases:
                label, names, sizes, options = COMPILED[key]
                sizes = [b for b in sizes or batches if b in batches]
                if not sizes:
                    continue
                torch.manual_seed(0)
                model = make_model(layers, args.tiny, args.device)
                options = dict(options)
                kernels = options.pop("kernels", None)
                if kernels is not None:  # the LoRA layers launch their kernels with the options of the model's patch
                    lorakit.patch(model, 32, max_rank=64, kernels=kernels)
                engine = Engine(model, max_loras=32, max_rank=64, max_num_seqs=64, compile=True,
                                max_seq_len=PROMPT + args.decode + 8, max_num_batched_tokens=4096,
                                adapters={f"u{i}": f for i, f in enumerate(uniform)}, graph_sizes=sizes, **options)
                for batch in sizes:
                    used = names[: min(len(names), batch)]
                    lora = 0 if names == [None] else len(used) * per_rank * 16
                    kv = batch * kv_per_token * (PROMPT + args.decode // 2)
                    floor_ms = 1e3 * (base_bytes + kv + lora) / (gbps * 1e9)
                    result = run_engine(engine, batch, used, args.decode, vocab, sync)
                    rows.append(dict(what=f"lorakit compiled, {label}", batch=batch, adapters=len(used) if lora else 0,
                                     **result, floor_ms=floor_ms, roofline_pct=100 * floor_ms / result["step_ms"]))
                    print(rows[-1], flush=True)
                engine = model = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        if cuda and not args.tiny and not args.compile_only:
            for n in (8, 32):
                result = run_peft(lambda: make_model(layers, args.tiny, args.device), uniform[:n], 64,
                                  args.peft_decode, vocab, sync)
                rows.append(dict(what=f"transformers + PEFT generate, {n} adapters", batch=64, adapters=n, **result,
                                 floor_ms=float("nan"), roofline_pct=float("nan")))
                print(rows[-1], flush=True)
    for r in rows:  # against the base model in the same mode (eager or compiled graphs) at the same batch
        base_what = "lorakit compiled, base" if r["what"].startswith("lorakit compiled") else "lorakit, base"
        base = next((b for b in rows if b["what"] == base_what and b["batch"] == r["batch"]), None)
        r["vs_base"] = r["tok_s"] / base["tok_s"] if base and r["what"].startswith("lorakit") else float("nan")
    s = setup("device", "torch", "transformers", "commit", "date_utc", device=args.device, layers=layers,
              copy_gbps=gbps, prompt=PROMPT, decode=args.decode)
    head = "| what | batch | decode tok/s | step (ms) | byte floor (ms) | % of roofline | vs base (same mode and batch) |"
    rows_md = table(head, ([r["what"], r["batch"], fmt(r["tok_s"], ".0f"), fmt(r["step_ms"], ".2f"),
                            fmt(r["floor_ms"], ".2f"), fmt(r["roofline_pct"], ".0f"), fmt(r["vs_base"], ".2f")]
                           for r in rows))
    report = (f"# Engine decode throughput: Llama-3-8B shape ({layers} layers), random bf16 weights\n\n"
              f"{setup_line(s)}; prompt {PROMPT}, {args.decode} greedy tokens per request, decode steps only; CUDA "
              f"graphs; copy {gbps:.0f} GB/s measured in the same run.\n\n{rows_md}")
    write_report(args.out, "bench_engine", report, dict(setup=s, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
