"""Pushes to a running server while it streams: issue 49's latencies over HTTP and CUDA IPC, and the stall they cause.

A Llama-3-8B-shaped model (random bf16 weights) served with ``--allow-runtime-lora``, its engine in a core process of
its own (``lorakit serve``'s default) and then in the server's process (``--engine-in-process``), and a rank-16 adapter
on all 7 projections of every layer (84 MB in bf16):

- HTTP from host memory: ``lorakit.serve.push.push_adapter`` of host tensors (a safetensors body), wall time from the
  call until the server answers with the new version (target <= 1 s);
- CUDA IPC from another process: a child process holding the adapter on the GPU pushes it with ``cuda_ipc=True`` (one
  copy into a shared buffer there, the server opens it and copies device to device), timed in the child (target
  <= 60 ms);
- stall: one greedy stream on the base model runs throughout; the largest gap between two of its tokens while the
  pushes of each kind run, in steps (its median gap before the pushes; target: at most one step more).

    PYTHONPATH=src python bench/bench_push.py --out DIR [--layers 32] [--pushes 20]
    PYTHONPATH=src python bench/bench_push.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file
from common import (arg_parser, make_model, parse_args, setup, setup_line, word_tokenizer, write_adapter,
                    write_report)  # bench/ is on sys.path when this file runs as a script

from lorakit.engine import Engine
from lorakit.frontend.core import freeze_heap
from lorakit.frontend.core_client import CoreClient
from lorakit.serve.app import create_app
from lorakit.serve.edge import uvicorn_config
from lorakit.serve.push import push_adapter
from lorakit.serve.state import ServeConfig

# The pushing client, a process of its own as a trainer is: the adapter on the host (a safetensors body over HTTP) or
# on its GPU (CUDA IPC), WARMUP pushes, then N pushes, each timed; each one's start and end (perf_counter: the host's
# monotonic clock, the same in every process) as JSON.
WARMUP = 3
_CHILD = """
import json, sys, time, torch
from safetensors.torch import load_file
from lorakit.serve.push import push_adapter
url, folder, n, mode, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
ipc = mode == "ipc"
weights = {k: v.to("cuda" if ipc else "cpu", torch.bfloat16)
           for k, v in load_file(folder + "/adapter_model.safetensors").items()}
config = json.load(open(folder + "/adapter_config.json"))
for _ in range(warmup):  # the server's pinned buffers allocated, its slot layout planned
    push_adapter(url, mode, weights, config, cuda_ipc=ipc)
print("ready", flush=True)
sys.stdin.readline()  # go
spans = []
for _ in range(n):
    if ipc:
        torch.cuda.synchronize()
    start = time.perf_counter()
    push_adapter(url, mode, weights, config, cuda_ipc=ipc)
    spans.append((start, time.perf_counter()))
print(json.dumps(spans))
"""


class Stream:
    """A greedy stream of the base model, each token's arrival time kept; its first 50 tokens awaited."""

    def __init__(self, url: str, max_tokens: int):
        self.times: list[float] = []
        self.error = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, max_tokens), daemon=True)
        self.thread.start()
        while len(self.times) < 50:
            assert self.thread.is_alive(), f"the stream ended early: {self.error}"
            time.sleep(0.01)

    def _run(self, url, max_tokens):
        body = {"model": "base", "prompt": "w1 w2 w3 w4", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                self.error = r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.perf_counter())
                if self.stop.is_set():
                    return

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        t = [x for x in self.times if start <= x <= end]
        return [b - a for a, b in zip(t, t[1:])]

    def close(self):
        self.stop.set()
        self.thread.join(60)


class Sampler:
    """Every thread's Python stack, sampled each millisecond (``--trace``): what each thread was doing while the
    bystander waited longest. A gap between samples is a stretch in which no thread gave up the GIL. ``file``: the
    samples also appended there as JSON lines (an engine core process's, read back by the server's sampler)."""

    def __init__(self, on: bool, file: str | None = None):
        self.samples: list[tuple[float, dict[str, str]]] = []
        self.stop = threading.Event()
        self.file = open(file, "a") if file else None
        if on:
            threading.Thread(target=self._run, daemon=True, name="sampler").start()

    def _run(self):
        me = threading.get_ident()
        while not self.stop.wait(0.001):
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.perf_counter()
            stacks = {}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                parts = []
                while frame is not None and len(parts) < 7:
                    parts.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                stacks[names.get(ident, str(ident))] = " < ".join(parts)
            self.samples.append((now, stacks))
            if self.file is not None:
                self.file.write(json.dumps([now, stacks]) + "\n")
                if len(self.samples) % 100 == 0:
                    self.file.flush()

    def report(self, stream: "Stream", path: Path, spans: list, core: Path | None = None, worst: int = 3) -> None:
        """The ``worst`` longest gaps of the stream: where they fell among the pushes' ``spans``, and each thread's
        stacks sampled within them (the core process's too, from its file), most frequent first."""
        self.stop.set()
        if not self.samples:
            return
        theirs = []
        if core is not None and core.exists():
            for line in core.read_text().splitlines():
                try:
                    when, stacks = json.loads(line)
                except ValueError:  # the last line, cut off when the core stopped
                    continue
                theirs.append((when, {f"core {name}": stack for name, stack in stacks.items()}))
        t = stream.times[49:]
        gaps = sorted(zip(t, t[1:]), key=lambda ab: ab[0] - ab[1])[:worst]
        lines = []
        for a, b in gaps:
            inside = [(when, stacks) for when, stacks in self.samples if a <= when <= b]
            spacing = max((y[0] - x[0] for x, y in zip(inside, inside[1:])), default=float("nan"))
            during = [i for i, (s, e) in enumerate(spans) if s < b and e > a]
            where = "between pushes"
            if during:
                start, end = spans[during[0]]
                where = (f"push {during[0] + 1} of {len(spans)}, {1e3 * (a - start):+.0f} ms from its start "
                         f"({1e3 * (end - start):.0f} ms long)")
            lines.append(f"## gap of {1e3 * (b - a):.1f} ms ({where}): {len(inside)} samples, longest between two "
                         f"{1e3 * spacing:.1f} ms")
            inside += [(when, stacks) for when, stacks in theirs if a <= when <= b]
            by_thread: dict[str, dict[str, int]] = {}
            for _, stacks in inside:
                for name, stack in stacks.items():
                    counts = by_thread.setdefault(name, {})
                    counts[stack] = counts.get(stack, 0) + 1
            for name, counts in sorted(by_thread.items()):
                for stack, n in sorted(counts.items(), key=lambda kv: -kv[1])[:4]:
                    lines.append(f"{n:4d}  {name}: {stack}")
            lines.append("")
        path.write_text("\n".join(lines))


def serve(engine):
    import uvicorn

    server = uvicorn.Server(uvicorn_config(create_app(engine, ServeConfig(model_name="base", allow_runtime_lora=True,
                                                                       max_tokens_limit=8192)),
                                           "127.0.0.1", 0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    freeze_heap()  # as lorakit serve's server does once it is up: no full collection walks the startup's objects
    server.thread = thread
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def build_engine(layers: int, tiny: bool, device: str, trace: str | None = None) -> Engine:
    """The served engine: the model, its word tokenizer, room for one long bystander (also in a core process, whose
    threads' stacks are then sampled into the file ``trace``)."""
    if trace:
        Sampler(True, trace)
    torch.manual_seed(0)
    model = make_model(layers, tiny, device)
    model.config.max_position_embeddings = 8192  # rotary: no table to outgrow; room for a long bystander
    return Engine(model, word_tokenizer(model.config.vocab_size), max_loras=2, max_num_seqs=4, max_seq_len=8192,
                  graph_sizes=(1, 2, 4), device=device)


def measure(url: str, folder: Path, args, cuda: bool, where: str, core: Path | None = None) -> dict:
    """Each kind of push from a client process of its own while the bystander streams: {kind: (push seconds,
    the bystander's gaps during them, its median gap before)}."""
    max_tokens = 8000 if cuda else 300
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for mode in ("http", "ipc") if cuda else ("http",):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, url, str(folder), str(args.pushes), mode,
                                  str(WARMUP)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if child.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {mode} pusher failed to start")
        stream = Stream(url, max_tokens)
        sampler = Sampler(args.trace)
        child.stdin.write("go\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=600)
        stream.close()
        if child.returncode:
            raise SystemExit(f"the {mode} pusher failed")
        spans = json.loads(out.strip().splitlines()[-1])
        sampler.report(stream, args.out / f"push_stalls_{where}_{mode}.txt", spans, core)
        runs[mode] = ([e - s for s, e in spans], stream.gaps(stream.times[49]),
                      statistics.median(stream.gaps(0, stream.times[49])))
    return runs


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--pushes", type=int, default=20)
    p.add_argument("--engine", choices=("core", "in-process", "both"), default="both",
                   help="where the engine runs: its own core process (lorakit serve's default), the server's process "
                        "(--engine-in-process), or each in turn")
    p.add_argument("--trace", action="store_true", help="sample every thread's stack during the pushes (the server's "
                   "and the engine core process's): what each did in the bystander's longest gaps, into "
                   "OUT/push_stalls_{engine}_{http,ipc}.txt. The samplers take the GIL each millisecond in both "
                   "processes, which lengthens the pushes and the gaps they measure (2-4x on an H100): read the "
                   "targets from a run without it")
    args = parse_args(p, argv)
    cuda = args.device == "cuda"
    layers = 2 if args.tiny else args.layers
    tmp = Path(tempfile.mkdtemp())
    shape = make_model(layers, args.tiny, "meta")  # the model's shapes, no weights
    folder = write_adapter(shape, tmp / "pushed", 16, seed=9)
    host = load_file(folder / "adapter_model.safetensors")
    results = {}
    for where in ("core", "in-process") if args.engine == "both" else (args.engine,):
        core = tmp / "core_samples.jsonl" if where == "core" and args.trace else None
        if where == "core":
            engine = CoreClient(functools.partial(build_engine, layers, args.tiny, args.device,
                                                  str(core) if core else None),
                                word_tokenizer(shape.config.vocab_size))
            engine.launch()
        else:
            engine = build_engine(layers, args.tiny, args.device)
        server, url = serve(engine)
        try:
            runs = measure(url, folder, args, cuda, where, core)
        finally:
            server.should_exit = True
            server.thread.join(60)
            del engine, server
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        results[where] = summary(runs)
    s = setup("device", "torch", "transformers", "commit", "date_utc", device=args.device, tiny=args.tiny,
              layers=layers)
    mb = sum(v.numel() * 2 for v in host.values()) / 1e6  # pushed in bf16
    rows = []
    for where, r in results.items():
        steps = lambda gap_ms: gap_ms / r["step_ms"]  # noqa: E731
        rows += [
            f"| {where} | HTTP push from host memory, until answered | {r['http_ms']:.0f} ms | "
            f"{r['http_max_ms']:.0f} ms | <= 1000 ms |",
            f"| {where} | CUDA IPC push from another process, until answered | {r['ipc_ms']:.0f} ms | "
            f"{r['ipc_max_ms']:.0f} ms | <= 60 ms |",
            f"| {where} | a bystander stream's step (median gap before the pushes) | {r['step_ms']:.1f} ms | | |",
            f"| {where} | its largest gap during the HTTP pushes | {r['stall_http_ms']:.1f} ms = "
            f"{steps(r['stall_http_ms']):.1f} steps | | <= 2 steps |",
            f"| {where} | its largest gap during the CUDA IPC pushes | {r['stall_ipc_ms']:.1f} ms = "
            f"{steps(r['stall_ipc_ms']):.1f} steps | | <= 2 steps |",
        ]
    nl = "\n"
    text = f"""# Pushing a rank-16 adapter ({mb:.1f} MB in bf16, {layers} layers) to a server while it streams

{setup_line(s)}. {args.pushes} pushes of each kind from a client process of its own, after {WARMUP} warm-up pushes;
the engine in its own core process (lorakit serve's default) and in the server's process (--engine-in-process), CUDA
graphs; the bystander streams on the base model.{TRACED if args.trace else ""}

| engine | what | median | worst | target |
|---|---|---|---|---|
{nl.join(rows)}
"""
    write_report(args.out, "bench_push", text, dict(setup=s, adapter_mb=mb, pushes=args.pushes, result=results))
    return 0


TRACED = """ Sampled (--trace): the samplers' own use of the GIL, each
millisecond in both processes, lengthens the pushes and the gaps (on an H100, HTTP 500-600 ms and gaps of 3-5 steps
sampled, 214-254 ms and 1.1 steps not: bench/results/push_stall_round7.md); the targets are read from a run without."""


def summary(runs: dict) -> dict:
    http_s, http_gaps, step = runs["http"]
    ipc_s, ipc_gaps, _ = runs.get("ipc", ([], [], None))
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    worst = lambda xs: 1e3 * max(xs) if xs else float("nan")  # noqa: E731
    return dict(http_ms=ms(http_s), http_max_ms=worst(http_s), ipc_ms=ms(ipc_s), ipc_max_ms=worst(ipc_s),
                step_ms=1e3 * step, stall_http_ms=worst(http_gaps), stall_ipc_ms=worst(ipc_gaps), http_s=http_s,
                ipc_s=ipc_s, tokens_during_http=len(http_gaps), tokens_during_ipc=len(ipc_gaps))


if __name__ == "__main__":
    raise SystemExit(main())
