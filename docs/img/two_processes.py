"""Draw two_processes.png: what runs in lorakit serve's server process and in its engine core process.

    python docs/img/two_processes.py docs/img/two_processes.png     (needs matplotlib: the bench extra)
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402


def box(ax, x, y, w, h, title, lines, color, title_size=10):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15", fc=color, ec="black",
                                lw=1.0))
    ax.text(x + w / 2, y + h - 0.25, title, ha="center", va="top", fontsize=title_size, weight="bold")
    ax.text(x + 0.2, y + h - 0.75, "\n".join(lines), ha="left", va="top", fontsize=8, linespacing=1.5)


def arrow(ax, start, end, text, text_at, style="-|>", ls="-"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=14, lw=1.2, ls=ls, color="black"))
    ax.text(*text_at, text, ha="center", va="center", fontsize=8)


def main(dst: str) -> None:
    fig, ax = plt.subplots(figsize=(12, 5.6))
    ax.set_xlim(0, 24)
    ax.set_ylim(0.4, 10.8)
    ax.axis("off")

    box(ax, 0.2, 5.6, 2.6, 2.6, "clients", ["OpenAI SDK,", "curl, ...", "", "HTTP, SSE"], "#eeeeee")
    box(ax, 3.6, 3.4, 7.6, 7.0, "server process", [
        "asyncio event loop (uvicorn, FastAPI):",
        "  routes, validation, API key, errors, /metrics",
        "  ServerState: model -> Adapter (once) -> CoreClient",
        "",
        "worker threads:",
        "  tokenizing, chat templates,",
        "  adapter tokenizers",
        "",
        "each Step, in one pass on the event loop:",
        "  OutputProcessor: token ids -> text, stop",
        "  strings (then Abort to the core), into each",
        "  request's RequestStream (one wake-up)",
        "CoreClient: the core's facts for lookups",
        "  (adapter versions, vocabulary, context)",
    ], "#dbe9f6")
    box(ax, 16.0, 3.4, 7.8, 7.0, "engine core process", [
        "EngineLoop (the one loop, as on a thread):",
        "  messages -> commands, step, one Step out",
        "Engine: finish by token (eos, stop ids, max),",
        "  scheduler, adapter pool,",
        "  model runner (CUDA graphs), sampling",
        "",
        "worker thread: reads and checks",
        "  adapter files while the loop steps;",
        "  installed between steps",
        "",
        "lifeline: exits when the server is gone;",
        "  a thread beats every 0.5 s"
    ], "#fde3c8")
    box(ax, 16.0, 0.6, 7.8, 2.0, "GPU", ["model weights, adapter slots, KV cache,", "CUDA graphs"], "#e2f0d9")

    arrow(ax, (2.8, 6.9), (3.6, 6.9), "", (0, 0), style="<|-|>")
    arrow(ax, (11.2, 8.6), (16.0, 8.6), "Add (ids, params, AdapterRef), Abort, Call\n(socket to-core, PUSH -> PULL)", (13.6, 9.3))
    arrow(ax, (16.0, 6.6), (11.2, 6.6), "Step: one per engine step,\nevery request's RequestOutput (ids)\n"
          "(also Reply, Ready / Failed)\n(socket from-core, PUSH -> PULL)", (13.6, 5.5))
    arrow(ax, (19.9, 3.4), (19.9, 2.6), "", (0, 0), style="<|-|>")
    ax.text(13.6, 7.6, "ZeroMQ, ipc:// in a private temp folder\n(mode 0700); msgpack (msgspec), typed",
            ha="center", va="center", fontsize=7, style="italic")
    arrow(ax, (16.0, 4.0), (11.2, 4.0), "", (0, 0), ls="--")
    ax.text(13.6, 3.7, "process sentinel: a core that exits\n-> 503 to every waiting request,\nserver exits with status 1",
            ha="center", va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1])
