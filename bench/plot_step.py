"""Plot bench_step.json: one engine step's wall time split into GPU time and the host time the GPU does not hide.

One panel per model shape; per batch and mode, two bars (a decode step, a mixed step), each stacked: the device
time of the step's forward (CUDA events) below, wall - GPU above (host work not hidden behind the device, and the
sampling kernels, which the events leave out). The number on a bar is its wall time in ms.

    python bench/plot_step.py bench/results/bench_step_COMMIT.json OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHAPES = {"smollm2": "SmolLM2-135M shape", "llama8b": "Llama-3-8B shape"}
COLORS = {"decode": "tab:blue", "mixed": "tab:orange"}


def draw(ax, rows: list[dict], shape: str) -> None:
    """One shape's bars: groups of (batch, mode), a decode and a mixed bar in each."""
    groups = [r for r in rows if r["shape"] == shape]
    width = 0.38
    for g, r in enumerate(groups):
        for k, kind in enumerate(("decode", "mixed")):
            x = g + (k - 0.5) * width
            wall, gpu = r[f"{kind}_wall_ms"], r[f"{kind}_gpu_ms"]
            ax.bar(x, gpu, width, color=COLORS[kind], edgecolor="black", linewidth=0.5)
            ax.bar(x, wall - gpu, width, bottom=gpu, color=COLORS[kind], alpha=0.35, hatch="//",
                   edgecolor="black", linewidth=0.5)
            ax.text(x, wall, f"{wall:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), [f"B={r['batch']}\n{r['mode'].replace('mixed ', 'mixed: ')}" for r in groups],
                  fontsize=7)
    ax.set_title(SHAPES.get(shape, shape), fontsize=9)
    ax.set_ylabel("ms per step")
    ax.margins(y=0.12)


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    rows, setup = data["rows"], data["setup"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        draw(ax, rows, shape)
    legend = [plt.Rectangle((0, 0), 1, 1, color=COLORS["decode"], ec="black", lw=0.5),
              plt.Rectangle((0, 0), 1, 1, color=COLORS["mixed"], ec="black", lw=0.5),
              plt.Rectangle((0, 0), 1, 1, fc="white", ec="black", lw=0.5, hatch="//")]
    fig.legend(legend, ["decode step (B decodes): GPU ms", f"mixed step (B decodes + a {setup['prompt_tokens']}-token "
                        "prompt): GPU ms", "hatched: wall - GPU (host not hidden, sampling)"],
               loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(f"One engine step, wall vs GPU: {setup['gpu']}, commit {setup['commit']} "
                 f"(bench_step; decode steps replay graphs in every mode)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
