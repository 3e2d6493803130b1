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

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

import lorakit

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_model(layers: int, tiny: bool, device: str) -> torch.nn.Module:
    if tiny:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2)
    else:
        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.eval()


def write_adapter(model: torch.nn.Module, folder: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter folder with random weights on every projection (no PEFT needed)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, torch.nn.Linear):
            weights[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.01
            weights[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(weights, folder / "adapter_model.safetensors")
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), bias="none")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


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

    def cuda(fn):
        import triton

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return 1e3 * triton.testing.do_bench(graph.replay, return_mode="median")

    return cpu if device == "cpu" else cuda


def copy_gbps(device: str) -> float:
    if device == "cpu":
        return float("nan")
    import triton

    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke run)")
    p.add_argument("--quick", action="store_true", help="batch 16 and 8 adapters only")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_patch.py needs a CUDA device (or --device cpu --tiny for a smoke run)")
    args.out.mkdir(parents=True, exist_ok=True)
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
    time_us, gbps = timer(args.device), copy_gbps(args.device)
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
    setup = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                 transformers=transformers.__version__, commit=os.environ.get("LORAKIT_COMMIT", "unknown"),
                 date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                 layers=args.layers, tiny=args.tiny, rank=rank, copy_gbps=gbps)
    table = ["| batch | adapters | base forward (us) | with adapters (us) | overhead | adapter bytes / copy BW (us) |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['adapters']} | {r['base_us']:.0f} | {r['lorakit_us']:.0f} | "
              f"{r['overhead_pct']:+.0f} % | {r['adapter_floor_us']:.1f} |" for r in rows]
    header = (f"# lorakit.patch: a decode-shaped forward of {args.layers} Llama-3-8B layers\n\n"
              f"{setup['device']}, torch {setup['torch']}, transformers {setup['transformers']}, commit "
              f"{setup['commit']}, {setup['date_utc']} UTC; rank-16 adapters on all 7 projections; compiled "
              f"whole (fullgraph), one CUDA graph replay per forward; copy {gbps:.0f} GB/s.\n\n")
    (args.out / "bench_patch.md").write_text(header + "\n".join(table) + "\n")
    (args.out / "bench_patch.json").write_text(json.dumps(dict(setup=setup, rows=rows), indent=1))
    print(header + "\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
