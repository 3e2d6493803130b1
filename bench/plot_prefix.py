"""Plot bench_prefix.json: TTFT p50 and p99 and prompt tokens computed, the prefix cache off vs on, per workload.

    python bench/plot_prefix.py bench/results/bench_prefix_COMMIT.json OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    rows = data["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    pick = {(r["workload"], r["prefix_cache"]): r for r in rows}
    fig, (ttft, computed) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = range(len(workloads))
    for k, (cache, color) in enumerate((("off", "tab:gray"), ("on", "tab:blue"))):
        at = [x + (k - 0.5) * 0.38 for x in xs]
        p50 = [pick[w, cache]["ttft_p50_ms"] for w in workloads]
        p99 = [pick[w, cache]["ttft_p99_ms"] for w in workloads]
        ttft.bar(at, p50, 0.38, color=color, label=f"cache {cache}: p50")
        ttft.scatter(at, p99, color="black", marker="_", s=200, label="p99" if k else None, zorder=3)
        computed.bar(at, [pick[w, cache]["computed_prompt_tokens"] for w in workloads], 0.38, color=color,
                     label=f"cache {cache}")
    for w, x in zip(workloads, xs):
        on = pick[w, "on"]
        ttft.annotate(f"{on['ttft_p50_off_over_on']:.1f}x", (x + 0.19, on["ttft_p50_ms"]), ha="center",
                      va="bottom", fontsize=8)
        computed.annotate(f"{on['computed_off_over_on']:.1f}x", (x + 0.19, on["computed_prompt_tokens"]),
                          ha="center", va="bottom", fontsize=8)
    labels = [w.replace(", ", ",\n", 1) for w in workloads]
    for ax, title in ((ttft, "time to first token (ms, log)"), (computed, "prompt tokens computed (log)")):
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    setup = data["setup"]
    fig.suptitle(f"Prefix caching, Llama-3-8B shape, {setup['device']}, commit {setup['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
