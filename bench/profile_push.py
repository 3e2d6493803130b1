"""Where one push from GPU tensors spends its time: a Llama-3-8B-shaped rank-16 adapter (all 7 projections, 32 layers)
pushed to an ``AdapterPool``, phase by phase with a device sync between phases (checks, layout + copy to the host,
sha256, install, upload into a slot; median of 5), then cProfile of whole pushes and, on a GPU, torch.profiler's
busiest ops and the caching host allocator's counters. ``bench_pool.py`` gives the end-to-end figure; this says where
it goes.

    PYTHONPATH=src python bench/profile_push.py --out DIR
    PYTHONPATH=src python bench/profile_push.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from common import arg_parser, make_model, parse_args, setup, setup_line, write_adapter  # bench/ on sys.path

import lorakit
from lorakit.adapters.snapshot import PUSHED, Snapshot, config_json, image_digest

PHASES = ("whole push", "checks", "layout + copy to the host", "sha256", "install", "upload into a slot")


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    args = parse_args(p, argv)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model = make_model(32, args.tiny, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_adapter(model, Path(tmp) / "p", 16, seed=9)
        state = load_file(folder / "adapter_model.safetensors")
        config = json.loads((folder / "adapter_config.json").read_text())
    handle = lorakit.patch(model, max_loras=2, max_rank=64)
    pool = lorakit.AdapterPool(handle, cpu_budget_bytes=1 << 30)
    weights = {k: v.to(args.device, torch.bfloat16 if cuda else v.dtype) for k, v in state.items()}

    def push():
        pool.push("p", weights, config)
        pool.prefetch(["p"])
        pool.synchronize()

    def timed(fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, 1e3 * (time.perf_counter() - start)

    for _ in range(3):
        push()
    rows = []
    config_bytes = config_json(config, "profile")
    for _ in range(5):
        _, whole = timed(push)
        (info, adapter), checks = timed(lambda: handle.read_state_dict("p", weights, json.loads(config_bytes), PUSHED))
        image, layout = timed(lambda: handle.pack(adapter, pin=cuda))
        sha, digest = timed(lambda: image_digest(config_bytes, image))
        snapshot = Snapshot("p", info, sha, (), image)
        snapshot.reader = pool
        _, install = timed(lambda: pool.install(snapshot))
        _, upload = timed(lambda: (pool.prefetch(["p"]), pool.synchronize()))
        rows.append((whole, checks, layout, digest, install, upload))
    medians = [statistics.median(column) for column in zip(*rows)]

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        push()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    extra = ""
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                push()
        host = {k: v for k, v in torch.cuda.host_memory_stats().items() if k.startswith(("num_", "host_alloc"))}
        extra = (f"\n## torch.profiler, 2 pushes\n\n```\n{prof.key_averages().table(sort_by='cpu_time_total', row_limit=25)}"
                 f"\n```\n\n## The caching host allocator\n\n```\n{json.dumps(host, indent=1)}\n```\n")
    s = setup("device", "torch", "commit", "date_utc", device=args.device, tiny=args.tiny)
    report = (f"# One push from {'GPU' if cuda else 'host'} tensors, phase by phase\n\n{setup_line(s)}. Medians of 5, "
              f"a device sync between phases ({image.nbytes / 1e6:.1f} MB image).\n\n| phase | ms |\n|---|---|\n"
              + "".join(f"| {name} | {ms:.2f} |\n" for name, ms in zip(PHASES, medians))
              + f"\n## cProfile, 5 whole pushes (by own time)\n\n```\n{text.getvalue()}\n```\n" + extra)
    (args.out / "profile_push.md").write_text(report)
    print(report[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
