"""``lorakit serve`` under traffic that looks like a service's: Poisson arrivals, ShareGPT-like lengths, 16 adapters
of Zipf popularity and a share of base-model requests, replayed open-loop through the official ``openai`` client;
then the same trace with every request on the base model, in the same run, on the same server.

The trace (fixed seed, so two runs replay the same requests):
  * arrivals: a Poisson process of ``--rate`` requests/s (exponential gaps), ``--requests`` of them;
  * prompt tokens: lognormal, median 256, sigma 1.0, rounded and clipped to [16, 2048] (mean ~400, ~2% at 2048);
  * output tokens: lognormal, median 160, sigma 0.8, clipped to [16, 512] (mean ~200, ~7% at 512). Both have the
    long right tail of ShareGPT's conversations; the report states the trace's own means and medians;
  * model: the base with probability 0.2, else adapter k (k = 1..16) with probability proportional to 1/k (Zipf,
    s = 1): the hottest takes 24% of all requests, the 8 coldest together 16%, and with ``--max-loras 8`` those
    keep taking slots from the others.
Prompts are random token ids of exactly that length (``/v1/completions`` takes a list of ids as ``prompt``); each
output is exactly its length (``max_tokens`` with ``ignore_eos``), greedy. Each request is sent at its arrival
time whatever earlier ones are doing (open loop), so a server that falls behind builds a queue, as a real one does.

The model is random weights of a shape (``--model-shape``: Llama-3-8B, default, or SmolLM2-135M; ``--tiny``: hidden
64, 2 layers, for a CPU smoke run), saved as a folder with a word-level tokenizer (one word per token id, see
``common.word_tokenizer``), and 16 random adapters of ranks 8, 16, 32 and 64 on all 7 projections, all registered
at startup. ``--cache DIR`` keeps them between runs (the 8B folder is 16 GB and takes a minute to write).

Measured per workload (16 adapters, base only), client side: output tokens/s and requests/s over the run (first
arrival to last token), time to first token from the arrival (p50 / p99), inter-token latency, the time between
two streamed chunks of one request (p50 / p99 and their ratio; the server streams one chunk per engine output, and
the report gives tokens per chunk to show when chunks carry more than one token). Server side, the difference of
/metrics scraped before and after: engine steps, wall seconds inside steps and, where the server has it,
``lorakit_engine_gpu_seconds`` (device time of the steps): the GPU busy fraction (GPU seconds / run duration) and
the host time per step ((step seconds - GPU seconds) / steps); and the mean of ``lorakit_requests_running`` sampled
every 0.5 s. A request that fails (an HTTP error, an error event, fewer tokens than asked) is counted and its error
kept in the report, never dropped; the script exits 1 if any failed.

While the server keeps up, output tokens/s is the offered load in both workloads and the cost of adapters shows in
latency and in requests running; for a capacity ratio, offer more than it serves (``--rate inf``: all at once). The
server refuses (429) a request beyond ``--max-concurrent`` (256) in flight, counted here as failed: with more
requests than that waiting, raise it through ``--extra-serve-args``. Requests running ~ rate x mean time per request
(Little's law): scale ``--rate`` by the target over the reported mean.

    PYTHONPATH=src python bench/bench_traffic.py --out DIR [--rate 14] [--requests 1000] [--cache DIR]
    PYTHONPATH=src python bench/bench_traffic.py --out DIR --model-shape smollm2 --rate 10 --extra-serve-args=--compile
    PYTHONPATH=src python bench/bench_traffic.py --out DIR --tiny --device cpu --requests 6   # a smoke run
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import torch
import transformers
from common import (SMOLLM2_135M, arg_parser, fmt, lorakit_server, make_model, parse_args, parse_metrics, setup,
                    setup_line, table, word_tokenizer, write_adapter, write_report)  # bench/ is on sys.path when this file runs as a script

PROMPT_TOKENS = dict(median=256, sigma=1.0, low=16, high=2048)
OUTPUT_TOKENS = dict(median=160, sigma=0.8, low=16, high=512)
ADAPTERS, RANKS, BASE_SHARE, MAX_LORAS = 16, (8, 16, 32, 64), 0.2, 8
BASE = "base"
SAMPLE_S = 0.5  # how often the running-requests gauge is read during a run
CONTEXT = 4096  # max_position_embeddings of every saved model: room for the longest prompt + output (2560)


def adapter_name(k: int) -> str:
    return f"lora{k:02d}"


# ------------------------------------------------------------ the trace


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the run's start
    prompt: list[int]
    output_tokens: int
    adapter: int | None  # 0..ADAPTERS-1 (0 the hottest), None for the base model


def lognormal_tokens(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def make_trace(requests: int, rate: float, vocab_size: int, seed: int = 0) -> list[Arrival]:
    """``requests`` arrivals of a Poisson process of ``rate``/s (rate inf: all at 0), as the module docstring says."""
    rng = random.Random(seed)
    zipf = [1 / k for k in range(1, ADAPTERS + 1)]
    trace, at = [], 0.0
    for _ in range(requests):
        at += rng.expovariate(rate) if math.isfinite(rate) else 0.0
        prompt_len = lognormal_tokens(rng, **PROMPT_TOKENS)
        output_len = lognormal_tokens(rng, **OUTPUT_TOKENS)
        adapter = None if rng.random() < BASE_SHARE else rng.choices(range(ADAPTERS), weights=zipf)[0]
        prompt = [rng.randrange(1, vocab_size) for _ in range(prompt_len)]  # id 0 is the tokenizer's eos
        trace.append(Arrival(at, prompt, output_len, adapter))
    return trace


def trace_stats(trace: list[Arrival]) -> dict:
    prompts, outputs = [len(a.prompt) for a in trace], [a.output_tokens for a in trace]
    span = trace[-1].at - trace[0].at
    return dict(requests=len(trace), span_s=span, arrivals_per_s=(len(trace) - 1) / span if span else math.inf,
                prompt_mean=statistics.mean(prompts), prompt_median=statistics.median(prompts),
                output_mean=statistics.mean(outputs), output_median=statistics.median(outputs),
                base_share=sum(a.adapter is None for a in trace) / len(trace),
                hottest_share=sum(a.adapter == 0 for a in trace) / len(trace),
                cold_share=sum(a.adapter is not None and a.adapter >= MAX_LORAS for a in trace) / len(trace))


# -------------------------------------------- the model and its adapters


def write_model(shape: str, tiny: bool, device: str, folder: Path) -> Path:
    """A random-weight model of ``shape`` with a word-level tokenizer in FOLDER/model, and the adapters in
    FOLDER/lora00 ..; reused when FOLDER holds a finished one (its "complete" marker is written last), rewritten
    from scratch otherwise."""
    if (folder / "complete").is_file():
        return folder / "model"
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted run left
    torch.manual_seed(0)
    if tiny or shape == "llama8b":
        model = make_model(2 if tiny else 32, tiny, device)
    else:
        config = transformers.LlamaConfig(**SMOLLM2_135M)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32 if device == "cpu" else torch.bfloat16).eval()
    model.config.max_position_embeddings = CONTEXT
    for k in range(ADAPTERS):
        write_adapter(model, folder / adapter_name(k), RANKS[k % len(RANKS)], seed=k)
    model.save_pretrained(folder / "model")
    word_tokenizer(model.config.vocab_size).save_pretrained(folder / "model")
    del model  # the server is to have the device's memory
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    (folder / "complete").touch()
    return folder / "model"


# ------------------------------------------------------------ a replay


async def one_request(client: openai.AsyncOpenAI, arrival: Arrival, model: str, start: float) -> dict:
    """Sends ``arrival`` at ``start + arrival.at`` (perf_counter seconds) and reads its stream; never raises: a
    failure is the record's ``error``."""
    await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
    sent = time.perf_counter()
    chunks, tokens = [], None
    try:
        stream = await client.completions.create(
            model=model, prompt=arrival.prompt, max_tokens=arrival.output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                chunks.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        error = None if tokens == arrival.output_tokens else (
            f"{tokens} tokens of {arrival.output_tokens} asked for" if tokens is not None else "no usage chunk")
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        error = f"{type(e).__name__}: {e}"[:400]
    return dict(arrival=start + arrival.at, late=sent - (start + arrival.at), chunks=chunks, tokens=tokens or 0,
                error=error)


async def sample_gauges(http: httpx.AsyncClient, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            m = parse_metrics((await http.get("/metrics")).text)
            samples.append((m["lorakit_requests_running"], m["lorakit_queue_length"]))
        except (httpx.HTTPError, KeyError):
            pass  # a missed sample; the mean is over the ones read
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except asyncio.TimeoutError:
            pass


async def replay(url: str, trace: list[Arrival], models: list[str]) -> tuple[list[dict], dict, dict, list, float]:
    """Every request of ``trace`` on ``models[i]``, each at its time: (records, /metrics before, after, gauge
    samples, the run's start in perf_counter seconds)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http, openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=3600,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=3600)) as client:
        before = parse_metrics((await http.get("/metrics")).text)
        samples, stop = [], asyncio.Event()
        sampler = asyncio.ensure_future(sample_gauges(http, samples, stop))
        start = time.perf_counter() + 0.05
        records = await asyncio.gather(*(one_request(client, a, m, start) for a, m in zip(trace, models)))
        stop.set()
        await sampler
        after = parse_metrics((await http.get("/metrics")).text)
    return records, before, after, samples, start


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank; None for no values."""
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else None


def summarize(workload: str, records: list[dict], before: dict, after: dict, samples: list, start: float) -> dict:
    ok = [r for r in records if r["error"] is None]
    end = max((r["chunks"][-1] for r in records if r["chunks"]), default=start)
    duration = end - start
    ttft = [r["chunks"][0] - r["arrival"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tokens = sum(r["tokens"] for r in ok)
    steps = int(after["lorakit_engine_steps"] - before["lorakit_engine_steps"])
    step_s = after["lorakit_engine_step_seconds"] - before["lorakit_engine_step_seconds"]
    gpu_s = (after["lorakit_engine_gpu_seconds"] - before["lorakit_engine_gpu_seconds"]
             if "lorakit_engine_gpu_seconds" in after else None)  # absent from servers without it
    p50, p99 = pct(itl, 0.5), pct(itl, 0.99)
    return dict(
        workload=workload, requests=len(records), failed=len(records) - len(ok), duration_s=duration,
        output_tokens=tokens, tokens_per_s=tokens / duration, requests_per_s=len(ok) / duration,
        ttft_p50_ms=_ms(pct(ttft, 0.5)), ttft_p99_ms=_ms(pct(ttft, 0.99)), itl_p50_ms=_ms(p50), itl_p99_ms=_ms(p99),
        itl_p99_over_p50=p99 / p50 if p50 else None,
        tokens_per_chunk=tokens / max(1, sum(len(r["chunks"]) for r in ok)),
        late_max_ms=_ms(max(r["late"] for r in records)),
        running_mean=statistics.mean(s[0] for s in samples) if samples else None,
        running_max=max(s[0] for s in samples) if samples else None,
        waiting_mean=statistics.mean(s[1] for s in samples) if samples else None,
        engine_steps=steps, step_seconds=step_s, step_ms=_ms(step_s / steps) if steps else None, gpu_seconds=gpu_s,
        gpu_busy=gpu_s / duration if gpu_s is not None else None,
        host_ms_per_step=_ms((step_s - gpu_s) / steps) if gpu_s is not None and steps else None,
        errors=sorted({r["error"] for r in records if r["error"]})[:20])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


async def warm_up(url: str, vocab_size: int) -> None:
    """A few short requests (the base and the 8 hottest adapters) and one of the longest prompt, so kernels and
    slots are ready before the first timed request; any failure stops the run."""
    warm = [Arrival(0.0, [1 + i % (vocab_size - 1) for i in range(64)], 8, k) for k in (None, *range(MAX_LORAS))]
    warm.append(Arrival(0.0, [1 + i % (vocab_size - 1) for i in range(PROMPT_TOKENS["high"])], 4, None))
    records, *_ = await replay(url, warm, [BASE if a.adapter is None else adapter_name(a.adapter) for a in warm])
    if any(r["error"] for r in records):
        raise RuntimeError(f"the warm-up failed: {[r['error'] for r in records if r['error']]}")


# ---------------------------------------------------------------- main


def report(args, meta: dict, stats: dict, rows: list[dict], ratio: float | None) -> str:
    head = ("| workload | requests | failed | duration s | out tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
            "| ITL p99 ms | ITL p99/p50 | tok/chunk | running mean | running max | waiting mean | steps | step ms "
            "| GPU busy | host ms/step |")
    cells = ([r["workload"], r["requests"], r["failed"], fmt(r["duration_s"]), fmt(r["tokens_per_s"], ".0f"),
              fmt(r["requests_per_s"], ".2f"), fmt(r["ttft_p50_ms"]), fmt(r["ttft_p99_ms"]),
              fmt(r["itl_p50_ms"], ".2f"), fmt(r["itl_p99_ms"], ".2f"), fmt(r["itl_p99_over_p50"], ".2f"),
              fmt(r["tokens_per_chunk"], ".2f"), fmt(r["running_mean"]), fmt(r["running_max"], ".0f"),
              fmt(r["waiting_mean"]), r["engine_steps"],
              fmt(r["step_ms"], ".2f"), "n/a" if r["gpu_busy"] is None else fmt(r["gpu_busy"], ".2f"),
              "n/a" if r["host_ms_per_step"] is None else fmt(r["host_ms_per_step"], ".2f")] for r in rows)
    s = stats
    lines = [f"# bench_traffic: lorakit serve, {meta['model']} shape (random weights), {ADAPTERS} adapters "
             f"(ranks {'/'.join(map(str, RANKS))}), --max-loras {MAX_LORAS}", "", setup_line(meta) + ".", "",
             f"Trace (seed {args.seed}): {s['requests']} requests, Poisson at {args.rate} req/s (arrived over "
             f"{s['span_s']:.1f} s); prompt tokens mean {s['prompt_mean']:.0f}, median {s['prompt_median']:.0f} "
             f"(16-2048); output tokens mean {s['output_mean']:.0f}, median {s['output_median']:.0f} (16-512, "
             f"ignore_eos, greedy); base model {s['base_share']:.0%} of requests, hottest adapter "
             f"{s['hottest_share']:.0%}, the {ADAPTERS - MAX_LORAS} coldest {s['cold_share']:.0%}. Workload 'base': "
             f"the same trace, every request on the base model. Server: `lorakit serve {meta['serve_args']}`.", "",
             table(head, cells), "",
             f"Output tokens/s, 16 adapters / base: {fmt(ratio, '.3f')} (target >= 0.85; equal to 1 by construction "
             f"while the server keeps up with the offered load). TTFT from the request's arrival time; ITL between "
             f"streamed chunks; steps, step ms, GPU busy (forwards' device time / duration) and host ms/step "
             f"(step ms - forward ms: what the device does not hide) from /metrics (n/a where the server reports no "
             f"lorakit_engine_gpu_seconds, as on a CPU); running / waiting: lorakit_requests_running / "
             f"lorakit_queue_length every {SAMPLE_S} s."]
    for r in rows:
        if r["errors"]:
            lines += ["", f"Errors ({r['workload']}, {r['failed']} failed):", *(f"- {e}" for e in r["errors"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--rate", type=float, default=14.0, help="arrivals per second (inf: all at once)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-shape", choices=("llama8b", "smollm2"), default="llama8b")
    p.add_argument("--cache", type=Path, help="keep the model and adapters here between runs (default: a temp dir)")
    p.add_argument("--extra-serve-args", default="", help="more `lorakit serve` flags, one string: "
                   "--extra-serve-args='--compile --max-num-seqs 128'")
    p.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds the server may take to start")
    args = parse_args(p, argv)
    shape = "tiny" if args.tiny else args.model_shape

    with tempfile.TemporaryDirectory() as tmp:
        folder = (args.cache or Path(tmp)) / f"bench_traffic_{shape}"
        started = time.perf_counter()
        model_dir = write_model(args.model_shape, args.tiny, args.device, folder)
        print(f"model and adapters in {folder} ({time.perf_counter() - started:.0f} s)", flush=True)
        vocab_size = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        settings = ["--served-model-name", BASE, "--device", args.device, "--max-loras", str(MAX_LORAS),
                    *shlex.split(args.extra_serve_args)]
        loras = [f"--lora={adapter_name(k)}={folder / adapter_name(k)}" for k in range(ADAPTERS)]
        trace = make_trace(args.requests, args.rate, vocab_size, args.seed)
        workloads = [("16 adapters", [BASE if a.adapter is None else adapter_name(a.adapter) for a in trace]),
                     ("base", [BASE] * len(trace))]
        rows = []
        log = args.out / "bench_traffic_server.log"
        with lorakit_server(["--model", str(model_dir), *loras, *settings], log, args.ready_timeout) as url:
            asyncio.run(warm_up(url, vocab_size))
            for workload, models in workloads:
                rows.append(summarize(workload, *asyncio.run(replay(url, trace, models))))
                print({k: v for k, v in rows[-1].items() if k != "errors"}, flush=True)

    facts = ("gpu", "torch", "triton", "transformers", *(("cuda",) if args.device == "cuda" else ()), "commit",
             "date_utc")
    first, last = adapter_name(0), adapter_name(ADAPTERS - 1)
    shown = ["--model", "DIR/model", f"--lora={first}=DIR/{first}", "...", f"--lora={last}=DIR/{last}", *settings]
    meta = setup(*facts, device=args.device, model=shape, rate=args.rate, requests=args.requests, seed=args.seed,
                 serve_args=shlex.join(shown))
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"] if rows[1]["tokens_per_s"] else None
    stats = trace_stats(trace)
    write_report(args.out, "bench_traffic", report(args, meta, stats, rows, ratio),
                 {"meta": meta, "trace": stats, "rows": rows, "adapters_over_base_tokens_per_s": ratio})
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
