"""Draw one decoder layer's kernels from a ``profile_step.py`` JSON: one row per case, LoRA kernels on their own lane
where the delta runs beside the base GEMM.

    python bench/plot_step_timeline.py bench/results/profile_step_overlap_8e0cb6b.json docs/img/layer_timeline.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLORS = {"GEMM": "#4c72b0", "LoRA shrink": "#dd8452", "LoRA expand": "#c44e52", "attention": "#55a868",
          "fused elementwise (Inductor)": "#8172b3", "other": "#937860"}
LORA = ("LoRA shrink", "LoRA expand")


def main(argv: list[str]) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    source, target = Path(argv[0]), Path(argv[1])
    data = json.loads(source.read_text())
    cases = [c for c in data["cases"] if c["layer_kernels"]]
    lanes = []  # (label, kernels)
    for c in cases:
        what = f"{c['adapters']} adapters, delta {c.get('delta', 'after')}"
        if c.get("delta") == "beside":
            lanes.append((f"{what}\nside stream", [k for k in c["layer_kernels"] if k["group"] in LORA]))
            lanes.append((f"{what}\nmain stream", [k for k in c["layer_kernels"] if k["group"] not in LORA]))
        else:
            lanes.append((f"{what}\none stream", c["layer_kernels"]))
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.75 * len(lanes)))
    for row, (_, kernels) in enumerate(reversed(lanes)):
        for k in kernels:
            ax.broken_barh([(k["start_us"], k["dur_us"])], (row - 0.35, 0.7), facecolors=COLORS.get(k["group"], "grey"),
                           edgecolor="white", linewidth=0.5)
        end = max((k["start_us"] + k["dur_us"] for k in kernels), default=0)
        ax.text(end + 2, row, f"{end:.0f} us", va="center", fontsize=8)
    ax.set_yticks(range(len(lanes)), [label for label, _ in reversed(lanes)], fontsize=8)
    ax.set_xlabel("microseconds from the layer's attention kernel")
    s = data["setup"]
    ax.set_title(f"One Llama-3-8B decoder layer at batch {s['batch']}, compiled, CUDA graph "
                 f"({s['device']}, commit {s['commit']})", fontsize=9)
    ax.legend(handles=[Patch(color=v, label=g) for g, v in COLORS.items()], fontsize=7, ncol=3, loc="upper left",
              bbox_to_anchor=(0, -0.25))
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=130)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
