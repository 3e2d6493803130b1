"""Where a decode step's LoRA work could live: structures side by side on one Llama-3-8B layer's linear work.

Each variant runs the same chain per layer: RMSNorm, the fused q/k/v GEMM, a rotary-like consumer, the o GEMM,
residual add + RMSNorm, the fused gate/up GEMM, SiLU-and-multiply, the down GEMM, residual add (no attention: its
cost does not depend on the structure). The consumers are torch.compile'd, as in the engine; every layer has its own
weights and adapters, NL layers (> the 60 MB L2) are captured in one CUDA graph and replayed.

- ``base``: the GEMMs and consumers alone.
- ``current``: lorakit's ``add_lora`` after each GEMM (shrink, expand: 2 launches per group, PDL on the expand).
- ``gemm_shrink``: every slot's A rows appended to the group's weight, so the base GEMM also gives ``x @ A.T`` for
  every slot (no shrink launch); the expand reads each token's slot's columns of that output (1 launch per group).
- ``gemm_shrink_consumer``: as ``gemm_shrink``, and the expand is computed inside the consumer that follows the GEMM
  (Inductor's fused kernel gathers each token's B rows): no LoRA launch at all.
- ``fused``: one launch per group, shrink then expand in one kernel (``ops/fused.py``), when present.

    PYTHONPATH=src python bench/bench_structures.py --out DIR [--layers 8] [--batches 1 16 64] [--adapters 8 32]
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from common import arg_parser, copy_gbps, cuda_graph, fmt, median_ms, parse_args, setup, setup_line, table, write_report

from lorakit.ops import add_lora, build_lora_meta
from lorakit.ops.expand import _launch_expand

HIDDEN, Q, KV, INTER = 4096, 4096, 1024, 14336
GROUPS = {  # name: (in_features, slice widths)
    "qkv": (HIDDEN, (Q, KV, KV)),
    "o": (Q, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTER, INTER)),
    "down": (INTER, (HIDDEN,)),
}
RANK = 16
DT = torch.bfloat16
DEVICE = "cuda"


class Group:
    """One LoRA group of one layer: the base weight, S slots of rank-RANK adapters, and (given ``ext``) the weight
    with every slot's A rows appended."""

    def __init__(self, name: str, slots: int, gen: torch.Generator, ext: bool):
        k, widths = GROUPS[name]
        n = sum(widths)
        self.widths, self.n, self.k = widths, n, k

        def rand(*shape, std):
            return (torch.randn(*shape, generator=gen) * std).to(device=DEVICE, dtype=DT)

        self.weight = rand(n, k, std=k ** -0.5)
        self.A = rand(slots, len(widths), RANK, k, std=k ** -0.5)
        self.B = rand(slots, RANK, n, std=RANK ** -0.5)  # stored [S, R, out], read as B.transpose(1, 2)
        self.ranks = torch.full((slots, len(widths)), RANK, dtype=torch.int32, device=DEVICE)
        self.scales = torch.full((slots, len(widths)), 2.0, dtype=torch.float32, device=DEVICE)
        self.ext = torch.cat([self.weight, self.A.reshape(-1, k)]) if ext else None

    def h_view(self, y_ext: torch.Tensor) -> torch.Tensor:
        """The appended columns of the extended GEMM's output as the expand's h [1, n_slices, T, R] (slot stride
        passed apart)."""
        n_slices = len(self.widths)
        return y_ext.as_strided((1, n_slices, y_ext.shape[0], RANK), (0, RANK, y_ext.stride(0), 1),
                                y_ext.storage_offset() + self.n)


def rmsnorm(x, w):
    v = x.float()
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)


def gathered_delta(h, slot, B, scales, i, lo, hi, n_slices):
    """scale * h[t, slot's slice-i columns] @ B[slot, :, lo:hi] for every token t, as pointwise ops over (t, column):
    Inductor fuses it, B gathered by slot, into the consumer kernel."""
    s = slot.clamp(min=0).long()
    base = s * (n_slices * RANK) + i * RANK
    acc = None
    for r in range(RANK):
        hr = torch.gather(h, 1, (base + r)[:, None]).float()
        term = hr * B[s, r, lo:hi].float()
        acc = term if acc is None else acc + term
    scale = torch.where(slot >= 0, scales[s, i], torch.zeros((), device=slot.device))
    return acc * scale[:, None]


def rope_like(q, k, v, cos, sin):
    def rot(x):
        a, b = x.float().unflatten(-1, (-1, 2, 64)).unbind(-2)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2).to(x.dtype)
    return rot(q), rot(k), v.clone()


def make_consumers(compile_: bool):
    c = (lambda f: torch.compile(f, fullgraph=True, dynamic=True)) if compile_ else (lambda f: f)

    def qkv(y, cos, sin, lora=None):
        q, k, v = y.split([Q, KV, KV], -1)
        if lora is not None:
            h, slot, B, scales = lora
            q = q + gathered_delta(h, slot, B, scales, 0, 0, Q, 3)
            k = k + gathered_delta(h, slot, B, scales, 1, Q, Q + KV, 3)
            v = v + gathered_delta(h, slot, B, scales, 2, Q + KV, Q + 2 * KV, 3)
        return rope_like(q, k, v, cos, sin)

    def add_norm(res, o, w, lora=None):
        if lora is not None:
            h, slot, B, scales = lora
            o = o + gathered_delta(h, slot, B, scales, 0, 0, HIDDEN, 1)
        res = res + o.float()
        return res, rmsnorm(res.to(DT), w)

    def silu_mul(y, lora=None):
        g, u = y.split([INTER, INTER], -1)
        if lora is not None:
            h, slot, B, scales = lora
            g = g + gathered_delta(h, slot, B, scales, 0, 0, INTER, 2)
            u = u + gathered_delta(h, slot, B, scales, 1, INTER, 2 * INTER, 2)
        return (F.silu(g.float()) * u.float()).to(DT)

    def add(res, d, lora=None):
        if lora is not None:
            h, slot, B, scales = lora
            d = d + gathered_delta(h, slot, B, scales, 0, 0, HIDDEN, 1)
        return res + d.float()

    def norm(res, w):
        return rmsnorm(res.to(DT), w)

    return {name: c(f) for name, f in
            dict(qkv=qkv, add_norm=add_norm, silu_mul=silu_mul, add=add, norm=norm).items()}


class Layer:
    def __init__(self, slots: int, seed: int, ext: bool):
        gen = torch.Generator().manual_seed(seed)
        self.groups = {name: Group(name, slots, gen, ext) for name in GROUPS}
        self.w1 = torch.ones(HIDDEN, device=DEVICE, dtype=DT)
        self.w2 = torch.ones(HIDDEN, device=DEVICE, dtype=DT)


def group_out(g: Group, x, meta, variant: str, fused=None):
    """The group's output for input x under ``variant`` (before the consumer), and the consumer's LoRA args."""
    if variant in ("gemm_shrink", "gemm_shrink_consumer"):
        y_ext = F.linear(x, g.ext)
        y = y_ext[:, :g.n]
        if variant == "gemm_shrink":
            outs = list(y.split(list(g.widths), -1))
            _launch_expand(outs, g.h_view(y_ext), g.B.transpose(1, 2), g.ranks, g.scales, meta.token_order,
                           meta.tiles, meta.block_m, pdl=True, h_slot_stride=len(g.widths) * RANK)
            return y, None
        return y, (y_ext[:, g.n:], meta.token_slot, g.B, g.scales)
    y = F.linear(x, g.weight)
    if variant == "current":
        add_lora(y, x, g.A, g.B.transpose(1, 2), g.ranks, g.scales, meta, list(g.widths), check=False)
    elif variant == "fused":
        fused(y, x, g.A, g.B.transpose(1, 2), g.ranks, g.scales, meta, list(g.widths))
    return y, None


def forward(layers, res, meta, variant, cons, cos, sin, fused=None):
    xn = cons["norm"](res, layers[0].w1)
    for layer in layers:
        g = layer.groups
        y, lora = group_out(g["qkv"], xn, meta, variant, fused)
        q, k, v = cons["qkv"](y, cos, sin, lora)
        attn = q  # attention's output stands in as q (its cost is the same in every variant)
        y, lora = group_out(g["o"], attn, meta, variant, fused)
        res, xn = cons["add_norm"](res, y, layer.w2, lora)
        y, lora = group_out(g["gate_up"], xn, meta, variant, fused)
        a = cons["silu_mul"](y, lora)
        y, lora = group_out(g["down"], a, meta, variant, fused)
        res = cons["add"](res, y, lora)
        xn = cons["norm"](res, layer.w1)
    return res


def lora_bytes(batch_adapters: int) -> int:
    """The fewest bytes of one layer's LoRA work: each used adapter's A and B once (x and y move anyway)."""
    per = sum(RANK * (len(w) * k + sum(w)) for k, w in GROUPS.values()) * 2
    return batch_adapters * per


def main(argv=None):
    p = arg_parser(__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--adapters", type=int, nargs="+", default=[8, 32])
    p.add_argument("--idle-slots", type=int, default=64,
                   help="also time the extended-GEMM variants with this many slots, only --adapters of them used")
    p.add_argument("--variants", default="base,current,gemm_shrink,gemm_shrink_consumer,fused")
    p.add_argument("--check", action="store_true", help="also check each variant's output against current's")
    args = parse_args(p)
    variants = args.variants.split(",")
    try:
        from lorakit.ops.fused import add_lora_fused as fused
    except ImportError:
        fused = None
        variants = [v for v in variants if v != "fused"]
    torch._dynamo.config.cache_size_limit = 64
    cons = make_consumers(True)
    gbps = copy_gbps(1 << 29)
    cos = torch.rand(1, 64, device="cuda")
    sin = torch.rand(1, 64, device="cuda")
    rows = []
    results = []
    configs = [(a, a) for a in args.adapters] + [(args.adapters[0], args.idle_slots)] * bool(args.idle_slots)
    for adapters, slots in configs:
        layers = [Layer(slots, seed=i, ext=True) for i in range(args.layers)]
        for batch in args.batches:
            used = min(adapters, batch)
            gen = torch.Generator().manual_seed(batch)
            token_slot = (torch.randperm(batch, generator=gen) % used).to(torch.int32).cuda()
            meta = build_lora_meta(token_slot, slots)
            res0 = torch.randn(batch, HIDDEN, device="cuda")
            times = {}
            outs = {}
            for variant in variants:
                if slots != adapters and variant not in ("base", "current", "gemm_shrink", "gemm_shrink_consumer"):
                    continue
                res = res0.clone()

                def run():
                    outs[variant] = forward(layers, res, meta, variant, cons, cos, sin, fused)

                try:
                    graph = cuda_graph(run)
                    times[variant] = 1e3 * median_ms(graph.replay) / args.layers
                    del graph
                except Exception as e:  # a prototype that fails is reported, the others still run
                    print(f"{variant} at batch {batch}, {used} of {slots}: {type(e).__name__}: {e}"[:2000], flush=True)
            base = times.get("base")
            floor_us = lora_bytes(used) / (gbps * 1e3)
            for variant, us in times.items():
                err = None
                if args.check and variant != "current" and "current" in outs and variant != "base":
                    ref = outs["current"]
                    err = float((outs[variant] - ref).norm() / (ref - res0).norm())
                rows.append([f"{used} of {slots}", batch, variant, fmt(us), fmt(us - base if base else None),
                             fmt(base / us if base else None, ".3f"), fmt(floor_us, ".2f"), fmt(err, ".1e")])
                results.append(dict(adapters=used, slots=slots, batch=batch, variant=variant, us_per_layer=us,
                                    lora_us=us - base if base else None, ratio=base / us if base else None,
                                    floor_us=floor_us, rel_err=err))
                print(rows[-1], flush=True)
        del layers
        torch.cuda.empty_cache()
    s = setup("gpu", "torch", "triton", "commit", "date_utc", copy_gbps=gbps, layers=args.layers, rank=RANK)
    md = (f"# LoRA structures side by side: one Llama-3-8B layer's linear work, decode\n\n{setup_line(s)}; "
          f"{args.layers} layers in one CUDA graph, us per layer (median replay / layers); rank {RANK} on all 7 "
          f"projections; copy {gbps:.0f} GB/s measured in the same run. \"LoRA us\" = variant - base, same run; "
          "\"floor\" = the used adapters' A and B bytes at copy bandwidth.\n\n")
    md += table("| adapters used of slots | batch | variant | us / layer | LoRA us | vs base | LoRA byte floor (us) "
                "| rel. err vs current |", rows)
    write_report(args.out, "bench_structures", md, dict(setup=s, rows=results))


if __name__ == "__main__":
    main()
