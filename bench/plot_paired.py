"""Pool ``bench/ttft_paired.py`` runs, print their table and plot the pairs.

    .venv/bin/python bench/plot_paired.py OUT.png RUN.json [RUN.json ...]

Runs of the same command are pooled row by row (engine mode, format, hit).
The plot has one row per row of the table: a dot per pair for the async hit
as shipped and for the parked one (TTFT over the pair's sync hit), their
median with the bootstrap 95 % interval, and the 1.05 line of the target.
"""

from __future__ import annotations

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ttft_paired import MODES, summarise  # noqa: E402

SHOWN = {"auto": ("async as shipped", "tab:blue"), "park": ("parked", "tab:orange")}


def pooled(paths: list[str]) -> dict[str, dict]:
    """``"engine format hit"`` -> ``{mode: {"ttft_s": [...]}}`` over all runs."""
    rows: dict[str, dict] = {}
    for path in paths:
        results = json.load(open(path, encoding="utf-8"))["results"]
        for engine, formats in results.items():
            for fmt, data in formats.items():
                for key, served in data.items():
                    if not (key.startswith("full-") or key == "partial"):
                        continue
                    row = rows.setdefault(f"{engine} {fmt} {key}", {m: {"ttft_s": []} for m in MODES})
                    for mode in MODES:
                        row[mode]["ttft_s"] += served[mode]["ttft_s"]
    return rows


def table(rows: dict[str, dict]) -> str:
    lines = ["| row | pairs | sync | as shipped | medians' ratio | pairs' ratio (95 % CI), faster "
             "| parked | medians' ratio | pairs' ratio (95 % CI), faster |", "|---|---:|" + "---:|" * 7]
    for label, served in rows.items():
        s = summarise(served)
        sync = statistics.median(served["sync"]["ttft_s"])
        cells = []
        for name in ("auto", "park"):
            r = s[name]
            cells += [f"{s[name + '_ms']:.1f}", f"{statistics.median(served[name]['ttft_s']) / sync:.3f}",
                      f"{r['ratio']:.3f} ({r['ci95'][0]:.3f}–{r['ci95'][1]:.3f}), {r['faster']}"]
        lines.append(f"| {label} | {s['auto']['pairs']} | {s['sync_ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: dict[str, dict], path_png: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    for y, (label, served) in enumerate(rows.items()):
        row = summarise(served)
        sync = served["sync"]["ttft_s"]
        for k, (name, (legend, color)) in enumerate(SHOWN.items()):
            at = y + (k - 0.5) * 0.3
            ratios = [x / s for x, s in zip(served[name]["ttft_s"], sync)]
            ax.scatter(ratios, [at] * len(ratios), s=8, color=color, alpha=0.4,
                       label=legend if y == 0 else None)
            low, high = row[name]["ci95"]
            ax.plot([low, high], [at, at], color=color, linewidth=2.5)
            ax.plot([row[name]["ratio"]], [at], marker="|", markersize=12, color="black")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.axvline(1.05, color="red", linewidth=0.8, linestyle="--", label="target 1.05")
    ax.set_xlim(0.4, 2.0)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel("TTFT / its pair's sync hit, same engine (dots: pairs; bar: median, 95 % CI)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Hits on one vLLM CPU engine, the load mode picked per request")
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


def main(argv: list[str]) -> int:
    rows = pooled(argv[1:])
    print(table(rows))
    plot(rows, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
