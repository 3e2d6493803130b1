"""lorakit's whole LoRA delta of one layer (``add_lora``) against the best public kernels, baselines, rooflines.

For every row of ``bench/anchors.py`` (bf16, h_in 4096) this times, in one run on one CUDA device:
lorakit's ``add_lora`` (batch metadata built outside the timed region, as one forward shares it), the
base GEMM ``x @ W.T``, a PEFT-style loop (boolean mask per adapter, two matmuls, index put) and
gather + bmm (``A[slots]``, ``B[slots]`` per token). Ceilings come from the same run: device-to-device
copy bandwidth (read + write bytes) and the bf16 matmul rate at 8192^3. A mixed-rank case (ranks 8..128
in a pool of R_max 128) is timed against the same batch with every rank at 128.

Timing: per call, from a CUDA graph that makes one call on each of N independent copies of all inputs,
N chosen so the copies hold >= 256 MB (no call finds its data in the 60 MB L2); the median of
``triton.testing.do_bench`` over graph replays, divided by N. Kernels are compiled on a side stream
before capture. The PEFT loop syncs with the host (boolean masks), so it runs eagerly, over two copies.

    PYTHONPATH=src python bench/bench_ops.py --out DIR [--quick]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from anchors import ANCHORS, H_IN, Anchor  # bench/ is on sys.path when this file runs as a script
from common import (arg_parser, copy_gbps, fmt, matmul_tflops, parse_args, rotating_us, rotation_method, setup,
                    setup_line, table, write_report)

from lorakit.ops import KernelOptions, add_lora, build_lora_meta
from lorakit.ops._checks import pdl_supported
from lorakit.ops.expand import _launch_expand
from lorakit.ops.reference import lora_ref

SCALE = 0.5
TOLERANCE = {torch.bfloat16: 2e-2}  # relative error on the delta, ||out - ref|| / ||ref - y||
CHECK_TOKENS = 64  # tokens compared with the float64 reference
RANK_SEED = 0  # mixed-rank case: ranks drawn uniformly from 8..128 with this seed
NAIVE_KEYS = ("x", "y", "A", "B_store", "scales", "slots")
PDL_ON, PDL_OFF = KernelOptions(), KernelOptions(pdl=frozenset())  # the default (the expand), and no kernel
METHOD = rotation_method("all inputs (x, y, A, B, ranks, scales, metadata, W)") + (
    " lorakit's batch metadata is built outside the timed region. The PEFT-style loop cannot be captured "
    "(boolean masks sync with the host): it is timed eagerly over two copies. "
    "Byte floor = (x once + each used adapter's A and B rows up to its rank once + y read and written) "
    "/ the copy bandwidth measured in this run."
)


@dataclass(frozen=True)
class Case:
    """T tokens over L adapters (adapter i in slot i, rank ranks[i]) in a pool of max(L, 8) slots of R_max."""

    mode: str  # "decode": tokens shuffled over the adapters; "prefill": L contiguous segments
    T: int
    L: int
    h_out: int
    r_max: int
    ranks: tuple[int, ...]

    @property
    def num_slots(self) -> int:
        return max(self.L, 8)


def byte_floor(num_tokens: int, h_in: int, h_out: int, used_ranks, elem_bytes: int = 2) -> int:
    """Fewest bytes one call moves: x read once, each used adapter's A and B up to its rank once, y read + written."""
    return elem_bytes * (num_tokens * h_in + sum(used_ranks) * (h_in + h_out) + 2 * num_tokens * h_out)


def make_slots(case: Case, gen: torch.Generator) -> torch.Tensor:
    t = torch.arange(case.T)
    if case.mode == "decode":
        return (t % case.L)[torch.randperm(case.T, generator=gen)]
    return t * case.L // case.T


def make_problem(case: Case, seed: int = 0) -> dict:
    """One copy of every input, random bf16 (x ~ N(0, 1), A and B ~ N(0, 0.05^2)), on the current CUDA device."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    S, R = case.num_slots, case.r_max

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).to(torch.bfloat16)

    ranks = torch.full((S, 1), R, dtype=torch.int32)
    ranks[: case.L, 0] = torch.tensor(case.ranks, dtype=torch.int32)
    return {
        "x": randn(case.T, H_IN),
        "y": randn(case.T, case.h_out),
        "A": randn(S, 1, R, H_IN, std=0.05),
        "B_store": randn(S, R, case.h_out, std=0.05),  # B = B_store.transpose(1, 2), the fast layout
        "ranks": ranks.cuda(),
        "scales": torch.full((S, 1), SCALE, dtype=torch.float32, device="cuda"),
        "slots": make_slots(case, torch.Generator().manual_seed(seed)).cuda(),
    }


def clone(p: dict, keys) -> dict:
    return {k: p[k].clone() for k in keys}


def lorakit_copy(p: dict, num_slots: int) -> dict:
    c = clone(p, ("x", "y", "A", "B_store", "ranks", "scales", "slots"))
    c["meta"] = build_lora_meta(c["slots"], num_slots)
    return c


def gemm_copy(p: dict) -> dict:
    h_out = p["y"].shape[1]
    return {"x": p["x"].clone(), "W": torch.randn(h_out, H_IN, device="cuda", dtype=torch.bfloat16)}


def run_lorakit(c: dict, check: bool = True, options: KernelOptions = PDL_ON) -> None:
    add_lora(c["y"], c["x"], c["A"], c["B_store"].transpose(1, 2), c["ranks"], c["scales"], c["meta"], check=check,
             options=options)


def run_gemm(c: dict) -> torch.Tensor:
    return c["x"] @ c["W"].T


def layer_copy(p: dict, num_slots: int) -> dict:
    return lorakit_copy(p, num_slots) | gemm_copy(p)


def run_layer(c: dict, options: KernelOptions = PDL_ON) -> None:
    """A whole LoRA layer as LoraLinear runs it: the base GEMM, then add_lora into its output."""
    y = c["x"] @ c["W"].T
    add_lora(y, c["x"], c["A"], c["B_store"].transpose(1, 2), c["ranks"], c["scales"], c["meta"], options=options)


def run_gather_bmm(c: dict) -> None:
    slots = c["slots"]
    h = torch.bmm(c["x"][:, None], c["A"][:, 0][slots].transpose(1, 2))  # [T, 1, r]
    c["y"] += c["scales"][slots] * torch.bmm(h, c["B_store"][slots])[:, 0]


def run_peft_loop(c: dict, num_adapters: int) -> None:
    """PEFT's mixed-batch forward: per adapter, a boolean mask gather, lora_A, lora_B, index put."""
    x, y, slots = c["x"], c["y"], c["slots"]
    for s in range(num_adapters):
        idx = slots == s
        y[idx] += SCALE * (x[idx] @ c["A"][s, 0].T) @ c["B_store"][s]


def check_lorakit(case: Case, p: dict) -> float:
    """Relative error of lorakit's delta against the float64 reference on up to CHECK_TOKENS tokens."""
    y = p["y"].clone()
    B = p["B_store"].transpose(1, 2)
    add_lora(y, p["x"], p["A"], B, p["ranks"], p["scales"], build_lora_meta(p["slots"], case.num_slots))
    idx = torch.randperm(case.T, generator=torch.Generator().manual_seed(1))[:CHECK_TOKENS].cuda()
    y0 = p["y"][idx]
    ref = lora_ref(y0, p["x"][idx], p["A"], B, p["ranks"].cpu(), p["scales"].cpu(), p["slots"][idx].cpu(),
                   [case.h_out])
    return float((y[idx].double().cpu() - ref).norm() / (ref - y0.double().cpu()).norm())


def bench_lorakit(case: Case, p: dict, gbps: float) -> dict:
    """Check, then time lorakit on one problem; the byte floor counts only the adapters the batch uses."""
    err = check_lorakit(case, p)
    used = set(p["slots"].tolist())
    floor_us = byte_floor(case.T, H_IN, case.h_out, [case.ranks[s] for s in used]) / (gbps * 1e3)
    out = {"rel_err": err, "floor_us": floor_us, "lorakit_us": None, "status": "ok"}
    if err > TOLERANCE[torch.bfloat16]:
        out["status"] = f"WRONG: relative error {err:.3g} > {TOLERANCE[torch.bfloat16]}, not timed"
        print(f"  {case.mode} T={case.T} L={case.L} h_out={case.h_out}: {out['status']}", file=sys.stderr)
        return out
    out["lorakit_us"], out["lorakit_copies"] = rotating_us(run_lorakit, lambda i: lorakit_copy(p, case.num_slots))
    out["no_pdl_us"] = None
    if pdl_supported(p["x"].device):  # the same kernels launched without programmatic dependent launch
        out["no_pdl_us"], _ = rotating_us(partial(run_lorakit, options=PDL_OFF),
                                          lambda i: lorakit_copy(p, case.num_slots))
    return out


def host_time() -> list[dict]:
    """Host microseconds of one eager call (no graph; T=1, so the device idles and wall time per call is host time):
    add_lora as layers call it (kernels launched directly) and through the dispatcher (torch.ops.lorakit.*)."""
    import time

    case = Case("decode", 1, 1, 4096, 16, (16,))
    p = make_problem(case)
    c = lorakit_copy(p, case.num_slots)
    B, meta = c["B_store"].transpose(1, 2), c["meta"]
    h = torch.ops.lorakit.shrink(c["x"], c["A"], c["ranks"], meta.token_slot, meta.token_order, meta.tiles,
                                 meta.block_m, 1)

    def via_ops():
        hh = torch.ops.lorakit.shrink(c["x"], c["A"], c["ranks"], meta.token_slot, meta.token_order, meta.tiles,
                                      meta.block_m, 1)
        torch.ops.lorakit.expand([c["y"]], hh, B, c["ranks"], c["scales"], meta.token_slot, meta.token_order,
                                 meta.tiles, meta.block_m)

    rows = []
    for what, fn in (("add_lora (kernels launched directly)", lambda: run_lorakit(c)),
                     ("add_lora(check=False), as the LoRA layers call it", lambda: run_lorakit(c, check=False)),
                     ("torch.ops.lorakit.shrink + expand (the dispatcher)", via_ops),
                     ("one expand launch (Triton's kernel[grid](...))",
                      lambda: _launch_expand([c["y"]], h, B, c["ranks"], c["scales"], meta.token_order, meta.tiles,
                                             meta.block_m))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(1000):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / 1000 * 1e6)
        rows.append({"what": what, "host_us": best})
    return rows


def selected_anchors(quick: bool) -> tuple[Anchor, ...]:
    """Every anchor row; with --quick the r=16, h_out=4096 decode rows and one prefill row."""
    if not quick:
        return ANCHORS
    return tuple(a for a in ANCHORS if a.r == 16 and a.h_out == 4096 and (a.mode == "decode" or a.L == 8))


def bench_row(a: Anchor, gbps: float, quick: bool) -> dict:
    case = Case(a.mode, a.T, a.L, a.h_out, a.r, (a.r,) * a.L)
    row = {k: getattr(a, k) for k in ("mode", "T", "L", "r", "h_out")}
    row.update(best_us=a.best_us, which=a.which, peft_loop_us=None, gather_bmm_us=None, base_gemm_us=None)
    p = make_problem(case)
    row.update(bench_lorakit(case, p, gbps))
    if row["lorakit_us"] is None:
        return row
    row["base_gemm_us"], row["base_gemm_copies"] = rotating_us(run_gemm, lambda i: gemm_copy(p))
    if a.mode == "decode":  # what LoRA adds to a whole layer, after the base GEMM (PDL on, off)
        for how, options in (("after", PDL_ON), ("after_no_pdl", PDL_OFF)):
            us, _ = rotating_us(partial(run_layer, options=options), lambda i: layer_copy(p, case.num_slots))
            row[f"layer_{how}_us"], row[f"lora_{how}_us"] = us, us - row["base_gemm_us"]
    if not quick:
        def naive_copy(i):
            return clone(p, NAIVE_KEYS)

        row["gather_bmm_us"], row["gather_bmm_copies"] = rotating_us(run_gather_bmm, naive_copy)
        peft = partial(run_peft_loop, num_adapters=a.L)
        row["peft_loop_us"], row["peft_loop_copies"] = rotating_us(peft, naive_copy, graph=False)
    us = row["lorakit_us"]
    row["pct_copy_bw"] = 100 * row["floor_us"] / us
    row["pct_base_gemm"] = 100 * us / row["base_gemm_us"]
    row["vs_best"] = us / a.best_us
    row["within_1_5x_best"] = row["vs_best"] <= 1.5
    row["beats_naive"] = None if quick else us < min(row["gather_bmm_us"], row["peft_loop_us"])
    return row


def bench_mixed(L: int, h_out: int, gbps: float) -> dict:
    ranks = tuple(torch.randint(8, 129, (L,), generator=torch.Generator().manual_seed(RANK_SEED)).tolist())
    row = {"T": 256, "L": L, "h_out": h_out, "r_max": 128, "ranks": list(ranks)}
    results = {}
    for name, case in (("mixed", Case("decode", 256, L, h_out, 128, ranks)),
                       ("all128", Case("decode", 256, L, h_out, 128, (128,) * L))):
        results[name] = bench_lorakit(case, make_problem(case), gbps)
        torch.cuda.empty_cache()
        row.update({f"{name}_{k}": v for k, v in results[name].items()})
    mixed, full = results["mixed"], results["all128"]
    ok = mixed["lorakit_us"] is not None and full["lorakit_us"] is not None
    row["ratio"] = mixed["lorakit_us"] / full["lorakit_us"] if ok else None
    row["floor_ratio"] = mixed["floor_us"] / full["floor_us"]  # what the bytes alone allow
    row["meets_0_6x"] = ok and row["ratio"] <= 0.6
    return row


def rows_table(rows: list[dict]) -> str:
    head = ("| mode | T | L | r | h_out | lorakit (us) | PDL off (us) | byte floor (us) | % copy BW | % base GEMM "
            "| base GEMM (us) | PEFT loop* (us) | gather+bmm (us) | best public (us) | lorakit / best | beats naive "
            "| <= 1.5x best |")
    cells = ([r["mode"], r["T"], r["L"], r["r"], r["h_out"],
              fmt(r["lorakit_us"]) if r["status"] == "ok" else r["status"], fmt(r.get("no_pdl_us")),
              fmt(r["floor_us"], ".2f"),
              fmt(r.get("pct_copy_bw"), ".0f"), fmt(r.get("pct_base_gemm"), ".0f"), fmt(r["base_gemm_us"]),
              fmt(r["peft_loop_us"], ".0f"), fmt(r["gather_bmm_us"], ".0f"), fmt(r["best_us"]),
              fmt(r.get("vs_best"), ".2f"), fmt(r.get("beats_naive")), fmt(r.get("within_1_5x_best"))] for r in rows)
    return table(head, cells) + (
        "\n\n*PEFT loop: eager (boolean masks sync with the host), over rotating copies; all else CUDA graphs.")


def layer_table(rows: list[dict]) -> str:
    head = ("| T | L | r | h_out | base GEMM (us) | layer, delta after (us) | layer, after, PDL off (us) "
            "| LoRA's cost after (us) | after, PDL off (us) |")
    return table(head, ([r["T"], r["L"], r["r"], r["h_out"], fmt(r["base_gemm_us"]), fmt(r["layer_after_us"]),
                         fmt(r["layer_after_no_pdl_us"]), fmt(r["lora_after_us"]), fmt(r["lora_after_no_pdl_us"])]
                        for r in rows if r.get("layer_after_us") is not None))


def mixed_table(rows: list[dict]) -> str:
    head = ("| T | L | h_out | R_max | mean rank | mixed (us) | all-128 (us) | mixed / all-128 | floor mixed (us) "
            "| floor all-128 (us) | floor ratio | <= 0.6x |")
    return table(head, ([r["T"], r["L"], r["h_out"], r["r_max"], fmt(sum(r["ranks"]) / r["L"]),
                         fmt(r["mixed_lorakit_us"]), fmt(r["all128_lorakit_us"]), fmt(r["ratio"], ".2f"),
                         fmt(r["mixed_floor_us"], ".2f"), fmt(r["all128_floor_us"], ".2f"),
                         fmt(r["floor_ratio"], ".2f"), fmt(r["meets_0_6x"])] for r in rows))


def summary(rows: list[dict], mixed: list[dict]) -> str:
    timed = [r for r in rows if r["status"] == "ok"]
    naive = [r for r in timed if r["beats_naive"] is not None]
    return (f"{len(timed)}/{len(rows)} rows correct and timed; "
            f"{sum(r['beats_naive'] for r in naive)}/{len(naive)} faster than both naive baselines; "
            f"{sum(r['within_1_5x_best'] for r in timed)}/{len(timed)} within 1.5x of the best public; "
            f"{sum(m['meets_0_6x'] for m in mixed)}/{len(mixed)} mixed-rank cases at <= 0.6x all-128.")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, no plot written (pip install matplotlib)")
        return
    dec = [r for r in rows if r["mode"] == "decode" and r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(dec)), 5))
    for key, label in (("lorakit_us", "lorakit"), ("best_us", "best public"), ("floor_us", "byte floor")):
        ax.plot(range(len(dec)), [r[key] for r in dec], "o-", label=label)
    ax.set_xticks(range(len(dec)), [f"T{r['T']} L{r['L']} r{r['r']} n{r['h_out']}" for r in dec], rotation=90,
                  fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("us per call")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = arg_parser(__doc__, out_help="folder for bench_ops.md, .json and .png")
    p.add_argument("--quick", action="store_true", help="r=16, h_out=4096 rows, lorakit and base GEMM only")
    args = parse_args(p, argv)
    s = setup("gpu", "torch", "triton", "cuda", "commit", "date_utc", quick=args.quick, copy_gbps=copy_gbps(),
              matmul_tflops=matmul_tflops(), method=METHOD)
    print(f"copy {s['copy_gbps']:.0f} GB/s, bf16 matmul {s['matmul_tflops']:.0f} TFLOP/s")
    rows = []
    for a in selected_anchors(args.quick):
        rows.append(bench_row(a, s["copy_gbps"], args.quick))
        print(f"  {a.mode} T={a.T} L={a.L} r={a.r} h_out={a.h_out}: lorakit {fmt(rows[-1]['lorakit_us'])} us "
              f"(best public {a.best_us} us)", flush=True)
        torch.cuda.empty_cache()
    host = host_time()
    pairs = [(32, 4096)] if args.quick else [(L, n) for n in (4096, 14336) for L in (32, 128)]
    mixed = [bench_mixed(L, n, s["copy_gbps"]) for L, n in pairs]
    report = "\n\n".join([
        f"# lorakit ops vs the best public kernels\n\n{setup_line(s)}{' (--quick)' if args.quick else ''}.\n"
        f"Measured copy {s['copy_gbps']:.0f} GB/s (read + write), bf16 matmul 8192^3 {s['matmul_tflops']:.0f} "
        f"TFLOP/s.\n\n{METHOD}",
        "## add_lora, one layer (bf16, h_in 4096, every adapter at rank r)", rows_table(rows),
        "## A whole layer at decode: base GEMM + LoRA (delta after the GEMM, with and without programmatic dependent "
        "launch)\n\n"
        "LoRA's cost = layer - base GEMM alone, same run, same rotation.", layer_table(rows),
        "## Mixed ranks (ranks uniform in 8..128, seeded) vs every rank 128", mixed_table(mixed),
        "## Host time of one eager call (T=1, r 16, h_out 4096: the device idles; min of 5 x 1000 calls)",
        table("| what | host us per call |", ([r["what"], fmt(r["host_us"])] for r in host)),
        "**Summary:** " + summary(rows, mixed)])
    write_report(args.out, "bench_ops", report,
                 {"setup": s, "rows": rows, "mixed_rank": mixed, "host": host, "summary": summary(rows, mixed)})
    plot(rows, args.out / "bench_ops.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
