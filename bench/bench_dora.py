"""DoRA's cost in a layer: the base GEMM, plus plain LoRA, plus DoRA's rescale in the expand, at Llama-3-8B's shapes.

For each projection of Llama-3-8B (fused q/k/v, o, fused gate/up, down) at decode batches of 1, 16 and 64 tokens
shuffled over 8 adapters of rank 16 (and 64) in 8 slots, this times in one run: the base GEMM ``x @ W.T`` alone;
the base GEMM and lorakit's ``add_lora`` (plain LoRA: shrink and expand); the same with every slot a DoRA slot
(``dora`` with 1 row: the gain; 2 rows: a gain and a shift, for a layer with a bias). DoRA's extra cost is
(DoRA layer - LoRA layer) / LoRA layer. It also times the rescale's computation when an adapter is written
(``lorakit.layers.dora.write_gain``: the column norms of W + s B A), per projection.

Timing: common.rotating_us (per call, from a CUDA graph over copies that do not fit in L2). Byte floor of the
rescale: one float32 read per column and tile of tokens of one adapter.

    PYTHONPATH=src python bench/bench_dora.py --out DIR
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import (arg_parser, copy_gbps, fmt, median_ms, parse_args, rotating_us, rotation_method, setup, setup_line,
                    table, write_report)

from lorakit.layers.context import LoraContext
from lorakit.layers.dora import write_gain
from lorakit.layers.linear import LoraLinear, LoraLinearGroup, LoraLinearMember
from lorakit.ops import add_lora, build_lora_meta

H = 4096
LAYERS = {"qkv": (H, [4096, 1024, 1024]), "o": (H, [4096]), "gate_up": (H, [14336, 14336]), "down": (14336, [4096])}
SLOTS = 8
TARGET = 0.05  # DoRA's extra cost at batch 64, of the LoRA layer's time


def problem(i: int, tokens: int, k: int, sizes: list[int], rank: int, rows: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(i)
    n = sum(sizes)
    slots = torch.arange(tokens, device="cuda") % SLOTS
    return dict(
        x=torch.randn(tokens, k, device="cuda", generator=gen).bfloat16(),
        W=(torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16(),
        A=(torch.randn(SLOTS, len(sizes), rank, k, device="cuda", generator=gen) * 0.02).bfloat16(),
        B=(torch.randn(SLOTS, rank, n, device="cuda", generator=gen) * 0.02).bfloat16().transpose(1, 2),
        ranks=torch.full((SLOTS, len(sizes)), rank, dtype=torch.int32, device="cuda"),
        scales=torch.ones(SLOTS, len(sizes), device="cuda"),
        meta=build_lora_meta(slots[torch.randperm(tokens, device="cuda", generator=gen)], SLOTS),
        dora=torch.rand(SLOTS, max(rows, 1), n, device="cuda", generator=gen) - 0.5,
    )


def layer(p: dict, sizes: list[int], mode: str) -> None:
    y = F.linear(p["x"], p["W"])
    if mode != "base":
        add_lora(y, p["x"], p["A"], p["B"], p["ranks"], p["scales"], p["meta"], sizes, check=False,
                 dora=p["dora"] if mode == "dora" else None)


def gain_us(k: int, sizes: list[int], rank: int) -> float:
    """write_gain for every slice of one adapter's slot: what writing a DoRA adapter adds, per projection."""
    linears = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for n in sizes]
    if len(sizes) == 1:
        store = LoraLinear(linears[0], LoraContext(SLOTS), SLOTS)
    else:
        store = LoraLinearGroup(linears, LoraContext(SLOTS), SLOTS)
        for i, m in enumerate(linears):
            LoraLinearMember(m, store, i)
    store.grow(rank)
    store.enable_dora()
    with torch.no_grad():
        store.lora_A.normal_(0, 0.02)
        store.lora_B.normal_(0, 0.02)
    mags = [torch.rand(n, device="cuda") + 0.5 for n in sizes]

    def run():
        for i in range(len(sizes)):
            write_gain(store, 0, i, rank, 2.0, mags[i], False)

    return 1e3 * median_ms(run)


def main(argv=None) -> None:
    p = arg_parser(__doc__)
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--batches", default="1,16,64")
    args = parse_args(p, argv)
    gbps = copy_gbps()
    results, rows_md = [], []
    for rank in map(int, args.ranks.split(",")):
        for tokens in map(int, args.batches.split(",")):
            for name, (k, sizes) in LAYERS.items():
                times = {}
                for mode, rows in (("base", 0), ("lora", 0), ("dora", 1), ("dora2", 2)):
                    us, _ = rotating_us(lambda c, m=("dora" if mode.startswith("dora") else mode): layer(c, sizes, m),
                                        lambda i, r=rows: problem(i, tokens, k, sizes, rank, r))
                    times[mode] = us
                lora = times["lora"] - times["base"]
                extra1 = (times["dora"] - times["lora"]) / times["lora"]
                extra2 = (times["dora2"] - times["lora"]) / times["lora"]
                results.append(dict(rank=rank, tokens=tokens, layer=name, **{f"{m}_us": v for m, v in times.items()},
                                    dora_extra=extra1, dora2_extra=extra2))
                rows_md.append((rank, tokens, name, fmt(times["base"]), fmt(times["lora"]), fmt(lora),
                                fmt(times["dora"]), fmt(100 * extra1, "+.1f"), fmt(times["dora2"]),
                                fmt(100 * extra2, "+.1f")))
    gains = []
    for name, (k, sizes) in LAYERS.items():
        gains.append((name, fmt(gain_us(k, sizes, 16))))
    at64 = [r for r in results if r["tokens"] == 64]
    worst = max(max(r["dora_extra"], r["dora2_extra"]) for r in at64) if at64 else None
    s = setup("gpu", "torch", "triton", "cuda", "commit", "date_utc", copy_gbps=gbps, slots=SLOTS)
    md = [f"# DoRA in a layer: the base GEMM, plain LoRA, DoRA's rescale\n\n{setup_line(s)}; copy bandwidth "
          f"{gbps:.0f} GB/s.\n\n{rotation_method('x, W, A, B, ranks, scales, metadata and the DoRA rescale')}\n",
          table("| rank | tokens | layer | base (us) | base + LoRA (us) | LoRA alone (us) | + DoRA (us) | DoRA extra "
                "(%) | + DoRA with shift (us) | extra (%) |", rows_md),
          f"\nDoRA's extra cost at batch 64, worst layer and rank: {fmt(None if worst is None else 100 * worst, '+.1f')} "
          f"% of the LoRA layer's time (target <= {100 * TARGET:.0f} %: "
          f"{'met' if worst is not None and worst <= TARGET else 'NOT met'}).\n",
          "\nThe rescale's computation when a DoRA adapter of rank 16 is written (write_gain, every slice of one "
          "projection, per layer of the model):\n",
          table("| layer | write_gain (us) |", gains)]
    write_report(args.out, "bench_dora", "\n".join(md), dict(setup=s, results=results,
                                                              write_gain_us=dict(gains), worst_extra_b64=worst))


if __name__ == "__main__":
    main()
