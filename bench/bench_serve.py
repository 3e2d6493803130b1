"""``lorakit serve`` under load: the bundled SmolLM2-135M-Instruct with its three demo adapters, as the README
starts it (bf16, CUDA graphs), driven over HTTP by concurrent streaming clients.

Each request is a chat completion on one of the four models (the base and the adapters pirate, json and
french, round robin), greedy, ``ignore_eos`` with a fixed ``max_tokens`` so every request produces exactly
that many tokens. Measured per concurrency level: output tokens per second, requests per second, time to
first token (p50 / p99) and time between streamed chunks (p50 / p99). The baseline is the same engine
in-process (``LLM.generate`` on the same prompts and adapters, no HTTP): the ratio says what the server costs.
The server's own engine-step time (from /metrics) tells the engine's share of that from the HTTP side's. The
clients run in one process per 32 of them (at most 8; ``--client-procs``): one Python process parsing every
server-sent event caps what it can measure (runs before this option, up to ce31b5b, used one). The client
processes begin together once all have started, and the wall time runs from then to the last one's end (up to
issue 32's runs it ran from the first process's start, and took in the spread of their start-ups).

    PYTHONPATH=src python bench/bench_serve.py --out DIR [--requests 256] [--max-tokens 128]
    PYTHONPATH=src python bench/bench_serve.py --out DIR --random-weights CONFIG_DIR

``--random-weights`` serves a model of the config and tokenizer in CONFIG_DIR with random weights instead of
the bundled one (same shapes, same adapters, same work per token): for a machine without the bundled model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from common import (arg_parser, fmt, free_port, parse_args, random_weights, setup, setup_line, table,
                    write_report)  # bench/ is on sys.path when this file runs as a script

QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "Why is the sky blue?",
             "Name a fruit that is yellow.", "What do bees make?", "How far is the Moon?",
             "What is water made of?", "Who wrote Hamlet?"]
MODELS = ["SmolLM2-135M-Instruct", "pirate", "json", "french"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one_request(client: httpx.AsyncClient, i: int, max_tokens: int) -> dict:
    body = {"model": MODELS[i % len(MODELS)], "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"request {i} streamed no text")
    return {"ttft": arrivals[0] - start, "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "end": arrivals[-1]}


def load(url: str, requests: int, concurrency: int, max_tokens: int, procs: int = 1) -> dict:
    """``requests`` streaming requests, ``concurrency`` at a time, from ``procs`` client processes (each with its share
    of both): one Python process parsing every server-sent event can itself be what limits a run."""
    procs = max(1, min(procs, concurrency, requests))
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager, concurrent.futures.ProcessPoolExecutor(
            procs, mp_context=spawn, initializer=_ready, initargs=(manager.Barrier(procs),)) as pool:
        list(pool.map(time.sleep, [0] * procs))  # returns once every client process is up (the barrier) ...
        start = time.time() + 0.2  # ... so all of them begin together: the wall is not their start-up's spread
        shares = [(url, start, range(k, requests, procs), len(range(k, concurrency, procs)), max_tokens)
                  for k in range(procs)]
        results = list(pool.map(_share, *zip(*shares)))
    wall = max(r["end"] for r in results) - start
    ttfts = [t for r in results for t in r["ttfts"]]
    gaps = [g for r in results for g in r["gaps"]]
    return {"concurrency": concurrency, "requests": requests, "client_procs": procs, "wall_s": wall,
            "tokens_per_s": requests * max_tokens / wall, "requests_per_s": requests / wall,
            "ttft_p50_ms": 1e3 * pct(ttfts, 0.5), "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
            "gap_p50_ms": 1e3 * pct(gaps, 0.5), "gap_p99_ms": 1e3 * pct(gaps, 0.99)}


def _ready(barrier) -> None:
    """A client process's start: it waits until all of them have started and imported what they run."""
    barrier.wait()


def _share(url: str, start: float, indices: range, concurrency: int, max_tokens: int) -> dict:
    """One client process's requests (by index: the model and question round robin), begun at wall-clock time
    ``start``, with their end."""
    time.sleep(max(0.0, start - time.time()))
    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency)

            async def gated(i):
                async with gate:
                    return await one_request(client, i, max_tokens)
            return await asyncio.gather(*(gated(i) for i in indices))

    results = asyncio.run(run())
    return {"end": time.time(), "ttfts": [r["ttft"] for r in results],
            "gaps": [g for r in results for g in r["gaps"]]}


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def offline(model_dir: Path | None, requests: int, concurrency: int, max_tokens: int) -> tuple[float, float]:
    """Tokens per second and milliseconds per engine step of the same work through LLM.generate in this
    process (no HTTP)."""
    from lorakit.engine import LLM, SamplingParams
    from lorakit.serve.model import bundled_adapters, load_model

    model, tokenizer, _ = load_model(model_dir)
    llm = LLM(model, tokenizer, max_loras=8, adapters=bundled_adapters(), max_num_seqs=concurrency)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             add_generation_prompt=True, tokenize=False) for i in range(requests)]
    names = [None if i % len(MODELS) == 0 else MODELS[i % len(MODELS)] for i in range(requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:concurrency], params, adapters=names[:concurrency])  # warm-up: graphs, uploads
    steps, step = [0], llm.engine.step
    llm.engine.step = lambda: (steps.__setitem__(0, steps[0] + 1), step())[1]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, adapters=names)
    wall = time.perf_counter() - start
    assert all(len(o.token_ids) == max_tokens for o in outs)
    del llm, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return requests * max_tokens / wall, 1e3 * wall / steps[0]


def random_model(config_dir: Path, into: Path) -> Path:
    """A model of config_dir's config and tokenizer with random weights, saved (bf16) under ``into``."""
    model, tokenizer = random_weights(config_dir)
    folder = into / MODELS[0]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    p = arg_parser(__doc__)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--random-weights", type=Path, metavar="CONFIG_DIR",
                   help="serve random weights of this config + tokenizer instead of the bundled model")
    p.add_argument("--client-procs", type=int, default=None, metavar="K",
                   help="client processes driving the load (default: one per 32 clients, at most 8)")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more `lorakit serve` options, one string (e.g. '--engine-in-process' or '--compile')")
    args = parse_args(p, argv, needs_cuda=False)

    model_dir = None
    extra = []
    if args.random_weights:
        from lorakit.serve.model import bundled_adapters

        model_dir = random_model(args.random_weights, Path(tempfile.mkdtemp()))
        extra = ["--model", str(model_dir), *(f"--lora={n}={p}" for n, p in bundled_adapters().items())]
    baseline = {c: offline(model_dir, max(c, min(args.requests, 16 * c)), c, args.max_tokens)
                for c in args.concurrency}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "lorakit", "serve", "--port", str(port),
                               "--max-num-seqs", str(max(args.concurrency)), *extra, *shlex.split(args.serve_args)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                httpx.get(f"{url}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if server.poll() is not None:
                    raise SystemExit("lorakit serve exited before it was ready")
                time.sleep(0.25)
        procs = {c: args.client_procs or max(1, min(8, c // 32)) for c in args.concurrency}
        most = max(args.concurrency)
        load(url, most, most, args.max_tokens, procs[most])  # warm-up
        rows = []
        for c in args.concurrency:
            steps, busy = metric(url, "lorakit_engine_steps"), metric(url, "lorakit_engine_step_seconds")
            row = load(url, max(c, min(args.requests, 16 * c)), c, args.max_tokens, procs[c])
            steps = metric(url, "lorakit_engine_steps") - steps
            busy = metric(url, "lorakit_engine_step_seconds") - busy
            row["step_ms"], row["engine_busy"] = 1e3 * busy / steps, busy / row["wall_s"]
            row["offline_tokens_per_s"], row["offline_step_ms"] = baseline[c]
            row["vs_offline"] = row["tokens_per_s"] / row["offline_tokens_per_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait(60)

    meta = setup("gpu", "torch", "triton", "commit", "date", device="cuda" if torch.cuda.is_available() else "cpu",
                 max_tokens=args.max_tokens, weights="random" if args.random_weights else "bundled",
                 serve_args=args.serve_args)
    head = ("| clients | client procs | requests | tok/s | req/s | TTFT p50 ms | TTFT p99 ms | gap p50 ms | gap p99 ms "
            "| step ms | engine busy | offline tok/s | offline step ms | server / offline |")
    rows_md = table(head, ([r["concurrency"], r["client_procs"], r["requests"], fmt(r["tokens_per_s"], ".0f"),
                            fmt(r["requests_per_s"]),
                            fmt(r["ttft_p50_ms"]), fmt(r["ttft_p99_ms"]), fmt(r["gap_p50_ms"], ".2f"),
                            fmt(r["gap_p99_ms"], ".2f"), fmt(r["step_ms"], ".2f"), fmt(r["engine_busy"], ".2f"),
                            fmt(r["offline_tokens_per_s"], ".0f"), fmt(r["offline_step_ms"], ".2f"),
                            fmt(r["vs_offline"], ".2f")] for r in rows))
    report = (f"# bench_serve: lorakit serve, SmolLM2-135M-Instruct ({meta['weights']} weights) + 3 adapters, bf16, "
              f"CUDA graphs\n\n{setup_line(meta)}. Streaming chat completions, {args.max_tokens} tokens each "
              f"(ignore_eos), models round robin over base / pirate / json / french. Server options: "
              f"`{args.serve_args or '(defaults)'}`.\n\n{rows_md}")
    write_report(args.out, "bench_serve", report, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
