"""Plot `bench/index_attacks.py --alternate --out FILE.json`: per attack, the normal client's
heartbeat p99 against the baseline run just before it, and the index's resident memory over time.

    python bench/plot_index_attacks.py FILE.json OUT.png
"""

from __future__ import annotations

import json
import sys


def main(source: str, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = json.load(open(source))
    results = figures["results"]
    attacks = [name for name in results if not name.startswith("alone")]
    ratios = []
    for name in attacks:
        base, attacked = results.get(f"alone#{name}", results.get("alone")), results[name]
        ok = base and "error" not in attacked and base.get("heartbeat_p99_ms") and attacked.get("heartbeat_p99_ms")
        ratios.append(attacked["heartbeat_p99_ms"] / base["heartbeat_p99_ms"] if ok else float("nan"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.32 * len(attacks) + 1.8))
    left.barh(range(len(attacks)), ratios, color=["#c44e52" if r > 2 else "#4c72b0" for r in ratios])
    left.axvline(2, color="grey", linestyle="--", linewidth=1, label="target: 2 × baseline")
    left.set_yticks(range(len(attacks)), attacks, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("normal client's heartbeat p99 / baseline p99 (run just before)")
    left.legend(fontsize=8)
    for name in attacks:
        samples = results[name].get("index_rss_mb_over_time") or []
        if samples:
            right.plot([0.25 * (i + 1) for i in range(len(samples))], [s - samples[0] for s in samples],
                       label=name, linewidth=1)  # fmt: skip
    right.axhline(100, color="grey", linestyle="--", linewidth=1)
    right.set_xlabel("seconds since the attack started")
    right.set_ylabel("index RSS growth, MB")
    right.legend(fontsize=6, ncol=2)
    skipped = figures.get("skipped") or []
    fig.suptitle(f"{figures.get('cpus')} CPUs, pinned {figures.get('pinned_cores')}, attacker from "
                 f"{figures.get('attacker_address')}"
                 + (" (token holders from 127.0.0.1, each client its own pod)" if figures.get("pods") else "")
                 + f", {figures.get('seconds')} s each"
                 + (f"; not run (time budget): {', '.join(skipped)}" if skipped else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
