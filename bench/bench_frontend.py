"""One API server process under streams, the engine replaced by a fake core: what the front end costs per token.

The fake core speaks the engine core's wire (``lorakit.frontend.wire``) and nothing else: it answers Ready, takes
each Add, and every ``--step-ms`` emits one Step with the next token of every running request (token ids of a
real text, cycled; the tokenizer's, so detokenizing does its real work), ``max_tokens`` of them, then "length".
It never waits on a model, so what the API server process does per token (wire decode, the output processor's
text and stop strings, chunk JSON, the ASGI send, metrics) is all that is measured. One ``lorakit`` API server
process (``lorakit.serve``'s attach path, as ``--api-servers`` starts its extra ones; ``--api-servers N``: N of
them on the one port, their CPU times added up) serves it on a port, and
``--clients`` streaming chat requests at a time (``max_tokens`` each, stream_options.include_usage) are sent by
client processes that parse no JSON but the usage chunk.

Measured per source tree (``--src``, the tree under test first; an older checkout of lorakit gives the old path's
figure in the same run): streamed tokens/s, the API process's CPU time per streamed token (user + system, all its
threads, from /proc, over the timed window), its CPU use (1.0: one core busy), tokens per chunk (above 1: streams
fell behind and were merged), TTFT p50 / p99.

    PYTHONPATH=src python bench/bench_frontend.py --out DIR [--src OLD_TREE/src] [--clients 256] [--requests 2048]
        [--api-servers N]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = ("The history of the river begins in the mountains, where snow melts each spring and runs down through "
        "pine forests and narrow valleys. Villages grew along its banks: millers, fishers and boatmen, then "
        "bridges, roads and markets. Today it carries barges of grain and timber, and on summer evenings children "
        "swim where their grandparents once washed wool. Numbers: 3.14159, 2,718 and 1e-9; code: x = f(y) + 1; "
        "accents: café, naïve, Zürich; symbols: → ✓ 😀. ")
HERE = Path(__file__).resolve().parent
FIRST_TOKEN = re.compile(rb'"delta": ?\{"content"')  # a token's chunk (the role chunk's delta starts with "role")


# ------------------------------------------------------------------ the fake core


def fake_core(to_core: str, from_cores: list[str], step_s: float, tokenizer_dir: str) -> None:
    """The engine core's wire with no engine behind it (see the module docstring), for one API server per address
    of ``from_cores``: each step, each server gets one Step with the outputs of its requests (their ids start with
    the server's index, as ``CoreClient`` makes them)."""
    import msgspec
    import zmq
    from transformers import AutoTokenizer

    from lorakit.frontend import wire
    from lorakit.engine.outputs import RequestOutput

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(TEXT * 8)["input_ids"]
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(to_core)
    pushes = []
    for address in from_cores:
        pushes.append(context.socket(zmq.PUSH))
        pushes[-1].connect(address)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(wire.ToCore).decode
    fields = wire.Ready.__struct_fields__  # the trees measured may differ in Ready's fields
    facts = dict(pid=os.getpid(), vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), max_seq_len=8192,
                 eos_token_id=None, kv_tokens=1 << 22, max_num_seqs=4096, adapters=[])
    for push in pushes:
        push.send(encode(wire.Ready(**{k: v for k, v in facts.items() if k in fields})))
    running: dict[str, list] = {}  # request id -> [prompt length, tokens sent, max_tokens, offset into ids]
    next_step = time.perf_counter()
    while True:
        timeout = max(0.0, next_step - time.perf_counter())
        if pull.poll(int(timeout * 1000) if running else 1000):
            while True:
                try:
                    message = decode(pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(message, wire.Add):
                    running[message.request_id] = [len(message.prompt_ids), 0, message.params.max_tokens,
                                                   hash(message.request_id) % len(ids)]
                elif isinstance(message, wire.Abort):
                    for request_id in message.request_ids:
                        running.pop(request_id, None)
                elif isinstance(message, wire.Call) and message.method == "shutdown":
                    return
        if not running or time.perf_counter() < next_step:
            continue
        next_step = max(next_step + step_s, time.perf_counter() - step_s)
        outputs: list[list] = [[] for _ in pushes]
        for request_id, r in list(running.items()):
            r[1] += 1
            done = r[1] >= r[2]
            server = int(request_id[1:request_id.index("-")]) if len(pushes) > 1 else 0  # "s{index}-r{n}"
            outputs[server].append(RequestOutput(request_id, "", [ids[(r[3] + r[1]) % len(ids)]], done,
                                                 "length" if done else None, None, r[0], r[1]))
            if done:
                del running[request_id]
        for push, outs in zip(pushes, outputs):
            if outs:
                push.send(encode(wire.Step(outs)))


def api_server(to_core: str, from_cores: list[str], index: int, core_pid: int, tokenizer_dir: str, port: int) -> None:
    """API server ``index`` attached to the fake core, as ``lorakit serve --api-servers N`` starts its extra ones
    (all of them on ``port``, SO_REUSEPORT)."""
    import functools

    import lorakit.serve as serve
    from lorakit.serve.model import load_tokenizer

    config = serve.ServeConfig(model_name="base")
    profile = os.environ.get("BENCH_FRONTEND_PROFILE")  # a file for the API process's cProfile stats
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    serve._serve_more((to_core, from_cores), index, core_pid, functools.partial(load_tokenizer, tokenizer_dir), config,
                      "127.0.0.1", port)
    if profile:
        profiler.disable()
        profiler.dump_stats(profile)


def roles() -> None:
    """``bench_frontend.py --role core|server ...``: one of the two processes, with the tree under test on the
    path (the parent sets PYTHONPATH)."""
    role, to_core, from_cores, rest = sys.argv[2], sys.argv[3], sys.argv[4].split(","), sys.argv[5:]
    if role == "core":
        fake_core(to_core, from_cores, float(rest[0]), rest[1])
    else:
        api_server(to_core, from_cores, int(rest[0]), int(rest[1]), rest[2], int(rest[3]))


# ------------------------------------------------------------------ the clients


async def _one(port: int, body: bytes) -> tuple[float, int, int]:
    """One streaming request over a raw connection: (TTFT s, chunks, completion tokens from the usage chunk)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
    start, first, data = time.perf_counter(), None, bytearray()
    while chunk := await reader.read(1 << 16):
        if first is None and FIRST_TOKEN.search(chunk):
            first = time.perf_counter() - start
        data += chunk
    writer.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"request failed: {bytes(data[:300])!r}")
    usage = data.rfind(b'"completion_tokens":')
    tokens = int(data[usage + 20:data.index(b",", usage)]) if usage >= 0 else 0
    return first or 0.0, data.count(b"data: ") - 3, tokens  # less the role chunk, the usage chunk and [DONE]


def client_proc(port: int, concurrency: int, requests: int, max_tokens: int, queue) -> None:
    async def main():
        body = json.dumps({"model": "base", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                           "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": "Tell me about the river."}]}).encode()
        todo, results = list(range(requests)), []

        async def worker():
            while todo:
                todo.pop()
                results.append(await _one(port, body))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results
    queue.put(asyncio.run(main()))


def drive(port: int, clients: int, requests: int, max_tokens: int, procs: int) -> list[tuple[float, int, int]]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=client_proc, args=(port, clients // procs, requests // procs, max_tokens, queue))
               for _ in range(procs)]
    for w in workers:
        w.start()
    results = [r for _ in workers for r in queue.get()]
    for w in workers:
        w.join()
    return results


# ------------------------------------------------------------------ a run


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(src: Path, args, port: int) -> dict:
    path = os.pathsep.join(p for p in [str(src), os.environ.get("PYTHONPATH", "")] if p)  # the tree first
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    folder = tempfile.mkdtemp(prefix="bench-frontend-")
    to_core = f"ipc://{folder}/to-core"
    from_cores = ",".join(f"ipc://{folder}/from-core-{i}" for i in range(args.api_servers))
    me = [sys.executable, str(Path(__file__).resolve()), "--role"]
    core = subprocess.Popen([*me, "core", to_core, from_cores, str(args.step_ms / 1000), str(args.tokenizer)],
                            env=env)
    servers = [subprocess.Popen([*me, "server", to_core, from_cores, str(i), str(core.pid), str(args.tokenizer),
                                 str(port)], env=env) for i in range(args.api_servers)]
    try:
        import httpx
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("the API server did not come up")
        time.sleep(1.0 if args.api_servers > 1 else 0.0)  # the other servers listen a moment after the first
        drive(port, min(args.clients, 32), 64, 16, 1)  # warm-up
        cpu0, t0 = sum(cpu_seconds(s.pid) for s in servers), time.perf_counter()
        results = drive(port, args.clients, args.requests, args.max_tokens, args.client_procs)
        wall, cpu = time.perf_counter() - t0, sum(cpu_seconds(s.pid) for s in servers) - cpu0
    finally:
        for p in (*servers, core):
            p.terminate()
        for p in (*servers, core):
            p.wait(10)
    tokens = sum(r[2] for r in results)
    ttft = sorted(r[0] for r in results)
    return {"src": str(src), "commit": _commit(src), "api_servers": args.api_servers, "clients": args.clients,
            "requests": len(results),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "api_cpu_us_per_token": 1e6 * cpu / tokens,
            "api_cpu_use": cpu / wall, "tokens_per_chunk": tokens / max(1, sum(r[1] for r in results)),
            "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2], "ttft_p99_ms": 1e3 * ttft[int(0.99 * (len(ttft) - 1))]}


def _commit(src: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def main() -> None:
    sys.path.insert(0, str(HERE))
    from common import arg_parser, free_port, fmt, parse_args, setup, setup_line, table, write_report

    p = arg_parser(__doc__)
    p.add_argument("--src", type=Path, action="append", default=[],
                   help="a source tree to measure (its src/ folder); repeatable (default: this checkout's)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer folder (default: the bundled SmolLM2-135M-Instruct's)")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--api-servers", type=int, default=1, help="API server processes on the one port (SO_REUSEPORT)")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=3.6,
                   help="the fake core's step period (default: an H200's decode step of 256 on SmolLM2-135M; 256 "
                        "streams at 3.6 ms: 71k tokens/s offered)")
    args = parse_args(p, needs_cuda=False)
    if args.tokenizer is None:
        from lorakit.serve.model import default_model_folder
        args.tokenizer = default_model_folder()
    trees = args.src or [HERE.parent / "src"]
    rows = [measure(src.resolve(), args, free_port()) for src in trees]
    for row in rows:
        print(row, flush=True)
    s = setup("device", "torch", "transformers", "commit", "date_utc", device="cpu",
              workload=f"{args.clients} streams, {args.requests} requests of {args.max_tokens} tokens, fake core step "
              f"{args.step_ms} ms, {args.client_procs} client processes, {os.cpu_count()} CPUs")
    head = ("| tree | commit | API servers | tok/s | API CPU us/token | API CPU use | tok/chunk | TTFT p50 ms "
            "| TTFT p99 ms |")
    md = f"# bench_frontend: API server processes, fake core\n\n{setup_line(s)}\n\n{s['workload']}.\n\n" + table(
        head,
        [(r["src"], r["commit"], r["api_servers"], fmt(r["tokens_per_s"], ".0f"), fmt(r["api_cpu_us_per_token"]),
          fmt(r["api_cpu_use"], ".2f"), fmt(r["tokens_per_chunk"], ".2f"), fmt(r["ttft_p50_ms"]),
          fmt(r["ttft_p99_ms"])) for r in rows])
    write_report(args.out, "bench_frontend", md, {"setup": s, "rows": rows})


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        roles()
    else:
        main()
