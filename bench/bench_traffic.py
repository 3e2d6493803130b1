"""``lorakit serve`` under traffic that looks like a service's: Poisson arrivals, ShareGPT-like lengths, 16 adapters
of Zipf popularity and a share of base-model requests, replayed open-loop through the official ``openai`` client;
then the same trace with every request on the base model, in the same run, on the same server; and that at each
rate of ``--rate`` (a comma-separated list), one server start serving them all.

The trace (fixed seed, so two runs replay the same requests; the same requests at every rate, only their arrival
times differ):
  * arrivals: a Poisson process of each rate's requests/s (exponential gaps of mean 1 s divided by the rate; rate
    inf: all at once), ``--requests`` of them;
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

Measured per replay (a rate and a workload: 16 adapters, base only), client side: output tokens/s and requests/s
over the run (first arrival to last token), time to first token from the arrival (p50 / p99), inter-token latency,
the time between two streamed chunks of one request (p50 / p99 and their ratio; the server streams one chunk per
engine output, and the report gives tokens per chunk to show when chunks carry more than one token); goodput, the
requests per second that met the SLO (TTFT <= ``--slo-ttft-s``, 2, and the request's own ITL p99 <=
``--slo-itl-ms``, 100) and the fraction of all requests that did (a refused or failed one did not). Server side, the
difference of /metrics scraped before and after: engine steps, wall seconds inside steps and, where the server
times the device, ``lorakit_engine_gpu_seconds`` (device time of the steps): the GPU busy fraction (GPU seconds /
run duration) and the host time per step ((step seconds - GPU seconds) / steps); and the mean of
``lorakit_requests_running`` sampled every 0.5 s. Before a replay starts and before its "after" is scraped, the
server is let drain: until its /metrics show no request running (``lorakit_requests_running``) or waiting
(``lorakit_queue_length``), so one replay's tail neither runs into the next nor escapes its own counts.

A request the server answers 429 (an HTTP status, its ``Retry-After`` noted; or an error event of code 429 in a
stream already started) is counted as refused; any other failure (an HTTP error, an error event, fewer tokens than
asked) as failed; every error is kept in the report, never dropped; the script exits 1 if any request failed
(refusals are the server's answer to overload, reported against the targets, not a failure of the run).

Per rate the report gives the 16-adapter workload's output tokens/s over the base's and checks the targets: at a
finite rate, ITL p99 <= 3x ITL p50 and TTFT p50 <= 300 ms (the headline numbers there: the issue states them at
8 req/s); at rate inf, 16 adapters >= 0.85 of base tok/s, GPU busy >= 0.9, host ms/step <= 1 and no request
refused (in either workload). While the server keeps up, output tokens/s is the offered load in both workloads and
the cost of adapters shows in latency and in requests running; for a capacity ratio, offer more than it serves
(``--rate inf``: all at once). The server refuses (429) a request only past what its KV cache can queue
(``--max-queued-tokens``, ``--max-concurrent``: by default 4x the cache's tokens, 16x ``--max-num-seqs`` sequences);
a 429 is counted as refused. Requests running ~ rate x mean time per
request (Little's law): scale the rate by the target over the reported mean.

    PYTHONPATH=src python bench/bench_traffic.py --out DIR [--rate inf,8] [--requests 1000] [--cache DIR]
    PYTHONPATH=src python bench/bench_traffic.py --out DIR --model-shape smollm2 --rate 10 --extra-serve-args=--compile
    PYTHONPATH=src python bench/bench_traffic.py --out DIR --tiny --device cpu --rate inf,4 --requests 6  # a smoke run
"""

from __future__ import annotations

import argparse
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

# bench/ is on sys.path when this file runs as a script
from common import (SMOLLM2_135M, arg_parser, fmt, lorakit_server, make_model, parse_args, parse_metrics, setup,
                    setup_line, table, word_tokenizer, write_adapter, write_report)

PROMPT_TOKENS = {"median": 256, "sigma": 1.0, "low": 16, "high": 2048}
OUTPUT_TOKENS = {"median": 160, "sigma": 0.8, "low": 16, "high": 512}
ADAPTERS, RANKS, BASE_SHARE, MAX_LORAS = 16, (8, 16, 32, 64), 0.2, 8
BASE = "base"
SAMPLE_S = 0.5  # how often the running-requests gauge is read during a run
DRAIN_S = 120.0  # the longest wait for the server to report nothing running or waiting
CONTEXT = 4096  # max_position_embeddings of every saved model: room for the longest prompt + output (2560)

# The targets, checked on the 16-adapter workload of each rate: (what, with {} for the bound; the key of its value;
# <= or >=; the bound; the value's format). "ratio" is 16 adapters / base output tok/s, "refused_both" the
# refusals of both workloads.
FINITE_RATE_TARGETS = (("ITL p99 / p50 <= {:g}", "itl_p99_over_p50", "<=", 3.0, ".2f"),
                       ("TTFT p50 <= {:g} ms", "ttft_p50_ms", "<=", 300.0, ".1f"))
BURST_TARGETS = (("output tok/s >= {:g} of the base's", "ratio", ">=", 0.85, ".3f"),
                 ("GPU busy >= {:g}", "gpu_busy", ">=", 0.9, ".2f"),
                 ("host ms/step <= {:g}", "host_ms_per_step", "<=", 1.0, ".2f"),
                 ("no request refused (in either workload)", "refused_both", "<=", 0, "d"))
VERDICT = {True: "met", False: "**not met**", None: "not known"}  # None: no value (GPU busy on a CPU)


def adapter_name(k: int) -> str:
    return f"lora{k:02d}"


def rate_list(text: str) -> list[float]:
    """``--rate``'s value: comma-separated arrivals per second, each > 0 ("inf": all at once)."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers or inf, got {text!r}") from None
    if not all(r > 0 for r in rates):  # nan is not > 0 either
        raise argparse.ArgumentTypeError(f"every rate must be > 0, got {text!r}")
    return rates


def rate_name(rate: float | str) -> str:
    return f"{float(rate):g}"  # 8, 0.5, inf; of a float or of its JSON value (rate_value)


def rate_value(rate: float) -> float | str:
    """A rate as the JSON holds it: a number, or "inf" (JSON has no infinity)."""
    return rate if math.isfinite(rate) else "inf"


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
    """``requests`` arrivals of a Poisson process of ``rate``/s (rate inf: all at 0), as the module docstring says.
    The gap is drawn at every rate, inf too, so a seed gives the same requests at every rate."""
    rng = random.Random(seed)
    zipf = [1 / k for k in range(1, ADAPTERS + 1)]
    trace, at = [], 0.0
    for _ in range(requests):
        at += rng.expovariate(1.0) / rate  # 0 at rate inf
        prompt_len = lognormal_tokens(rng, **PROMPT_TOKENS)
        output_len = lognormal_tokens(rng, **OUTPUT_TOKENS)
        adapter = None if rng.random() < BASE_SHARE else rng.choices(range(ADAPTERS), weights=zipf)[0]
        prompt = [rng.randrange(1, vocab_size) for _ in range(prompt_len)]  # id 0 is the tokenizer's eos
        trace.append(Arrival(at, prompt, output_len, adapter))
    return trace


def trace_stats(trace: list[Arrival]) -> dict:
    """What the requests are; the same at every rate (the arrival span is each rate's)."""
    prompts, outputs = [len(a.prompt) for a in trace], [a.output_tokens for a in trace]
    return {"requests": len(trace), "prompt_mean": statistics.mean(prompts),
            "prompt_median": statistics.median(prompts), "output_mean": statistics.mean(outputs),
            "output_median": statistics.median(outputs),
            "base_share": sum(a.adapter is None for a in trace) / len(trace),
            "hottest_share": sum(a.adapter == 0 for a in trace) / len(trace),
            "cold_share": sum(a.adapter is not None and a.adapter >= MAX_LORAS for a in trace) / len(trace)}


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
    failure is the record's ``error``, and ``refused`` whether it was a 429."""
    await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
    sent = time.perf_counter()
    chunks, tokens, refused = [], None, False
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
    except openai.APIStatusError as e:  # an HTTP error status
        retry = e.response.headers.get("retry-after")
        error = f"{type(e).__name__}: {e}"[:400] + (f" (Retry-After: {retry})" if retry is not None else "")
        refused = e.status_code == 429
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        error = f"{type(e).__name__}: {e}"[:400]
        # an error event once the stream had started; openai keeps its code as a str
        refused = isinstance(e, openai.APIError) and str(e.code) == "429"
    return {"arrival": start + arrival.at, "late": sent - (start + arrival.at), "chunks": chunks,
            "tokens": tokens or 0, "error": error, "refused": refused}


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


async def drain(http: httpx.AsyncClient) -> float | None:
    """Seconds until the server's /metrics show no request running or waiting; None if they still did after
    DRAIN_S (the run goes on, and the report says so)."""
    started = time.perf_counter()
    while time.perf_counter() - started < DRAIN_S:
        m = parse_metrics((await http.get("/metrics")).text)
        if m["lorakit_requests_running"] == 0 and m["lorakit_queue_length"] == 0:
            return time.perf_counter() - started
        await asyncio.sleep(0.1)
    return None


@dataclass
class Replay:
    records: list[dict]
    before: dict  # /metrics, once the server had drained before the first request
    after: dict  # /metrics, once it had drained after the last
    samples: list  # (running, waiting) every SAMPLE_S
    start: float  # the run's start, perf_counter seconds
    drain_s: float | None  # how long the server took to drain after the last request's end (None: not in DRAIN_S)


async def replay(url: str, trace: list[Arrival], models: list[str]) -> Replay:
    """Every request of ``trace`` on ``models[i]``, each at its time, between two drains of the server."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http, openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=3600,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=3600)) as client:
        if await drain(http) is None:
            print(f"the server still had requests running or waiting after {DRAIN_S:.0f} s; starting anyway",
                  flush=True)
        before = parse_metrics((await http.get("/metrics")).text)
        samples, stop = [], asyncio.Event()
        sampler = asyncio.ensure_future(sample_gauges(http, samples, stop))
        start = time.perf_counter() + 0.05
        records = await asyncio.gather(*(one_request(client, a, m, start) for a, m in zip(trace, models)))
        stop.set()
        await sampler
        drain_s = await drain(http)  # the counters of its last steps reach /metrics when the engine goes idle
        after = parse_metrics((await http.get("/metrics")).text)
    return Replay(records, before, after, samples, start, drain_s)


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank; None for no values."""
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else None


def gaps(record: dict) -> list[float]:
    """Seconds between a request's streamed chunks."""
    return [b - a for a, b in zip(record["chunks"], record["chunks"][1:])]


def meets_slo(record: dict, ttft_s: float, itl_s: float) -> bool:
    """Whether a request succeeded, its first token came within ``ttft_s`` of its arrival and its own ITL p99 is
    within ``itl_s`` (a request of one chunk has no ITL to miss)."""
    return (record["error"] is None and bool(record["chunks"]) and record["chunks"][0] - record["arrival"] <= ttft_s
            and (pct(gaps(record), 0.99) or 0.0) <= itl_s)


def summarize(rate: float, workload: str, run: Replay, slo_ttft_s: float, slo_itl_s: float) -> dict:
    records, before, after, samples, start = run.records, run.before, run.after, run.samples, run.start
    ok = [r for r in records if r["error"] is None]
    refused = sum(r["refused"] for r in records)
    end = max((r["chunks"][-1] for r in records if r["chunks"]), default=start)
    duration = end - start

    def per_s(n: float) -> float | None:
        return n / duration if duration > 0 else None  # no token streamed at all: no rate

    ttft = [r["chunks"][0] - r["arrival"] for r in ok]
    itl = [g for r in ok for g in gaps(r)]
    met = sum(meets_slo(r, slo_ttft_s, slo_itl_s) for r in records)
    tokens = sum(r["tokens"] for r in ok)
    steps = int(after["lorakit_engine_steps"] - before["lorakit_engine_steps"])
    step_s = after["lorakit_engine_step_seconds"] - before["lorakit_engine_step_seconds"]
    gpu_s = (after["lorakit_engine_gpu_seconds"] - before["lorakit_engine_gpu_seconds"]
             if "lorakit_engine_gpu_seconds" in after else None)
    timed = bool(gpu_s) and steps > 0  # 0 where the server times no device (on a CPU)
    p50, p99 = pct(itl, 0.5), pct(itl, 0.99)
    return {
        "rate": rate_value(rate), "workload": workload, "requests": len(records), "refused": refused,
        "failed": len(records) - len(ok) - refused, "duration_s": duration, "output_tokens": tokens,
        "tokens_per_s": per_s(tokens), "requests_per_s": per_s(len(ok)),
        "goodput_requests_per_s": per_s(met), "slo_met": met / len(records),
        "ttft_p50_ms": _ms(pct(ttft, 0.5)), "ttft_p99_ms": _ms(pct(ttft, 0.99)),
        "itl_p50_ms": _ms(p50), "itl_p99_ms": _ms(p99), "itl_p99_over_p50": p99 / p50 if p50 else None,
        "tokens_per_chunk": tokens / max(1, sum(len(r["chunks"]) for r in ok)),
        "late_max_ms": _ms(max(r["late"] for r in records)),
        "running_mean": statistics.mean(s[0] for s in samples) if samples else None,
        "running_max": max(s[0] for s in samples) if samples else None,
        "waiting_mean": statistics.mean(s[1] for s in samples) if samples else None,
        "engine_steps": steps, "step_seconds": step_s, "step_ms": _ms(step_s / steps) if steps else None,
        "gpu_seconds": gpu_s,
        "gpu_busy": gpu_s / duration if timed and duration > 0 else None,
        "host_ms_per_step": _ms((step_s - gpu_s) / steps) if timed else None, "drain_s": run.drain_s,
        "errors": sorted({r["error"] for r in records if r["error"]})[:20]}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def rate_summary(rate: float, trace: list[Arrival], adapters: dict, base: dict) -> dict:
    """One rate's headline: its arrivals' span, 16 adapters / base output tok/s, and its targets, each with its
    value and whether it was met (None: no value, as GPU busy on a CPU)."""
    ratio = (adapters["tokens_per_s"] / base["tokens_per_s"]
             if adapters["tokens_per_s"] is not None and base["tokens_per_s"] else None)
    values = adapters | {"ratio": ratio, "refused_both": adapters["refused"] + base["refused"]}
    targets = []
    for what, key, op, bound, _ in (FINITE_RATE_TARGETS if math.isfinite(rate) else BURST_TARGETS):
        value = values[key]
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        targets.append({"target": what.format(bound), "value": value, "met": met})
    span = trace[-1].at - trace[0].at
    return {"rate": rate_value(rate), "arrivals_span_s": span,
            "arrivals_per_s": (len(trace) - 1) / span if span else None, "adapters_over_base_tokens_per_s": ratio,
            "targets": targets}


async def warm_up(url: str, vocab_size: int) -> None:
    """A few short requests (the base and the 8 hottest adapters) and one of the longest prompt, so kernels and
    slots are ready before the first timed request; any failure stops the run."""
    warm = [Arrival(0.0, [1 + i % (vocab_size - 1) for i in range(64)], 8, k) for k in (None, *range(MAX_LORAS))]
    warm.append(Arrival(0.0, [1 + i % (vocab_size - 1) for i in range(PROMPT_TOKENS["high"])], 4, None))
    run = await replay(url, warm, [BASE if a.adapter is None else adapter_name(a.adapter) for a in warm])
    if any(r["error"] for r in run.records):
        raise RuntimeError(f"the warm-up failed: {[r['error'] for r in run.records if r['error']]}")


# ---------------------------------------------------------------- main


def report(args, meta: dict, stats: dict, rows: list[dict], rates: list[dict]) -> str:
    head = ("| rate | workload | requests | refused | failed | goodput req/s | SLO met | duration s | out tok/s "
            "| req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL p99/p50 | tok/chunk | running mean "
            "| running max | waiting mean | steps | step ms | GPU busy | host ms/step |")
    cells = ([rate_name(r["rate"]), r["workload"], r["requests"], r["refused"], r["failed"],
              fmt(r["goodput_requests_per_s"], ".2f"), fmt(r["slo_met"], ".0%"), fmt(r["duration_s"]),
              fmt(r["tokens_per_s"], ".0f"), fmt(r["requests_per_s"], ".2f"), fmt(r["ttft_p50_ms"]),
              fmt(r["ttft_p99_ms"]), fmt(r["itl_p50_ms"], ".2f"), fmt(r["itl_p99_ms"], ".2f"),
              fmt(r["itl_p99_over_p50"], ".2f"), fmt(r["tokens_per_chunk"], ".2f"), fmt(r["running_mean"]),
              fmt(r["running_max"], ".0f"), fmt(r["waiting_mean"]), r["engine_steps"], fmt(r["step_ms"], ".2f"),
              "n/a" if r["gpu_busy"] is None else fmt(r["gpu_busy"], ".2f"),
              "n/a" if r["host_ms_per_step"] is None else fmt(r["host_ms_per_step"], ".2f")] for r in rows)
    s = stats
    title = (f"# bench_traffic: lorakit serve, {meta['model']} shape (random weights), {ADAPTERS} adapters "
             f"(ranks {'/'.join(map(str, RANKS))}), --max-loras {args.max_loras}")
    trace = (f"Trace (seed {args.seed}): {s['requests']} requests, the same at every rate, Poisson at "
             f"{', '.join(map(rate_name, args.rate))} req/s (inf: all at once); prompt tokens mean "
             f"{s['prompt_mean']:.0f}, median {s['prompt_median']:.0f} (16-2048); output tokens mean "
             f"{s['output_mean']:.0f}, median {s['output_median']:.0f} (16-512, ignore_eos, greedy); base model "
             f"{s['base_share']:.0%} of requests, hottest adapter {s['hottest_share']:.0%}, the "
             f"{ADAPTERS - MAX_LORAS} coldest {s['cold_share']:.0%}. Workload 'base': the same trace, every request "
             f"on the base model. One server for every rate: `lorakit serve {meta['serve_args']}`; before each "
             f"replay and before its closing /metrics scrape, the server drained (no request running or waiting).")
    legend = (f"SLO: TTFT <= {args.slo_ttft_s:g} s from the request's arrival and the request's own ITL p99 <= "
              f"{args.slo_itl_ms:g} ms (--slo-ttft-s, --slo-itl-ms); goodput: the requests that met it per second "
              f"of the run; SLO met: their share of all requests (refused and failed ones did not). Refused: "
              f"answered 429; failed: any other error. TTFT from the request's arrival time; ITL between streamed "
              f"chunks; steps, step ms, GPU busy (forwards' device time / duration) and host ms/step (step ms - "
              f"forward ms: what the device does not hide) from /metrics (n/a where the server times no device, as "
              f"on a CPU); running / waiting: lorakit_requests_running / lorakit_queue_length every {SAMPLE_S} s.")
    lines = [title, "", setup_line(meta) + ".", "", trace, "", table(head, cells), "", legend]
    for rate, summary in zip(args.rate, rates):
        kept_up = " (1 by construction while the server keeps up)" if math.isfinite(rate) else ""
        ratio = fmt(summary["adapters_over_base_tokens_per_s"], ".3f")
        span = fmt(summary["arrivals_span_s"])
        name = f"{rate_name(rate)} req/s" if math.isfinite(rate) else "inf (all at once)"
        lines += ["", f"Rate {name}, arrivals over {span} s: output tok/s, 16 adapters / base {ratio}{kept_up}. "
                  + "Targets, on 16 adapters:"]
        specs = FINITE_RATE_TARGETS if math.isfinite(rate) else BURST_TARGETS
        for t, (*_, spec) in zip(summary["targets"], specs):
            value = "n/a" if t["value"] is None else fmt(t["value"], spec)
            lines.append(f"- {t['target']}: {value}, {VERDICT[t['met']]}")
    for r in rows:
        if r["drain_s"] is None:
            late = f"{DRAIN_S:.0f} s after the last one ended; its closing /metrics were scraped then"
            lines += ["", f"Rate {rate_name(r['rate'])}, {r['workload']}: requests still running or waiting {late}."]
        if r["errors"]:
            which = f"rate {rate_name(r['rate'])}, {r['workload']}; {r['refused']} refused, {r['failed']} failed"
            lines += ["", f"Errors ({which}):", *(f"- {e}" for e in r["errors"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--rate", type=rate_list, default=[14.0],
                   help="arrivals per second, or several comma-separated (inf: all at once): --rate inf,8")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="the SLO's time to first token, from arrival")
    p.add_argument("--slo-itl-ms", type=float, default=100.0, help="the SLO's bound on a request's own ITL p99")
    p.add_argument("--model-shape", choices=("llama8b", "smollm2"), default="llama8b")
    p.add_argument("--cache", type=Path, help="keep the model and adapters here between runs (default: a temp dir)")
    p.add_argument("--extra-serve-args", default="", help="more `lorakit serve` flags, one string: "
                   "--extra-serve-args='--compile --max-num-seqs 128'")
    p.add_argument("--max-loras", default="auto", help="the server's --max-loras (default: its own, auto)")
    p.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds the server may take to start")
    args = parse_args(p, argv)
    shape = "tiny" if args.tiny else args.model_shape

    with tempfile.TemporaryDirectory() as tmp:
        folder = (args.cache or Path(tmp)) / f"bench_traffic_{shape}"
        started = time.perf_counter()
        model_dir = write_model(args.model_shape, args.tiny, args.device, folder)
        print(f"model and adapters in {folder} ({time.perf_counter() - started:.0f} s)", flush=True)
        vocab_size = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        settings = ["--served-model-name", BASE, "--device", args.device,
                    *(["--max-loras", args.max_loras] if args.max_loras != "auto" else []),
                    *shlex.split(args.extra_serve_args)]
        loras = [f"--lora={adapter_name(k)}={folder / adapter_name(k)}" for k in range(ADAPTERS)]
        rows, rates = [], []
        log = args.out / "bench_traffic_server.log"
        with lorakit_server(["--model", str(model_dir), *loras, *settings], log, args.ready_timeout) as url:
            asyncio.run(warm_up(url, vocab_size))
            for rate in args.rate:
                trace = make_trace(args.requests, rate, vocab_size, args.seed)
                for workload, models in (
                        ("16 adapters", [BASE if a.adapter is None else adapter_name(a.adapter) for a in trace]),
                        ("base", [BASE] * len(trace))):
                    run = asyncio.run(replay(url, trace, models))
                    rows.append(summarize(rate, workload, run, args.slo_ttft_s, args.slo_itl_ms / 1e3))
                    print({k: v for k, v in rows[-1].items() if k != "errors"}, flush=True)
                rates.append(rate_summary(rate, trace, *rows[-2:]))

    facts = ("gpu", "torch", "triton", "transformers", *(("cuda",) if args.device == "cuda" else ()), "commit",
             "date_utc")
    first, last = adapter_name(0), adapter_name(ADAPTERS - 1)
    shown = ["--model", "DIR/model", f"--lora={first}=DIR/{first}", "...", f"--lora={last}=DIR/{last}", *settings]
    meta = setup(*facts, device=args.device, model=shape, rates=[rate_value(r) for r in args.rate],
                 requests=args.requests, seed=args.seed, slo_ttft_s=args.slo_ttft_s, slo_itl_ms=args.slo_itl_ms,
                 serve_args=shlex.join(shown))
    stats = trace_stats(trace)
    write_report(args.out, "bench_traffic", report(args, meta, stats, rows, rates),
                 {"meta": meta, "trace": stats, "rows": rows, "rates": rates})
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
