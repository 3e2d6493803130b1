"""Plot bench_engine.json: decode tokens/s per batch size for each configuration, and the byte-floor line.

    python bench/plot_engine.py bench/results/bench_engine_COMMIT.json OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = list(dict.fromkeys(r["what"] for r in rows if r["what"].startswith("lorakit")))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / (len(labels) + 2)
    for i, label in enumerate(labels):
        by_batch = {r["batch"]: r for r in rows if r["what"] == label}
        xs = [b + (i - len(labels) / 2) * width for b in range(len(batches))]
        ax.bar(xs, [by_batch[b]["tok_s"] if b in by_batch else 0 for b in batches], width, label=label)
    base = {r["batch"]: r for r in rows if r["what"] == "lorakit, base"}
    floors = [base[b]["batch"] / (base[b]["floor_ms"] * 1e-3) for b in batches]
    ax.plot(range(len(batches)), floors, "k--", marker="_", markersize=20, label="byte floor (base)")
    for j, r in enumerate(r for r in rows if r["what"].startswith("transformers")):
        ax.bar(len(batches) - 1 + (len(labels) / 2 + j) * width, r["tok_s"], width, color="gray", hatch="//",
               label=r["what"])
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (log)")
    setup = data["setup"]
    ax.set_title(f"lorakit engine, Llama-3-8B shape, {setup['device']}, commit {setup['commit']}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
