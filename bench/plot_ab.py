"""Plot an H200 A/B of the GPU harness (``bench/h200_ab.sh``): each full
hit's best TTFT over its PCIe floor, per variant and round, against the
1.15 × target (partial hits have a target of their own, against compute).

    python3 bench/plot_ab.py OUT_DIR PNG

``OUT_DIR`` holds the ``ttft_<variant>_r<round>.txt`` reports the script
wrote; their per-format tables are read back.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TARGET = 1.15
REPORT = re.compile(r"ttft_(?P<variant>\w+?)_r(?P<round>\d+)\.txt$")


def best_over_floor(path: str) -> dict[tuple[str, str], float]:
    """``{(format, hit tokens): best / floor}`` of the full hits in one report's tables."""
    found, fmt, column = {}, None, None
    for line in open(path):
        if line.startswith("### "):
            fmt = line[4:].strip()
        elif line.startswith("| hit |"):
            column = [c.strip() for c in line.strip().strip("|").split("|")].index("best / floor")
        elif fmt and column is not None and re.match(r"\| \d+ \|", line):  # a full hit
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            found[(fmt, cells[0])] = float(cells[column])
    return found


def main(out_dir: str, png: str) -> None:
    runs: dict[str, dict[tuple[str, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(glob.glob(os.path.join(out_dir, "ttft_*_r*.txt"))):
        m = REPORT.search(path)
        if m:
            for case, ratio in best_over_floor(path).items():
                runs[m["variant"]][case].append(ratio)
    if not runs:
        raise SystemExit(f"no ttft_<variant>_r<round>.txt reports in {out_dir}")
    cases = sorted({c for v in runs.values() for c in v}, key=lambda c: (c[0], int(c[1])))
    fig, ax = plt.subplots(figsize=(1.1 * len(cases) + 2, 4))
    width = 0.8 / len(runs)
    for i, (variant, by_case) in enumerate(sorted(runs.items())):
        for x, case in enumerate(cases):
            ys = by_case.get(case, [])
            ax.scatter([x + (i - (len(runs) - 1) / 2) * width] * len(ys), ys, s=18,
                       color=f"C{i}", label=variant if x == 0 else None)
    ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1, label=f"target {TARGET} ×")
    ax.set_xticks(range(len(cases)), [f"{f}\n{h}" for f, h in cases], fontsize=8)
    ax.set_ylabel("best TTFT / PCIe floor")
    ax.set_title("H200 harness: full hits against their floor, each round a point")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
