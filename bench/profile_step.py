"""Where one decode step's GPU time goes: the engine's decode step under ``torch.profiler``, kernels grouped.

A Llama-3-8B-shaped model (``--layers`` of its 32; per-layer times do not depend on the count), random bf16
weights, ``--batch`` requests decoding, each case its own engine: the base model alone, then N distinct rank-16
adapters on all 7 projections. For every case: wall time per decode step (no profiler), then a profile of a few
steps: per kernel group (GEMM, LoRA shrink, LoRA expand, attention, fused elementwise, other) the count and
microseconds per step, and the device's busy time per step (kernel intervals merged, streams overlapping). One
layer's kernels (start, duration, stream) go to the JSON for ``plot_step_timeline.py``.

    PYTHONPATH=src python bench/profile_step.py --out DIR [--layers 4] [--batch 64] [--adapters 0 8 32] [--compile]
"""

from __future__ import annotations

import gc
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import (arg_parser, fmt, make_model, parse_args, setup, setup_line, table,
                    write_adapter, write_report)  # bench/ is on sys.path when this file runs as a script

from lorakit.engine import Engine, SamplingParams

PROMPT = 128
GROUPS = (  # first match wins; names of cuBLAS / CUTLASS GEMMs vary by GPU and library version
    ("LoRA shrink", re.compile(r"shrink")),
    ("LoRA expand", re.compile(r"expand")),
    ("attention", re.compile(r"attention|attn|paged", re.I)),
    ("GEMM", re.compile(r"gemm|gemv|cutlass|nvjet|sm90|sm80|cublas|matmul|splitk", re.I)),
    ("fused elementwise (Inductor)", re.compile(r"^triton_")),
)


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if pattern.search(name)), "other")


def merged_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on two streams may overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def start_decoding(engine: Engine, batch: int, names: list, vocab: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True),
                           names[i % len(names)])
    while engine.scheduler.waiting or any(r.num_computed < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()


def profile_case(engine: Engine, steps: int, layers: int) -> dict:
    torch.cuda.synchronize()
    walls = []
    for _ in range(20):
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [(e.name, e.time_range.start, e.time_range.end, getattr(e, "device_resource_id", 0)) for e in kernels]
    kernels.sort(key=lambda k: k[1])
    per_group: dict[str, list[float]] = {}
    for name, s, e, _ in kernels:
        per_group.setdefault(group_of(name), []).append(e - s)
    busy = merged_us([(s, e) for _, s, e, _ in kernels]) / steps
    # One layer of the middle step: the kernels between the 2nd and 3rd attention kernels of that step.
    step_len = len(kernels) // steps
    mid = kernels[step_len * (steps // 2): step_len * (steps // 2 + 1)]
    attn = [i for i, k in enumerate(mid) if group_of(k[0]) == "attention"]
    layer = mid[attn[1]: attn[2]] if len(attn) > 2 else []
    t0 = layer[0][1] if layer else 0.0
    return dict(
        wall_ms=1e3 * statistics.median(walls), busy_ms=busy / 1e3,
        groups={g: dict(count=len(v) / steps, us=sum(v) / steps) for g, v in sorted(per_group.items())},
        layer_kernels=[dict(name=n[:80], group=group_of(n), start_us=s - t0, dur_us=e - s, stream=str(r))
                       for n, s, e, r in layer],
        per_layer_us={g: sum(v) / steps / layers for g, v in per_group.items()},
    )


def main(argv=None) -> int:
    p = arg_parser(__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 8, 32])
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled per case")
    p.add_argument("--compile", action="store_true", help="decode graphs captured from torch.compile")
    args = parse_args(p, argv)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = make_model(args.layers, False, "cuda")
        n_max = max(args.adapters)
        folders = {f"u{i}": write_adapter(model, Path(tmp) / f"u{i}", 16, seed=i) for i in range(n_max)}
        for n in args.adapters:
            if model is None:
                torch.manual_seed(0)
                model = make_model(args.layers, False, "cuda")
            engine = Engine(model, max_loras=max(n_max, 1), max_rank=64, max_num_seqs=args.batch,
                            max_seq_len=PROMPT + 512, max_num_batched_tokens=4096, compile=args.compile,
                            adapters=folders, graph_sizes=[args.batch], graph_token_sizes=())
            start_decoding(engine, args.batch, [f"u{i}" for i in range(n)] or [None], model.config.vocab_size)
            result = profile_case(engine, args.steps, args.layers)
            cases.append(dict(adapters=n, **result))
            print({k: v for k, v in cases[-1].items() if k != "layer_kernels"}, flush=True)
            engine = model = None
            gc.collect()
            torch.cuda.empty_cache()
    groups = sorted({g for c in cases for g in c["groups"]})
    head = "| adapters | wall (ms) | GPU busy (ms) | " + " | ".join(f"{g} (us/layer)" for g in groups) + " |"
    rows = ([c["adapters"], fmt(c["wall_ms"], ".3f"), fmt(c["busy_ms"], ".3f"),
             *(fmt(c["per_layer_us"].get(g, 0.0), ".1f") for g in groups)] for c in cases)
    s = setup("device", "torch", "triton", "transformers", "commit", "date_utc", layers=args.layers, batch=args.batch,
              compile=args.compile)
    report = (f"# One decode step, profiled: Llama-3-8B shape ({args.layers} layers), batch {args.batch}\n\n"
              f"{setup_line(s)}; {'compiled' if args.compile else 'eager'} forward in CUDA graphs; rank-16 adapters "
              f"on all 7 projections. Kernel microseconds per layer, summed over streams.\n\n{table(head, rows)}")
    write_report(args.out, "profile_step", report, dict(setup=s, cases=cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
