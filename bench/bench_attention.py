"""Paged decode attention: lorakit's achieved bandwidth against SDPA on a dense cache and the copy rate.

lorakit's ``paged_attention`` as achieved bandwidth, against torch SDPA on a dense cache and against the
device-to-device copy bandwidth, all measured in one run on one CUDA device.

Rows: batch 1/16/64 x context 256/2048/8192 (every sequence at that length, one new token each), bf16,
32 query / 8 KV heads, head_dim 128, cache blocks of 16 shuffled over the pool. Lines of one row:
lorakit as launched (split-KV chosen from shapes), lorakit without split-KV (``num_segments=1``, the
plain grid of query blocks x KV heads), and ``F.scaled_dot_product_attention(enable_gqa=True)`` on a
dense [batch, 8, context, 128] cache (no paging: a baseline that reads the same bytes contiguously).
Achieved bandwidth = bytes of K and V read (batch * context * 8 heads * 128 * 2 bytes * 2) / time;
%copy = that / the copy bandwidth (read + write bytes) of a 2 GiB device-to-device copy.

Timing as in bench_ops.py (``common.rotating_us``): per call, from a CUDA graph that makes one call on each of
N independent copies of the inputs (caches, block tables, queries), N chosen so the copies hold >= 256 MB
(at least 2), so no call finds its keys in the 60 MB L2; median of ``triton.testing.do_bench`` over
replays, divided by N. Each line is checked against SDPA in float32 before it is timed.

    PYTHONPATH=src python bench/bench_attention.py --out DIR [--quick]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
from common import (arg_parser, copy_gbps, fmt, parse_args, rotating_us, rotation_method, setup, setup_line, table,
                    write_report)  # bench/ is on sys.path when this file runs as a script

from lorakit.ops.attention import _launch_paged_attention, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES, CONTEXTS = (1, 16, 64), (256, 2048, 8192)
TOLERANCE = 2e-2  # relative error against SDPA in float32
METHOD = rotation_method("the inputs (caches, block tables, metadata, queries)") + (
    " Bytes = K and V of every sequence read once "
    "(batch * context * 8 KV heads * 128 * 2 B * 2); copy bandwidth = read + write bytes of a 2 GiB copy."
)


def kv_bytes(batch: int, context: int) -> int:
    return 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize


def make_paged(batch: int, context: int, seed: int) -> dict:
    """One copy of a decode step: a shuffled block pool holding every sequence, the new tokens' queries."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).int()
    return {
        "query": torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE),
        "k_cache": torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE),
        "v_cache": torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE),
        "block_tables": order.view(batch, per_seq).cuda(),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        "query_start": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
    }


def dense_copy(p: dict) -> dict:
    """The same keys and values, unpaged: [batch, 8, context, 128] for SDPA."""
    batch, context = p["block_tables"].shape[0], int(p["seq_lens"][0])

    def dense(cache):
        return cache[p["block_tables"].long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()

    return {"q": p["query"][:, :, None].clone(), "k": dense(p["k_cache"]), "v": dense(p["v_cache"]),
            "batch": batch}


def run_lorakit(p: dict) -> torch.Tensor:
    return paged_attention(p["query"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
                           p["query_start"], HEAD_DIM**-0.5)


def run_unsplit(p: dict) -> torch.Tensor:
    return _launch_paged_attention(p["query"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
                                   p["query_start"], HEAD_DIM**-0.5, 0.0, 0, num_segments=1)


def run_sdpa(d: dict) -> torch.Tensor:
    return F.scaled_dot_product_attention(d["q"], d["k"], d["v"], scale=HEAD_DIM**-0.5, enable_gqa=True)


def sdpa_reference(p: dict) -> torch.Tensor:
    d = dense_copy(p)
    out = F.scaled_dot_product_attention(d["q"].float(), d["k"].float(), d["v"].float(), scale=HEAD_DIM**-0.5,
                                         enable_gqa=True)
    return out[:, :, 0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.reshape(ref.shape).float()
    return float((out - ref).norm() / ref.norm())


def bench_row(batch: int, context: int, copy_bw: float) -> dict:
    row = {"batch": batch, "context": context, "kv_mb": kv_bytes(batch, context) / 1e6}
    p = make_paged(batch, context, seed=0)
    ref = sdpa_reference(p)
    lines = {"lorakit": (run_lorakit, lambda i: make_paged(batch, context, i)),
             "lorakit_unsplit": (run_unsplit, lambda i: make_paged(batch, context, i)),
             "sdpa_dense": (run_sdpa, lambda i: dense_copy(make_paged(batch, context, i)))}
    for name, (run, make_copy) in lines.items():
        err = rel_err(run(p if name != "sdpa_dense" else dense_copy(p)), ref)
        row[f"{name}_rel_err"] = err
        if err > TOLERANCE:
            row[f"{name}_us"] = None
            print(f"  batch {batch} context {context} {name}: WRONG, relative error {err:.3g}", file=sys.stderr)
            continue
        us, copies = rotating_us(run, make_copy)
        gbps = kv_bytes(batch, context) / (us * 1e-6) / 1e9
        row.update({f"{name}_us": us, f"{name}_copies": copies, f"{name}_gbps": gbps,
                    f"{name}_pct_copy": 100 * gbps / copy_bw})
    del p
    torch.cuda.empty_cache()
    return row


def rows_table(rows: list[dict]) -> str:
    head = ("| batch | context | K+V (MB) | lorakit (us) | GB/s | % copy | no split-KV (us) | GB/s | % copy "
            "| SDPA dense (us) | GB/s | % copy | lorakit / SDPA |")
    lines = []
    for r in rows:
        ratio = None if None in (r.get("lorakit_us"), r.get("sdpa_dense_us")) else r["lorakit_us"] / r["sdpa_dense_us"]
        cells = [r["batch"], r["context"], fmt(r["kv_mb"])]
        for name in ("lorakit", "lorakit_unsplit", "sdpa_dense"):
            cells += [fmt(r.get(f"{name}_us")), fmt(r.get(f"{name}_gbps"), ".0f"),
                      fmt(r.get(f"{name}_pct_copy"), ".0f")]
        lines.append(cells + [fmt(ratio, ".2f")])
    return table(head, lines)


def main(argv=None) -> int:
    p = arg_parser(__doc__, out_help="folder for bench_attention.md and .json")
    p.add_argument("--quick", action="store_true", help="batch 1 and 64 at context 2048 and 8192 only")
    args = parse_args(p, argv)
    s = setup("gpu", "torch", "triton", "cuda", "commit", "date_utc", quick=args.quick, copy_gbps=copy_gbps(),
              method=METHOD, shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                                        dtype=str(DTYPE)))
    print(f"copy {s['copy_gbps']:.0f} GB/s")
    batches, contexts = ((1, 64), (2048, 8192)) if args.quick else (BATCHES, CONTEXTS)
    rows = []
    for batch in batches:
        for context in contexts:
            rows.append(bench_row(batch, context, s["copy_gbps"]))
            r = rows[-1]
            print(f"  batch {batch} context {context}: lorakit {fmt(r.get('lorakit_us'))} us "
                  f"({fmt(r.get('lorakit_pct_copy'), '.0f')} % copy), unsplit {fmt(r.get('lorakit_unsplit_us'))} us, "
                  f"SDPA dense {fmt(r.get('sdpa_dense_us'))} us", flush=True)
    report = "\n\n".join([
        f"# Paged decode attention (bf16, {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE})\n\n"
        f"{setup_line(s)}{' (--quick)' if args.quick else ''}.\nMeasured copy {s['copy_gbps']:.0f} GB/s (read + "
        f"write).\n\n{METHOD}",
        rows_table(rows)])
    write_report(args.out, "bench_attention", report, {"setup": s, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
