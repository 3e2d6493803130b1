"""Draw scale_out.png: lorakit serve-ray, a router in front of engine replicas, each request sent by its adapter.

    python docs/img/draw_scale_out.py docs/img/scale_out.png     (needs matplotlib: the bench extra)
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

FONT = 9  # every label at least this size


def box(ax, x, y, w, h, title, lines, color, title_size=10, lw=1.0):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15", fc=color, ec="black",
                                lw=lw))
    ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=title_size, weight="bold")
    if lines:
        ax.text(x + w / 2, y + h - 0.8, "\n".join(lines), ha="center", va="top", fontsize=FONT, linespacing=1.4)


def arrow(ax, start, end, text="", text_at=None, style="-|>", ls="-", rad=0.0, **text_kw):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=14, lw=1.2, ls=ls, color="black",
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))
    if text:
        ax.text(*text_at, text, ha="center", va="center", fontsize=FONT,
                bbox=dict(fc="white", ec="none", pad=1.0), **text_kw)


def replica(ax, x, y, title, adapters):
    w, h = 8.6, 3.6
    box(ax, x, y, w, h, title, [f"holds: {adapters}", "(at most --adapters-per-replica, least recently used out)"],
        "#fde3c8")
    box(ax, x + 0.5, y + 0.3, w - 1.0, 1.45, "Engine + lorakit FastAPI app (ASGI, in-process)",
        ["same routes, checks and errors as lorakit serve"], "#fff6ec", title_size=FONT)


def main(dst: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 5.5))
    ax.set_xlim(0, 20)
    ax.set_ylim(0, 12)
    ax.axis("off")

    # Top row: the request's way in.
    box(ax, 0.2, 9.6, 3.0, 2.2, "clients", ["OpenAI SDK, curl", "HTTP, SSE"], "#eeeeee")
    box(ax, 4.2, 9.6, 3.4, 2.2, "Ray Serve", ["HTTP proxy"], "#e8e8f8")
    box(ax, 8.6, 9.2, 5.6, 2.6, "LorakitRouter (reads model)", [
        "the JSON body's model",
        "(/generate: its lora_path)",
        "multiplexed_model_id=adapter",
    ], "#dbe9f6")
    box(ax, 15.2, 9.6, 4.6, 2.2, "answered by the router", [
        "POST /v1/load_lora_adapter: 403",
        "(fleets load by name)",
    ], "#f4f4f4", title_size=FONT)
    arrow(ax, (3.2, 10.7), (4.2, 10.7), style="<|-|>")
    arrow(ax, (7.6, 10.7), (8.6, 10.7), style="<|-|>")

    # Middle row: two replicas, each adapter on the replica that holds it.
    replica(ax, 0.6, 3.3, "LorakitReplica 1", "sql, chat, v2")
    replica(ax, 10.8, 3.3, "LorakitReplica 2", "a3, a4, a5")
    arrow(ax, (9.6, 9.2), (5.4, 6.9), "model: sql -> replica 1", (6.4, 8.35))
    arrow(ax, (13.2, 9.2), (15.0, 6.9), "model: a4 -> replica 2", (15.9, 8.35))
    arrow(ax, (11.0, 9.2), (8.4, 6.9), ls="--")
    arrow(ax, (11.8, 9.2), (12.4, 6.9), ls="--")
    ax.text(11.1, 7.85, "base -> any", ha="center", va="center", fontsize=FONT, style="italic",
            bbox=dict(fc="white", ec="none", pad=1.0))

    # Bottom row: where a replica finds an adapter it does not hold.
    box(ax, 0.6, 0.3, 18.8, 1.9, "adapter roots / shared cache", [
        "LocalRoots: <root>/<name>/ (adapter_config.json + adapter_model.safetensors);"
        "  SharedCache: copied once, under a file lock",
    ], "#e2f0d9")
    arrow(ax, (4.9, 2.2), (4.9, 3.3), "load by name", (4.9, 2.75))
    arrow(ax, (15.1, 2.2), (15.1, 3.3), "load by name", (15.1, 2.75))

    fig.tight_layout()
    fig.savefig(dst, dpi=130)


if __name__ == "__main__":
    main(sys.argv[1])
