"""Tensor parallelism: decode throughput at tensor_parallel_size 1 and N, and the LoRA all-reduce's share of a step.

A Llama-3-8B-shaped model (random bf16 weights, seed 0 on every rank) for batch 1, 16 and 64: the base model alone
and 8 and 32 distinct rank-16 adapters on all 7 projections (requests spread evenly over them), through the engine
at tp=1 and at tp=N (``Engine(factory, tensor_parallel_size=N)``: N - 1 spawned workers), decode steps only, as
``bench_engine.py`` times them (tests/test_tp_engine.py checks that tp=N gives tp=1's tokens, in float32).

The LoRA all-reduce: each row-parallel layer (o, down) with an adapter active all-reduces the shrink's h
(T x R_max float32) besides the base layer's all-reduce of T x hidden; both are timed alone in the same run (N
processes, NCCL, CUDA events over 200 calls), and their share of a step is 2 x layers x the call over the step
time at tp=N with 8 adapters.

    PYTHONPATH=src python bench/bench_tp.py --out DIR [--tp 2] [--decode 32]
    PYTHONPATH=src python bench/bench_tp.py --out DIR --device cpu --tiny   # a smoke run (gloo), no timing value
"""

from __future__ import annotations

import functools
import gc
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
import transformers
from bench_engine import PROMPT, run_engine
from common import arg_parser, fmt, make_model, parse_args, setup, setup_line, table, write_adapter, write_report

from lorakit.engine import Engine

BATCHES = (1, 16, 64)
RANK = 16


def build(layers: int, tiny: bool, device: str) -> torch.nn.Module:
    """The model every rank builds (the same on each: seeded), on its device; the engine keeps the rank's shard."""
    torch.manual_seed(0)
    model = make_model(layers, tiny, "meta")
    with torch.device("cuda" if device == "cuda" else "cpu"):
        return transformers.AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype
                                                             if device == "cuda" else torch.float32).eval()


def _collective(rank: int, world_size: int, init_file: str, device: str, sizes: list, out: str) -> None:
    """One process of the all-reduce timing: median microseconds of each (shape, dtype), written by rank 0."""
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    times = []
    for shape, dtype in sizes:
        x = torch.randn(shape, device="cuda" if cuda else "cpu").to(dtype)
        for _ in range(20):
            dist.all_reduce(x)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(200):
                dist.all_reduce(x)
            end.record()
            end.synchronize()
            times.append(1e3 * start.elapsed_time(end) / 200)
        else:
            import time
            t = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(x)
            times.append(1e6 * (time.perf_counter() - t) / 200)
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def collective_us(world_size: int, device: str, sizes: list) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.start_processes(_collective, args=(world_size, os.path.join(tmp, "rendezvous"), device, sizes, out),
                           nprocs=world_size, start_method="spawn")
        return torch.load(out)


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    p.add_argument("--decode", type=int, default=32, help="decode tokens per request")
    args = parse_args(p, argv)
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"bench_tp.py --tp {args.tp} needs {args.tp} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    layers = 2 if args.tiny else 32
    meta = make_model(layers, args.tiny, "meta")
    cfg = meta.config
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {f"u{i}": write_adapter(meta, Path(tmp) / f"u{i}", RANK, seed=i) for i in range(32)}
        cases = [("base", [None]), ("8 adapters, rank 16", [f"u{i}" for i in range(8)]),
                 ("32 adapters, rank 16", [f"u{i}" for i in range(32)])]
        for tp in (1, args.tp):
            engine = Engine(functools.partial(build, layers, args.tiny, args.device), tensor_parallel_size=tp,
                            device=args.device, max_loras=32, max_rank=RANK, max_num_seqs=64,
                            max_seq_len=PROMPT + args.decode + 8, max_num_batched_tokens=4096, adapters=folders,
                            graph_sizes=BATCHES)
            try:
                for label, names in cases:
                    for batch in BATCHES:
                        used = names[: min(len(names), batch)]
                        result = run_engine(engine, batch, used, args.decode, cfg.vocab_size, sync)
                        rows.append(dict(tp=tp, what=label, batch=batch, **result))
                        print(rows[-1], flush=True)
            finally:
                engine.close()
                engine = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    for r in rows:
        one = next(o for o in rows if o["tp"] == 1 and o["what"] == r["what"] and o["batch"] == r["batch"])
        r["speedup_vs_tp1"] = one["step_ms"] / r["step_ms"]
    hidden, r_max = cfg.hidden_size, RANK
    sizes = [((b, r_max), torch.float32) for b in BATCHES] + [((b, hidden), meta.dtype if cuda else torch.float32)
                                                             for b in BATCHES]
    us = collective_us(args.tp, args.device, sizes)
    lora_us, base_us = dict(zip(BATCHES, us[: len(BATCHES)])), dict(zip(BATCHES, us[len(BATCHES):]))
    for r in rows:
        if r["tp"] == args.tp:
            r["base_allreduce_pct"] = 100 * (2 * layers + 1) * base_us[r["batch"]] / (1e3 * r["step_ms"])
            r["lora_allreduce_pct"] = (100 * 2 * layers * lora_us[r["batch"]] / (1e3 * r["step_ms"])
                                       if r["what"] != "base" else 0.0)
    s = setup("device", "torch", "commit", "date_utc", device=args.device, layers=layers, tp=args.tp,
              decode=args.decode, allreduce_us={"lora": lora_us, "base": base_us})
    head = ("| tp | what | batch | decode tok/s | step (ms) | vs tp=1 | base all-reduces (% of step) | "
            "LoRA all-reduces (% of step) |")
    body = table(head, ([r["tp"], r["what"], r["batch"], fmt(r["tok_s"], ".0f"), fmt(r["step_ms"], ".2f"),
                         fmt(r["speedup_vs_tp1"], ".2f"), fmt(r.get("base_allreduce_pct", float("nan")), ".1f"),
                         fmt(r.get("lora_allreduce_pct", float("nan")), ".1f")] for r in rows))
    calls = ", ".join(f"T={b}: {lora_us[b]:.1f} / {base_us[b]:.1f} us" for b in BATCHES)
    report = (f"# Tensor parallelism: Llama-3-8B shape ({layers} layers), random weights, tp=1 vs tp={args.tp}\n\n"
              f"{setup_line(s)}; prompt {PROMPT}, {args.decode} greedy tokens per request, decode steps only.\n\n"
              f"One all-reduce alone (LoRA h, T x {r_max} float32 / base, T x {hidden}): {calls}.\n\n{body}")
    write_report(args.out, "bench_tp", report, dict(setup=s, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
