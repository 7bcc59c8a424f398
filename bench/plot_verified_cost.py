"""What a verified load costs a hit, from paired runs of ``bench/ttft_gpu.py
--paired`` (verified and unverified hits served in turn): per hit and
format, each run's median of the per-round ratios with its quartiles, and
the 2 % target.

    python3 bench/plot_verified_cost.py OUT.png LABEL=RUN/ttft.json [LABEL=RUN/ttft.json ...]

A run's arms (``--arms``) are plotted apart, labelled ``LABEL ARM``. The
table printed is the figures plotted.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TARGET = 1.02


def costs(label: str, path: str) -> list[tuple[str, str, float, float, float]]:
    """(case "format hit", run label, median, first quartile, third quartile) of one run's pairs."""
    rows = []
    with open(path, encoding="utf-8") as f:
        formats = json.load(f)["formats"]
    for fmt in formats:
        for hit, data in fmt["hits"].items():
            for variant, r in data.get("paired", {}).items():
                arm = variant.split("@", 1)[1] if "@" in variant else ""
                rows.append((f"{fmt['format']} {hit}", f"{label} {arm}".strip(), r["median"], r["q1"], r["q3"]))
    return rows


def main() -> None:
    if len(sys.argv) < 3 or any("=" not in a for a in sys.argv[2:]):
        sys.exit(__doc__)
    rows = [row for arg in sys.argv[2:] for row in costs(*arg.split("=", 1))]
    cases = sorted({r[0] for r in rows}, key=lambda c: (c.split()[0], int(c.split()[1].split("+")[0]), c))
    runs = list(dict.fromkeys(r[1] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(cases) * max(1, len(runs) / 2) + 1.5))
    step = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        mine = {r[0]: r for r in rows if r[1] == run}
        ys = [c for c in range(len(cases)) if cases[c] in mine]
        med = [(mine[cases[c]][2] - 1) * 100 for c in ys]
        low = [m - (mine[cases[c]][3] - 1) * 100 for m, c in zip(med, ys)]
        high = [(mine[cases[c]][4] - 1) * 100 - m for m, c in zip(med, ys)]
        ax.errorbar(med, [y - 0.4 + step * (i + 0.5) for y in ys], xerr=[low, high], fmt="o", capsize=2, label=run)
    ax.axvline((TARGET - 1) * 100, color="tab:red", linestyle="--", label="target: +2 %")
    ax.axvline(0, color="grey", linewidth=0.5)
    ax.set_yticks(range(len(cases)), cases)
    ax.invert_yaxis()
    ax.set_xlabel("verified over unverified TTFT, % (median of the per-round ratios; bars: quartiles)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the points, not over them
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=120)
    for case in cases:
        print(case + ": " + ", ".join(f"{r[1]} {r[2] - 1:+.1%}" for r in rows if r[0] == case))


if __name__ == "__main__":
    main()
