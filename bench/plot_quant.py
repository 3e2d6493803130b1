"""Plot bench_quant.json's kernels: the four GEMMs of a Llama-3-8B layer (qkv, o, gate_up, down) summed, each
quantized kernel's speed over bf16 cuBLAS's against the rows of the product, as a decode step's batch grows.

    python bench/plot_quant.py bench/results/bench_quant_kernels_COMMIT_GPU.json OUT.png [TREE]

TREE names the tree measured where the report's commit is not it (the device copy's git HEAD can be stale).
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KERNELS = (("fp8_us", "fp8, lorakit", "tab:blue", 6), ("int4 triton_us", "int4, lorakit (served)", "tab:green", -12),
           ("int4_us", "int4, torch's tinygemm (served before)", "tab:gray", 6))  # (key, label, colour, label offset)
# from 128 rows: the weight widened into a bf16 buffer, then cuBLAS (served where it wins), dashed
WIDENED = (("fp8 widened_us", "fp8 widened + cuBLAS", "tab:blue"), ("int4 widened_us", "int4 widened + cuBLAS",
                                                                     "tab:green"))


def main(src: str, dst: str, tree: str | None = None) -> None:
    data = json.load(open(src))
    rows = sorted({r["m"] for r in data["kernels"]})
    layer = {m: {} for m in rows}  # the four shapes' times summed, per row count and kernel
    for r in data["kernels"]:
        for key in ("bf16_us", *(k for k, *_ in KERNELS), *(k for k, *_ in WIDENED)):
            if key in r:
                layer[r["m"]][key] = layer[r["m"]].get(key, 0.0) + r[key]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.axhline(1.0, color="black", linewidth=0.8, label="bf16 cuBLAS")
    for key, label, color, offset in KERNELS:
        speed = [layer[m]["bf16_us"] / layer[m][key] for m in rows]
        ax.plot(rows, speed, marker="o", color=color, label=label)
        for m, s in zip(rows, speed):
            ax.annotate(f"{s:.2f}x", (m, s), textcoords="offset points", xytext=(0, offset), ha="center", fontsize=7,
                        color=color)
    for key, label, color in WIDENED:
        widened = [m for m in rows if key in layer[m]]
        if widened:
            ax.plot(widened, [layer[m]["bf16_us"] / layer[m][key] for m in widened], linestyle="--", color=color,
                    alpha=0.6, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(m) for m in rows])
    ax.set_xlabel("rows of the product (tokens in the decode step)")
    ax.set_ylabel("speed over bf16 (the four GEMMs of a layer)")
    ax.set_ylim(0, max(2.6, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    setup = data["setup"]
    fig.suptitle(f"Quantized bases, Llama-3-8B layer, {setup['device']}, {setup['date_utc'][:10]}, "
                 f"tree {tree or setup['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:4])
