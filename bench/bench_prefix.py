"""Prefix caching: time to first token and prompt tokens computed, the cache on vs off (Llama-3-8B shape).

Two workloads, each run by an engine with the prefix cache on and by one with it off (same model, same arrivals):

- shared prompt: one 1,024-token system prompt and a 64-token user turn per request, over 16 rank-16 adapters
  (request i on adapter i mod 16), arriving at each of ``--rates`` requests/s (fixed gaps), 16 output tokens each.
  An adapter's LoRA changes every layer's keys and values, so each adapter computes the system prompt once (its
  first request misses) and its later requests hit;
- aLoRA: one 2,048-token conversation sent at once to the base model and to 8 activated-LoRA adapters (the
  conversation + each adapter's 4 invocation tokens), 4 output tokens each: the conversation is computed once.

TTFT: wall clock from ``add_request`` to the step output carrying the request's first token (in-process engine,
CUDA graphs, async scheduling; each engine first runs both shapes on other tokens, untimed). At a low rate most
requests find the engine idle and TTFT is the request's own step; at a higher one a request waits out the step in
flight and the one already scheduled, which the cache cannot shorten. Both rates stay below what the engine
sustains with the cache off (an overloaded queue would make any TTFT ratio a matter of run length). Steps and device
milliseconds per step come from the runner's CUDA events. Prompt tokens computed: ``scheduler.computed_prompt_tokens``.

Greedy tokens are not compared here: random bf16 weights give near-tied logits, so the cache's different (and
equally valid) batch shapes flip ties. tests/test_prefix_cache_gpu.py checks token equality on the GPU in float32.

    PYTHONPATH=src python bench/bench_prefix.py --out DIR [--rates 2 8] [--requests 96]
    PYTHONPATH=src python bench/bench_prefix.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import arg_parser, fmt, make_model, parse_args, setup, setup_line, table, write_adapter, write_report

from lorakit.engine import Engine, SamplingParams


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def drive(engine: Engine, arrivals: list[tuple[float, list[int], str | None, int]]) -> dict:
    """Feed ``arrivals`` (seconds after start, prompt, adapter, max_tokens) and step until all finish: TTFTs."""
    pending, added, first, tokens = list(arrivals), {}, {}, {}
    computed = engine.scheduler.computed_prompt_tokens
    runner = engine.runner
    runner.poll()
    gpu_seconds, steps = runner.gpu_seconds, runner.timed_steps
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, prompt, adapter, max_tokens = pending.pop(0)
            rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                     adapter)
            added[rid], tokens[rid] = time.perf_counter(), []
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(pending[0][0] - now, 0.001)))
            continue
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            tokens[out.request_id] += out.token_ids
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    runner.poll()
    steps = runner.timed_steps - steps
    ttft = [1e3 * (first[r] - added[r]) for r in added]
    return dict(requests=len(added), ttft_p50_ms=percentile(ttft, 0.5), ttft_p99_ms=percentile(ttft, 0.99),
                ttft_mean_ms=statistics.fmean(ttft), prompt_tokens=sum(len(a[1]) for a in arrivals),
                computed_prompt_tokens=engine.scheduler.computed_prompt_tokens - computed,
                seconds=time.perf_counter() - start, steps=steps,
                gpu_ms_per_step=1e3 * (runner.gpu_seconds - gpu_seconds) / steps if steps else float("nan"))


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0],
                   help="arrivals per second of the shared-prompt workload, one run each")
    p.add_argument("--requests", type=int, default=96, help="requests of the shared-prompt workload")
    args = parse_args(p, argv)
    tiny, device = args.tiny, args.device
    layers = 2 if tiny else 32
    system_len, turn_len, conv_len = (64, 8, 128) if tiny else (1024, 64, 2048)
    n_adapters, n_alora, invocation_len = 16, 8, 4
    gen = torch.Generator().manual_seed(0)
    vocab = 256 if tiny else 128256

    def tokens(n: int) -> list[int]:
        return torch.randint(1000 if not tiny else 20, vocab, (n,), generator=gen).tolist()

    shared = {}
    for rate in args.rates:  # a system prompt of its own per rate: one run's blocks are no hits for the next
        system = tokens(system_len)
        shared[rate] = [(i / rate, system + tokens(turn_len), f"u{i % n_adapters}", 16) for i in range(args.requests)]
    conversation = tokens(conv_len)
    invocations = [[10 + 4 * k + j for j in range(invocation_len)] for k in range(n_alora)]  # ids < 1000: unique
    alora = [(0.0, conversation, None, 4)] + [(0.0, conversation + invocations[k], f"al{k}", 4) for k in range(n_alora)]
    # Each engine first runs both workloads' shapes with other tokens, untimed: Triton compiles its kernels for each
    # new specialization on first use (seconds each), which the first engine alone would otherwise pay.
    other = tokens(system_len)
    warmup = [(0.0, other + tokens(turn_len), f"u{i}", 2) for i in range(n_adapters)]
    warmup += [(0.0, tokens(conv_len) + invocations[k], f"al{k}", 2) for k in range(n_alora)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = make_model(layers, tiny, device)
        model.config.max_position_embeddings = 4096  # LlamaConfig's default (2048) is below the conversation + reply
        folders = {f"u{i}": write_adapter(model, Path(tmp) / f"u{i}", 16, seed=i) for i in range(n_adapters)}
        folders |= {f"al{k}": write_adapter(model, Path(tmp) / f"al{k}", 16, seed=100 + k, task_type="CAUSAL_LM",
                                            alora_invocation_tokens=invocations[k]) for k in range(n_alora)}
        for cache in (False, True):
            if model is None:
                torch.manual_seed(0)
                model = make_model(layers, tiny, device)
                model.config.max_position_embeddings = 4096
            engine = Engine(model, max_loras=24, max_rank=16, max_num_seqs=64, max_seq_len=conv_len + 64,
                            max_num_batched_tokens=2048, prefix_cache=cache, adapters=folders)
            drive(engine, warmup)
            runs = [(f"shared 1,024-token prompt, 16 adapters, {rate:g}/s", arrivals) for rate, arrivals in shared.items()]
            runs.append(("2,048-token conversation, base + 8 aLoRA, at once", alora))
            for workload, arrivals in runs:
                result = drive(engine, arrivals)
                rows.append(dict(workload=workload, prefix_cache="on" if cache else "off", **result))
                print(rows[-1], flush=True)
            engine = model = None
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    for r in rows:
        off = next(o for o in rows if o["workload"] == r["workload"] and o["prefix_cache"] == "off")
        r["ttft_p50_off_over_on"] = off["ttft_p50_ms"] / r["ttft_p50_ms"]
        r["computed_off_over_on"] = off["computed_prompt_tokens"] / r["computed_prompt_tokens"]
    s = setup("device", "torch", "commit", "date_utc", device=device, layers=layers, rates=args.rates,
              requests=args.requests)
    head = ("| workload | prefix cache | requests | TTFT p50 (ms) | TTFT p99 (ms) | steps | device ms / step | "
            "prompt tokens | computed | TTFT p50 off / on | computed off / on |")
    body = table(head, ([r["workload"], r["prefix_cache"], r["requests"], fmt(r["ttft_p50_ms"]), fmt(r["ttft_p99_ms"]),
                         r["steps"], fmt(r["gpu_ms_per_step"], ".2f"), r["prompt_tokens"], r["computed_prompt_tokens"],
                         fmt(r["ttft_p50_off_over_on"], ".2f"), fmt(r["computed_off_over_on"], ".2f")] for r in rows))
    report = (f"# Prefix caching: Llama-3-8B shape ({layers} layers), random bf16 weights\n\n{setup_line(s)}; "
              f"{args.requests} shared-prompt requests per rate, in-process engine, CUDA graphs.\n\n{body}")
    write_report(args.out, "bench_prefix", report, dict(setup=s, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
