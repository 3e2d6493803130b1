"""Draw tensor_parallel.png: the engine at tensor_parallel_size 2, what rank 0 sends its worker and where they meet.

    python docs/img/tensor_parallel.py docs/img/tensor_parallel.png     (needs matplotlib: the bench extra)
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from two_processes import arrow, box  # noqa: E402


def main(dst: str) -> None:
    fig, ax = plt.subplots(figsize=(12, 6.2))
    ax.set_xlim(0, 24)
    ax.set_ylim(0.8, 12.4)
    ax.axis("off")

    box(ax, 0.2, 4.4, 9.2, 7.8, "rank 0: the engine (the core process)", [
        "requests, scheduler, prefix cache, adapter pool,",
        "sampling",
        "",
        "its shard of the model (load_sharded):",
        "  q/k/v, gate/up: its output rows",
        "  o, down: its input columns",
        "  embedding, head: its vocabulary rows",
        "its adapter slots: the matching shard of A or B",
        "  (adapters' token rows: whole)",
        "its KV cache: kv_heads / 2 heads a layer",
        "",
        "ModelRunner: pack the step, mirror the call, run it",
    ], "#fde3c8")
    box(ax, 14.6, 4.4, 9.2, 7.8, "rank 1: a worker (spawned by rank 0)", [
        "no requests, no scheduler, no sampling",
        "",
        "its shard of the model, slots and KV cache,",
        "the same layout as rank 0's",
        "",
        "runs each call in order on its own objects:",
        "  slots.put: read the adapter's files again (checked",
        "    against rank 0's sha256), pack its shard",
        "  runner.run_packed: the same metadata, the same graph",
        "  runner.capture_graphs: every graph again (slots grew)",
        "",
        "exits when rank 0's end of the pipe closes",
    ], "#dbe9f6")
    box(ax, 0.2, 1.0, 23.6, 2.0, "in every step, where the ranks meet: torch.distributed (NCCL on GPUs, gloo on the CPU)", [
        "after o and down: all-reduce of T x hidden (the base layer), and of T x R_max float32 (the LoRA shrink's h)"
        " when an adapter is active",
        "after the embedding: all-reduce (and of its LoRA h); after the head: all-gather of the logits; async scheduling: "
        "broadcast of the step in flight's sampled tokens",
    ], "#e2f0d9")

    arrow(ax, (9.4, 10.4), (14.6, 10.4), "slots.put / vacate / reserve\n(the adapter's snapshot, not its weights)",
          (12.0, 11.3))
    arrow(ax, (14.6, 9.0), (9.4, 9.0), "ok (or the traceback)", (12.0, 8.6))
    arrow(ax, (9.4, 7.2), (14.6, 7.2), "rank.start_runner, runner.run_packed\n(packed metadata + bucket), capture_graphs", (12.0, 6.4))
    ax.text(12.0, 5.2, "one pipe per worker; each call\n(target, method, args) pickled once", ha="center", va="center", fontsize=7,
            style="italic")
    arrow(ax, (4.8, 4.4), (4.8, 3.0), "", (0, 0), style="<|-|>")
    arrow(ax, (19.2, 4.4), (19.2, 3.0), "", (0, 0), style="<|-|>")
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1])
