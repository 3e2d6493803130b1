"""What loading an adapter costs: a Llama-3-8B-shaped rank-16 adapter on all 7 projections of all 32 layers
(84 MB in bf16) moved from the CPU cache into a GPU slot, and the stall that upload causes a decode forward
pass it overlaps.

- pinned host-to-device bandwidth: a 512 MB pinned tensor copied to the GPU, measured in the same run;
- disk -> GPU: the first load (read the safetensors file, validate, pack into pinned memory, upload);
- CPU -> GPU: ``pool.prefetch`` of an adapter already in the CPU cache into a slot, wall clock from the
  call until the upload has landed, as GB/s and as a share of the pinned bandwidth (target >= 70 %);
- push: a new version from memory (``pool.push``: a PEFT state dict on the GPU, or on the host, checked in full,
  packed and uploaded into a slot), from the call until the upload has landed (issue 49's target: <= 20 ms from GPU
  tensors);
- stall: a decode-shaped forward (batch 16, one token each, on a pinned adapter), replayed from a CUDA
  graph, timed by events on the compute stream, alone and with an upload into another slot issued right
  after it on the pool's side stream (target < 5 % slower).

    PYTHONPATH=src python bench/bench_pool.py --out DIR
    PYTHONPATH=src python bench/bench_pool.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from common import (arg_parser, cuda_graph, make_model, parse_args, pinned_gbps, setup, setup_line, write_adapter,
                    write_report)  # bench/ is on sys.path when this file runs as a script

import lorakit

REPS = 20


def wall(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def forward_graph(model, handle, pool, batch: int, device: str):
    """The decode forward as a replayable CUDA graph (a plain call on the CPU)."""
    input_ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    ids = torch.tensor(pool.acquire(["pinned"] * batch), device=device)

    def forward():
        with torch.no_grad():
            return model(input_ids=input_ids, lora_ids=ids, use_cache=False).logits

    return forward if device == "cpu" else cuda_graph(forward).replay


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--batch", type=int, default=16)
    args = parse_args(p, argv)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model = make_model(2 if args.tiny else 32, args.tiny, args.device)
    rank = 16
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_adapter(model, Path(tmp) / "pushed", rank, seed=9)
        state = load_file(folder / "adapter_model.safetensors")  # what a training loop holds, on the host
        config = json.loads((folder / "adapter_config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: write_adapter(model, Path(tmp) / name, rank, seed=i)
                   for i, name in enumerate(("pinned", "x", "y"))}
        handle = lorakit.patch(model, max_loras=2, max_rank=64)
        pool = lorakit.AdapterPool(handle, cpu_budget_bytes=1 << 30)
        for name in ("x", "y"):
            pool.register(name, folders[name])
        # Registration reads, validates and packs (the snapshot); pin uploads it.
        cold_s = wall(lambda: (pool.register("pinned", folders["pinned"]), pool.pin("pinned")), sync)
        for name in ("x", "y"):  # into the CPU cache
            pool.prefetch([name])
            pool.synchronize()
    nbytes = pool.memory()["slots"][pool.slot_of("pinned")]["bytes"]

    def upload(name):
        pool.prefetch([name])
        pool.synchronize()

    names = ["x", "y"] * (REPS // 2)
    load_s = [wall(lambda n=n: upload(n), sync) for n in names]
    issue_s = []  # host time of the prefetch call alone
    for n in names[:6]:
        sync()
        start = time.perf_counter()
        pool.prefetch([n])
        issue_s.append(time.perf_counter() - start)
        pool.synchronize()

    on_device = {k: v.to(args.device, torch.bfloat16 if cuda else v.dtype) for k, v in state.items()}

    def push(weights):
        pool.push("pushed", weights, config)
        pool.prefetch(["pushed"])
        pool.synchronize()

    push_gpu_s = [wall(lambda: push(on_device), sync) for _ in range(5)]
    push_host_s = [wall(lambda: push(state), sync) for _ in range(5)]

    replay = forward_graph(model, handle, pool, args.batch, args.device)
    alone, overlapped = [], []
    for i in range(2 * REPS + 2):
        name, with_upload = names[i % len(names)], i % 2 == 1
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            if with_upload:
                pool.prefetch([name])
            end.record()
            end.synchronize()
            pool.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = 1e3 * wall(lambda: (replay(), pool.prefetch([name]) if with_upload else None), sync)
        if i >= 2:
            (overlapped if with_upload else alone).append(ms)

    h2d = pinned_gbps(args.device) if cuda else float("nan")
    load_ms = 1e3 * statistics.median(load_s)
    gbps = nbytes / (load_ms * 1e-3) / 1e9
    fwd_ms, fwd_up_ms = statistics.median(alone), statistics.median(overlapped)
    result = dict(
        adapter_bytes=nbytes, rank=rank, pinned_h2d_gbps=h2d, cold_load_ms=1e3 * cold_s, load_ms=load_ms,
        load_gbps=gbps, load_share_of_h2d=gbps / h2d, prefetch_call_ms=1e3 * statistics.median(issue_s),
        forward_ms=fwd_ms, forward_with_upload_ms=fwd_up_ms, stall_pct=100 * (fwd_up_ms - fwd_ms) / fwd_ms,
        push_gpu_ms=1e3 * statistics.median(push_gpu_s), push_host_ms=1e3 * statistics.median(push_host_s),
        batch=args.batch, load_ms_all=[1e3 * s for s in load_s], forward_ms_all=alone, forward_up_ms_all=overlapped,
    )
    s = setup("device", "torch", "transformers", "commit", "date_utc", device=args.device, tiny=args.tiny,
              layers=model.config.num_hidden_layers)
    ok_load, ok_stall = result["load_share_of_h2d"] >= 0.7, result["stall_pct"] < 5
    text = f"""# Adapter pool: loading a Llama-3-8B-shaped rank-16 adapter (all 7 projections, {s['layers']} layers)

{setup_line(s)}. Medians of {REPS} runs.

| what | value | target |
|---|---|---|
| adapter size (bf16) | {nbytes / 1e6:.1f} MB | |
| pinned host-to-device bandwidth, same run | {h2d:.1f} GB/s | |
| disk -> GPU, first load (read, validate, pack, pin, upload) | {result['cold_load_ms']:.0f} ms | |
| CPU cache -> GPU slot (prefetch call until landed) | {load_ms:.2f} ms = {gbps:.1f} GB/s | |
| ... as a share of pinned bandwidth | {100 * result['load_share_of_h2d']:.0f} % | >= 70 % {'(met)' if ok_load else '(NOT met)'} |
| host time of the prefetch call | {result['prefetch_call_ms']:.2f} ms | |
| push from GPU tensors until served (check, pack, upload; median of 5) | {result['push_gpu_ms']:.0f} ms | <= 20 ms {'(met)' if result['push_gpu_ms'] <= 20 else '(NOT met)'} |
| push from host tensors until served (median of 5) | {result['push_host_ms']:.0f} ms | |
| decode forward, batch {args.batch}, CUDA graph, alone | {fwd_ms:.3f} ms | |
| same, with an upload issued right after it on the side stream | {fwd_up_ms:.3f} ms | |
| stall | {result['stall_pct']:+.1f} % | < 5 % {'(met)' if ok_stall else '(NOT met)'} |
"""
    write_report(args.out, "bench_pool", text, dict(setup=s, result=result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
