"""Plot ``bench/ttft_paired.py``'s pairs: each hit's TTFT over the sync hit's.

    .venv/bin/python bench/plot_paired.py out/ttft_paired.json out/ttft_paired.png

One row per engine mode, format and hit: a dot per pair for the async hit as
shipped and for the parked one, their medians with the bootstrap 95 %
interval, and the 1.05 line of the target.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ttft_paired import summarise  # noqa: E402

SHOWN = {"auto": ("async as shipped", "tab:blue"), "park": ("parked", "tab:orange")}


def plot(path_json: str, path_png: str) -> None:
    results = json.load(open(path_json, encoding="utf-8"))["results"]
    rows = [(f"{mode} {fmt} {key}", served)
            for mode, formats in results.items() for fmt, data in formats.items()
            for key, served in data.items() if key.startswith("full-") or key == "partial"]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.5))
    for y, (label, served) in enumerate(rows):
        row = summarise(served)
        sync = served["sync"]["ttft_s"]
        for k, (name, (legend, color)) in enumerate(SHOWN.items()):
            at = y + (k - 0.5) * 0.3
            ratios = [x / s for x, s in zip(served[name]["ttft_s"], sync)]
            ax.scatter(ratios, [at] * len(ratios), s=10, color=color, alpha=0.45,
                       label=legend if y == 0 else None)
            low, high = row[name]["ci95"]
            ax.plot([low, high], [at, at], color=color, linewidth=2.5)
            ax.plot([row[name]["ratio"]], [at], marker="|", markersize=14, color="black")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.axvline(1.05, color="red", linewidth=0.8, linestyle="--", label="target 1.05")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("TTFT / its pair's sync hit, same engine (dots: pairs; bar: median, 95 % CI)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Hits on one vLLM CPU engine, load mode per request")
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


if __name__ == "__main__":
    plot(sys.argv[1], sys.argv[2])
