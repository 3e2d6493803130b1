"""One engine step, host vs GPU: an all-decode step and a mixed step (the same decodes plus one new prompt).

In-process ``Engine``, random bf16 weights, no adapters (this measures the road to the GPU, not LoRA; see
bench_engine for adapters). For each model shape and batch B: B requests decode; a decode step is timed (wall clock
of ``engine.step()``, which ends by reading the sampled tokens, and the device time of its forward from the
runner's CUDA events), then, ten times, one 128-token prompt arrives beside the B decodes and that mixed step is
timed the same way; then, for each ``--chunks`` size P, one P-token prompt arrives beside the B decodes (its
whole prompt in that step: what a step with chunked prefill at P tokens costs the decodes riding along).
Modes: mixed steps eager (``graph_token_sizes=()``, as before mixed graphs), mixed steps from
their CUDA graphs (the default), and that with the decode graphs compiled. Host time = wall - GPU: what the host
adds that is not hidden behind the device.

    PYTHONPATH=src python bench/bench_step.py --out DIR [--shapes smollm2 llama8b] [--batches 64 256]
    PYTHONPATH=src python bench/bench_step.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import transformers
from common import (SMOLLM2_135M, arg_parser, fmt, make_model, parse_args, setup, setup_line, table,
                    write_report)  # bench/ is on sys.path when this file runs as a script

from lorakit.engine import Engine, SamplingParams

PROMPT = 128
MODES = {"mixed eager": dict(graph_token_sizes=(), async_scheduling=False),
         "mixed graphs": dict(async_scheduling=False),
         "mixed graphs, async": dict(async_scheduling=True),
         "mixed graphs, async, compiled decode": dict(async_scheduling=True, compile=True)}


def model_of(shape: str, tiny: bool, device: str) -> torch.nn.Module:
    if shape == "llama8b" or tiny:
        return make_model(2 if tiny else 32, tiny, device)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMOLLM2_135M),
                                                             dtype=torch.bfloat16).eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(engine: Engine) -> tuple[float, float]:
    """(wall s, GPU s) of one step, the device idle before and after it (with async scheduling, the step's call
    also reads the previous step's tokens: it is timed as one synchronous step)."""
    runner = engine.runner
    sync()
    runner.poll()
    gpu, n = runner.gpu_seconds, runner.timed_steps
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    sync()
    runner.poll()
    return wall, (runner.gpu_seconds - gpu) if runner.timed_steps > n else float("nan")


def measure(model, batch: int, mode: dict, vocab: int, steps: int, chunks: list[int]) -> dict:
    chunks = [c for c in chunks if c + 64 <= model.config.max_position_embeddings]  # (the tiny model's is short)
    engine = Engine(model, None, max_num_seqs=batch + 1, max_seq_len=max([1024, *chunks]) + 64,
                    max_num_batched_tokens=max([2048, *chunks]), max_prefill_tokens=max([2048, *chunks]),
                    graph_sizes=(batch,), **mode)
    gen = torch.Generator().manual_seed(batch)

    def prompt(n=PROMPT):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    for _ in range(batch):
        engine.add_request(prompt(), SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    decode = [timed(engine) for _ in range(steps)]
    sync()
    start, gpu, n = time.perf_counter(), engine.runner.gpu_seconds, engine.runner.timed_steps
    for _ in range(steps):  # back to back, as a server steps: what async scheduling hides shows here
        engine.step()
    sync()
    stream_ms = 1e3 * (time.perf_counter() - start) / steps
    engine.runner.poll()
    stream_gpu_ms = 1e3 * (engine.runner.gpu_seconds - gpu) / max(engine.runner.timed_steps - n, 1)
    mixed = []
    for _ in range(10):
        engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0.0))  # done in its one step
        mixed.append(timed(engine))
        engine.step()
    by_chunk = {}
    for chunk in chunks:
        rows = []
        for _ in range(5):
            engine.add_request(prompt(chunk), SamplingParams(max_tokens=1, temperature=0.0))
            rows.append(timed(engine))
            engine.step()
        by_chunk[chunk] = tuple(1e3 * statistics.median(x[i] for x in rows) for i in (0, 1))
    replays = (engine.runner.decode_replays, engine.runner.mixed_replays, engine.runner.eager_steps)
    del engine
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    med = {f"{kind}_{what}_ms": 1e3 * statistics.median(x[i] for x in rows)
           for kind, rows in (("decode", decode), ("mixed", mixed)) for i, what in enumerate(("wall", "gpu"))}
    med["mixed_over_decode"] = med["mixed_wall_ms"] / med["decode_wall_ms"]
    med["stream_ms"], med["stream_gpu_ms"] = stream_ms, stream_gpu_ms
    med["decode_host_ms"] = med["decode_wall_ms"] - med["decode_gpu_ms"]
    med["decode_replays"], med["mixed_replays"], med["eager_steps"] = replays
    med["chunks"] = {str(c): dict(wall_ms=w, gpu_ms=g, over_decode=w / med["decode_wall_ms"],
                                  prompt_tokens_per_s=c / (w - med["decode_wall_ms"]) * 1e3
                                  if w > med["decode_wall_ms"] else float("nan"))
                     for c, (w, g) in by_chunk.items()}
    return med


def main(argv=None) -> None:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--shapes", nargs="+", default=["smollm2", "llama8b"], choices=["smollm2", "llama8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    p.add_argument("--modes", nargs="+", default=list(MODES)[:3], choices=list(MODES))
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per row")
    p.add_argument("--chunks", nargs="*", type=int, default=[128, 256, 512, 1024, 2048],
                   help="prompt tokens of the mixed steps of the chunk sweep (none: no sweep)")
    args = parse_args(p, argv)
    rows, results, chunk_rows = [], [], []
    for shape in (["tiny"] if args.tiny else args.shapes):
        model = model_of(shape, args.tiny, args.device)
        vocab = model.config.vocab_size
        for batch in args.batches:
            for name in args.modes:
                if args.device == "cpu" and "graphs" in name:
                    continue  # no graphs on the CPU
                r = dict(shape=shape, batch=batch, mode=name,
                         **measure(model, batch, MODES[name], vocab, args.steps, args.chunks))
                for c, x in r["chunks"].items():
                    chunk_rows.append([shape, batch, name, c, fmt(x["wall_ms"], ".2f"), fmt(x["gpu_ms"], ".2f"),
                                       fmt(x["over_decode"], ".2f"), fmt(x["prompt_tokens_per_s"], ".0f")])
                results.append(r)
                rows.append([shape, batch, name, fmt(r["decode_wall_ms"], ".2f"), fmt(r["decode_gpu_ms"], ".2f"),
                             fmt(r["decode_host_ms"], ".2f"), fmt(r["mixed_wall_ms"], ".2f"),
                             fmt(r["mixed_gpu_ms"], ".2f"), fmt(r["mixed_over_decode"], ".2f"),
                             fmt(r["stream_ms"], ".2f"), fmt(r["stream_gpu_ms"], ".2f"),
                             f"{r['decode_replays']}/{r['mixed_replays']}/{r['eager_steps']}"])
                print(rows[-1], flush=True)
        del model
        gc.collect()
    s = setup("gpu", "torch", "triton", "transformers", "cuda", "commit", "date_utc", device=args.device,
              prompt_tokens=PROMPT, decode_steps=args.steps)
    md = "\n\n".join([
        "# One engine step: decode vs mixed (64 or 256 decodes + one 128-token prompt), host vs GPU",
        setup_line(s),
        table("| shape | batch | mode | decode wall ms | decode GPU ms | decode host ms (wall - GPU) | mixed wall ms | "
              "mixed GPU ms | mixed / decode wall | back-to-back decode ms | its GPU ms | replays decode/mixed/eager |",
              rows),
        "Wall: one `engine.step()` call end to end, the device idle before and after it. GPU: the device time of the "
        "step's forward, CUDA events (sampling excluded). Back-to-back decode: the wall time of consecutive decode "
        "steps with no sync between them, per step: with async scheduling the host prepares step N + 1 while the "
        "device runs step N. Target (issue 16): a mixed step <= 1.5x a decode step.",
        "## The chunk sweep: B decodes plus one prompt of P tokens in one step",
        table("| shape | batch | mode | P prompt tokens | step wall ms | step GPU ms | step / decode wall | "
              "prompt tok/s "
              "(P / (step - decode)) |", chunk_rows),
        "What a step with a prefill chunk of P tokens costs the B decodes riding along (their inter-token latency "
        "that step), and how fast prompts are prefilled at that chunk size: the default --max-prefill-tokens is "
        "picked from this table (docs/engine.md).",
    ])
    write_report(args.out, "bench_step", md, dict(setup=s, rows=results))


if __name__ == "__main__":
    main()
