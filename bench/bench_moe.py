"""Expert LoRA on an MoE layer against LoRA on the dense layer of the same shape, at decode.

The MoE layer is Mixtral's block (router + 8 experts, top-2, hidden 4096, intermediate 14336, bf16) with LoRA on both
expert parameters (``target_parameters=["experts.gate_up_proj", "experts.down_proj"]``); the dense layer is a Llama
MLP of the same shape with LoRA on gate/up (one group) and down. Each is a layer of a patched one-layer model, timed
alone from a CUDA graph (the batch metadata built inside it, as in the engine's decode graphs): without ids (the base
layer as transformers runs it) and with 1 or 8 rank-16 adapters spread over the batch. LoRA's share of a layer is
(with - without) / with; the target is the MoE layer's share <= 1.5x the dense layer's. The expert LoRA op is also
timed alone, its bytes (A and B of each (slot, expert) the batch routes to, up to the rank, plus x and y) against the
copy bandwidth measured in the same run.

    PYTHONPATH=src python bench/bench_moe.py --out DIR [--batch 64] [--rank 16]
    PYTHONPATH=src python bench/bench_moe.py --out DIR --device cpu --tiny   # a smoke run, no timing value
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
import transformers
from common import arg_parser, copy_gbps, fmt, graph_us, parse_args, setup, setup_line, table, write_report
from safetensors.torch import save_file

import lorakit
from lorakit.layers.moe import LoraExperts
from lorakit.ops import expert_keys

FULL = dict(hidden_size=4096, intermediate_size=14336, experts=8, top_k=2)
TINY = dict(hidden_size=64, intermediate_size=96, experts=4, top_k=2)
TARGET = 1.5


def one_layer(kind: str, shape: dict, device: str) -> torch.nn.Module:
    common = dict(vocab_size=256, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                  num_hidden_layers=1, num_attention_heads=32 if shape["hidden_size"] >= 4096 else 4,
                  num_key_value_heads=8 if shape["hidden_size"] >= 4096 else 2)
    if kind == "moe":
        config = transformers.MixtralConfig(**common, num_local_experts=shape["experts"],
                                            num_experts_per_tok=shape["top_k"])
    else:
        config = transformers.LlamaConfig(**common)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # the stacked experts start uninitialized
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def write_adapter(model: torch.nn.Module, folder: Path, kind: str, rank: int, seed: int) -> Path:
    """A PEFT-format adapter with random weights: the MoE layer's two expert parameters (PEFT's target_parameters
    layout), or the dense MLP's three projections."""
    gen = torch.Generator().manual_seed(seed)
    weights, prefix = {}, "base_model.model.model.layers.0.mlp"
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.01  # noqa: E731
    if kind == "moe":
        experts = model.model.layers[0].mlp.experts
        experts = getattr(experts, "base_layer", experts)  # (the model may be patched already)
        e, i2, h = experts.gate_up_proj.shape
        i = experts.down_proj.shape[2]
        # gate_up_proj is the inner ParamWrapper (PEFT nests them in parameter order)
        for stem, (n_in, n_out) in ((f"{prefix}.experts.base_layer", (h, i2)), (f"{prefix}.experts", (i, h))):
            weights[f"{stem}.lora_A.weight"] = rand(rank * e, n_in)
            weights[f"{stem}.lora_B.weight"] = rand(n_out, rank * e)
        config = dict(target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    else:
        mlp = model.model.layers[0].mlp
        for name in ("gate_proj", "up_proj", "down_proj"):
            m = getattr(mlp, name)
            weights[f"{prefix}.{name}.lora_A.weight"] = rand(rank, m.in_features)
            weights[f"{prefix}.{name}.lora_B.weight"] = rand(m.out_features, rank)
        config = dict(target_modules=["gate_proj", "up_proj", "down_proj"])
    folder.mkdir(parents=True)
    save_file(weights, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank,
                                                                bias="none", **config)))
    return folder


def time_us(fn, device: str) -> float:
    if device == "cuda":
        return graph_us(fn)
    fn()
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def layer_rows(args, shape: dict, tmp: Path, gbps: float) -> list[dict]:
    rows = []
    h, i, e, k = shape["hidden_size"], shape["intermediate_size"], shape["experts"], shape["top_k"]
    t, r = args.batch, args.rank
    for kind in ("dense", "moe"):
        model = one_layer(kind, shape, args.device)
        handle = lorakit.patch(model, max_loras=max(args.adapters))
        for n in range(max(args.adapters)):
            handle.load_adapter(f"a{n}", write_adapter(model, tmp / f"{kind}{n}", kind, r, seed=n))
        layer = model.model.layers[0].mlp
        ctx = handle._ctx  # the layer alone, outside the model's forward: begin the pass as its pre-hook would
        gen = torch.Generator(device=args.device).manual_seed(0)
        x = torch.randn(t, 1, h, device=args.device, dtype=handle.dtype, generator=gen)
        base_bytes = (3 * h * i) * handle.dtype.itemsize * (e if kind == "moe" else 1)
        with torch.no_grad():
            ctx.begin(None)
            base_us = time_us(lambda: layer(x), args.device)
            for n in args.adapters:
                ids = (torch.arange(t, device=args.device) % n).long()

                def step():
                    ctx.begin(ids)  # drops the metadata: built inside the graph, as in the engine
                    return layer(x)

                lora_us = time_us(step, args.device)
                pairs = _routed_pairs(layer, x, ids, e) if kind == "moe" else n
                lora_bytes = pairs * r * (h + 2 * i + i + h) * handle.dtype.itemsize
                if kind == "dense":
                    lora_bytes += n * r * h * handle.dtype.itemsize  # gate and up have an A each
                rows.append(dict(layer=kind, adapters=n, batch=t, rank=r, base_us=base_us, lora_us=lora_us,
                                 share=(lora_us - base_us) / lora_us, base_bytes=base_bytes, lora_bytes=lora_bytes,
                                 slot_expert_pairs=pairs if kind == "moe" else None,
                                 base_pct=100 * base_bytes / (base_us * 1e-6) / 1e9 / gbps,
                                 lora_flops=2 * t * (k if kind == "moe" else 1) * r * (2 * h + 3 * i)))
            ctx.end()
        if kind == "moe":
            rows += op_rows(args, layer, x, gbps)
        del model, handle
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _routed_pairs(block, x, ids, experts) -> int:
    """The distinct (slot, expert) pairs the batch routes to: whose A and B the expert LoRA reads."""
    _, _, top = block.gate(x.view(-1, x.shape[-1]))
    keys = ids[:, None] * experts + top
    return int(torch.unique(keys).numel())


def op_rows(args, block, x, gbps: float) -> list[dict]:
    """lorakit::expert_lora alone on the block's routing, each expert parameter, for each adapter count."""
    experts: LoraExperts = block.experts
    rows = []
    _, _, top = block.gate(x.view(-1, x.shape[-1]))
    t, k = top.shape
    flat = top.reshape(-1)
    for n in args.adapters:
        ids = (torch.arange(t, device=x.device) % n).repeat_interleave(k)
        meta = expert_keys(ids, flat, experts.slots[experts.up_name].num_slots, experts.num_experts)
        pairs = int(torch.unique(ids * experts.num_experts + flat).numel())
        for name, store in experts.slots.items():
            xs = torch.randn(t * k, store.in_features, device=x.device, dtype=store.dtype)
            y = torch.zeros(t * k, store.out_features, device=x.device, dtype=store.dtype)
            us = time_us(lambda: store.add(y, xs, meta, experts.ctx.kernels), args.device)
            nbytes = (pairs * args.rank * (store.in_features + store.out_features)
                      + t * k * (store.in_features + 2 * store.out_features)) * store.dtype.itemsize
            rows.append(dict(op=name, adapters=n, pairs=pairs, us=us, bytes=nbytes,
                             pct=100 * nbytes / (us * 1e-6) / 1e9 / gbps))
    return rows


def main(argv=None) -> int:
    p = arg_parser(__doc__, smoke=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=lambda v: tuple(int(n) for n in v.split(",")), default=(1, 8))
    args = parse_args(p, argv)
    shape = TINY if args.tiny else FULL
    gbps = copy_gbps(1 << 29) if args.device == "cuda" else float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        rows = layer_rows(args, shape, Path(tmp), gbps)
    layers = [r for r in rows if "layer" in r]
    ops = [r for r in rows if "op" in r]
    ratios = []
    for n in args.adapters:
        dense = next(r for r in layers if r["layer"] == "dense" and r["adapters"] == n)
        moe = next(r for r in layers if r["layer"] == "moe" and r["adapters"] == n)
        ratios.append(dict(adapters=n, dense_share=dense["share"], moe_share=moe["share"],
                           ratio=moe["share"] / dense["share"] if dense["share"] > 0 else float("nan")))
    s = setup("device", "torch", "triton", "transformers", "commit", "date_utc", device=args.device, copy_gbps=gbps,
              batch=args.batch, rank=args.rank, **shape)
    met = all(r["ratio"] <= TARGET for r in ratios)
    md = [f"# Expert LoRA on an MoE layer vs LoRA on the dense layer (decode)\n\n{setup_line(s)}; copy {gbps:.0f} GB/s "
          f"measured in the same run. {shape['experts']} experts top-{shape['top_k']}, hidden {shape['hidden_size']}, "
          f"intermediate {shape['intermediate_size']}, batch {args.batch}, rank {args.rank}, adapters spread round "
          f"robin over the batch; each layer from a CUDA graph, the batch metadata built inside it.",
          "## Layers (us)\n\n" + table(
              "| layer | adapters | base | with LoRA | LoRA share | base weights / time (% of copy) | LoRA bytes "
              "(MB) | (slot, expert) pairs |",
              ([r["layer"], r["adapters"], fmt(r["base_us"]), fmt(r["lora_us"]), f"{100 * r['share']:.1f} %",
                fmt(r["base_pct"], ".0f"), fmt(r["lora_bytes"] / 1e6, ".2f"), fmt(r["slot_expert_pairs"], "d")]
               for r in layers)),
          "## LoRA's share: MoE vs dense (target <= 1.5x)\n\n" + table(
              "| adapters | dense share | MoE share | MoE / dense | target met |",
              ([r["adapters"], f"{100 * r['dense_share']:.1f} %", f"{100 * r['moe_share']:.1f} %", fmt(r["ratio"], ".2f"),
                fmt(r["ratio"] <= TARGET)] for r in ratios)),
          "## lorakit::expert_lora alone (us; % = bytes / time / copy bandwidth)\n\n" + table(
              "| parameter | adapters | (slot, expert) pairs | us | bytes (MB) | % of copy |",
              ([r["op"], r["adapters"], r["pairs"], fmt(r["us"]), fmt(r["bytes"] / 1e6, ".2f"), fmt(r["pct"], ".0f")]
               for r in ops))]
    write_report(args.out, "bench_moe", "\n\n".join(md), {"setup": s, "layers": layers, "ratios": ratios, "ops": ops,
                                                         "target_met": met})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
