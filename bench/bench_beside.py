"""An engine-like thread's steps while another thread reads pushed adapters, with and without the readers' pauses.

The engine's thread is simulated on the CPU: each step 60 small torch calls (each releases the GIL, as the engine's
own do) and a 5 ms wait with the GIL released (the GPU's share of a step). Beside it a reader thread reads a pushed
safetensors body as the engine core's reader does (``AdapterPool.read_pushed``, with its hashing threads), back to
back, either plainly or inside ``lorakit.peft.gil.yielding()`` (its pauses). Reported: the step's time idle and while
reading (median, p90, p99, largest), the read's median; each reading stage alone too (the body's views, the value
checks, the sha256), where ``--stages``. A Llama-3-8B-like adapter's structure (rank 16 on all 7 projections of 32 layers: 448
tensors) at a quarter of its width, so it runs on a CPU; no GPU needed, and no timing value against one.

    PYTHONPATH=src python bench/bench_beside.py --out DIR [--stages]
    PYTHONPATH=src python bench/bench_beside.py --out DIR --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from common import arg_parser, fmt, parse_args, setup, setup_line, table, word_tokenizer, write_adapter, write_report

from lorakit import Engine
from lorakit.adapters.snapshot import hash_image, safetensors_views
from lorakit.peft.gil import beside
from lorakit.peft import check_values
from lorakit.peft.adapter import ModuleLora
from lorakit.serve.push import push_body

STEP_CALLS = 60
STEP_WAIT_S = 0.005


def step(x: torch.Tensor) -> None:
    for _ in range(STEP_CALLS):
        x.add_(1)
    time.sleep(STEP_WAIT_S)


def steps(n: int) -> list[float]:
    x = torch.zeros(8)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step(x)
        out.append(1e3 * (time.perf_counter() - t))
    return out


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def beside_reads(work, paced: bool, n_steps: int) -> dict:
    """The steps' times while ``work`` runs back to back on a thread of its own (10 ms apart)."""
    reads: list[float] = []
    done = threading.Event()

    def reader():
        while not done.is_set():
            t = time.perf_counter()
            beside(work) if paced else work()
            reads.append(1e3 * (time.perf_counter() - t))
            time.sleep(0.01)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.05)
    try:
        times = steps(n_steps)
    finally:
        done.set()
        thread.join()
    return {"p50": quantile(times, 0.5), "p90": quantile(times, 0.9), "p99": quantile(times, 0.99),
            "max": max(times), "read_ms": statistics.median(reads), "reads": len(reads)}


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--stages", action="store_true", help="each reading stage alone too")
    args = parse_args(p, argv, needs_cuda=False)
    width = 64 if args.tiny else 1024
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=width * 7 // 2,
                                      num_hidden_layers=2 if args.tiny else 32, num_attention_heads=16,
                                      num_key_value_heads=4)
    n_steps = 20 if args.tiny else args.steps
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the simulated engine and the reader share the CPU's threads as two Python threads
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_adapter(model, Path(tmp) / "a", 16, seed=1)
        host = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "adapter_model.safetensors").items()}
        body = push_body(host, json.loads((folder / "adapter_config.json").read_text()))
    engine = Engine(model, word_tokenizer(config.vocab_size), max_loras=2, max_num_seqs=2, max_seq_len=64,
                    device="cpu")
    works = {"whole read (AdapterPool.read_pushed)": lambda: engine.pool.read_pushed("p", memoryview(body), None)}
    if args.stages:
        modules = {k: ModuleLora(host[k], host[k.replace("lora_A", "lora_B")], 16, 1.0) for k in host if "lora_A" in k}
        image = works["whole read (AdapterPool.read_pushed)"]().image
        works["the body's views (safetensors_views)"] = lambda: safetensors_views(memoryview(body), "bench")
        works["the value checks (check_values)"] = lambda: check_values(modules, "bench")
        works["the sha256 (hash_image)"] = lambda: hash_image(b"{}", image)()
    for work in works.values():
        work()  # warm: the handle's plans, the hashing threads
    idle = steps(n_steps)
    idle_row = {"p50": quantile(idle, 0.5), "p90": quantile(idle, 0.9), "p99": quantile(idle, 0.99), "max": max(idle)}
    rows, results = [["idle", "-", *(fmt(idle_row[k], ".2f") for k in ("p50", "p90", "p99", "max")), "-"]], []
    for what, work in works.items():
        for paced in (False, True):
            r = beside_reads(work, paced, n_steps)
            results.append({"work": what, "paced": paced, **r})
            rows.append([what, "yes" if paced else "no", *(fmt(r[k], ".2f") for k in ("p50", "p90", "p99", "max")),
                         fmt(r["read_ms"])])
    s = setup("device", "torch", "commit", "date_utc", device="cpu", tiny=args.tiny, tensors=len(host),
              body_bytes=len(body), step_calls=STEP_CALLS, step_wait_ms=1e3 * STEP_WAIT_S, steps=n_steps)
    md = (f"# An engine-like thread's steps beside a reader of pushed adapters\n\n{setup_line(s)}. A body of "
          f"{len(host)} tensors ({len(body) / 1e6:.1f} MB, rank 16); the simulated step is {STEP_CALLS} small torch "
          f"calls and a {1e3 * STEP_WAIT_S:.0f} ms wait with the GIL released; {n_steps} steps a row. Paced: the "
          f"reader inside `lorakit.peft.gil.yielding()`.\n\n"
          + table("| reading | paced | step p50 ms | p90 | p99 | largest | read median ms |", rows) + "\n")
    write_report(args.out, "bench_beside", md, {"setup": s, "idle": idle_row, "result": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
