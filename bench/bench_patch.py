"""What lorakit.patch costs in a whole model: one decode-shaped forward (one new token per sequence) of a
Llama-3-8B-shaped stack, compiled whole and replayed from a CUDA graph, with and without adapters.

For batch B and L distinct rank-16 adapters on all 7 projections of every layer: the time of a forward
with ``lora_ids`` against the same patched model without them (LoRA skipped, the base graph), the
extra bytes the adapters must move (each used adapter's A and B once) over the copy bandwidth measured
in the same run, and lorakit's overhead as a share of the base forward.

    PYTHONPATH=src python bench/bench_patch.py --out DIR [--layers 4] [--quick]
    PYTHONPATH=src python bench/bench_patch.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from common import (TARGETS, arg_parser, copy_gbps, fmt, graph_us, make_model, parse_args, setup, setup_line, table,
                    write_adapter, write_report)  # bench/ is on sys.path when this file runs as a script

import lorakit


def timer(device: str):
    """Median microseconds of fn: a CUDA graph replayed with do_bench on a GPU, wall clock on the CPU."""
    def cpu(fn):
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * sorted(times)[2]

    return cpu if device == "cpu" else graph_us


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="batch 16 and 8 adapters only")
    args = parse_args(p, argv)
    torch.manual_seed(0)
    model = make_model(args.layers, args.tiny, args.device)
    batches, counts, rank = ((16,), (8,), 16) if args.quick else ((1, 16, 64), (1, 8, 32), 16)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [write_adapter(model, Path(tmp) / f"a{i}", rank, seed=i) for i in range(max(counts))]
        handle = lorakit.patch(model, max_loras=max(counts))
        for i, folder in enumerate(folders):
            handle.load_adapter(f"a{i}", folder)
    adapter_bytes = sum(m.in_features + m.out_features for n, m in handle.layers.items()
                        if n.rsplit(".", 1)[-1] in TARGETS) * rank * model.dtype.itemsize
    # One static graph per (batch, with or without ids), as an engine's batch-size buckets would have.
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.recompile_limit = 16
    compiled = torch.compile(model, fullgraph=True)
    time_us, gbps = timer(args.device), float("nan") if args.device == "cpu" else copy_gbps(1 << 29)
    rows = []
    with torch.no_grad():
        for batch in batches:
            input_ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=args.device)
            base_us = time_us(lambda: compiled(input_ids=input_ids, use_cache=False))
            for n in sorted({min(n, batch) for n in counts}):
                ids = handle.ids([f"a{b % n}" for b in range(batch)])
                us = time_us(lambda: compiled(input_ids=input_ids, lora_ids=ids, use_cache=False))
                floor_us = n * adapter_bytes / (gbps * 1e3)
                rows.append(dict(batch=batch, adapters=n, base_us=base_us, lorakit_us=us,
                                 overhead_pct=100 * (us - base_us) / base_us, adapter_floor_us=floor_us))
                print(rows[-1], flush=True)
    s = setup("device", "torch", "transformers", "commit", "date_utc", device=args.device, layers=args.layers,
              tiny=args.tiny, rank=rank, copy_gbps=gbps)
    head = "| batch | adapters | base forward (us) | with adapters (us) | overhead | adapter bytes / copy BW (us) |"
    rows_md = table(head, ([r["batch"], r["adapters"], fmt(r["base_us"], ".0f"), fmt(r["lorakit_us"], ".0f"),
                            fmt(r["overhead_pct"], "+.0f") + " %", fmt(r["adapter_floor_us"])] for r in rows))
    report = (f"# lorakit.patch: a decode-shaped forward of {args.layers} Llama-3-8B layers\n\n{setup_line(s)}; "
              "rank-16 adapters on all 7 projections; compiled whole (fullgraph), one CUDA graph replay per forward; "
              f"copy {gbps:.0f} GB/s.\n\n{rows_md}")
    write_report(args.out, "bench_patch", report, dict(setup=s, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
