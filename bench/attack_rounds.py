"""Several runs of `bench/attacks_16core.sh` (rounds) read as one verdict.

One run's heartbeat p99 over the baseline measured just before it is a
single pair of 4-second windows; on a host whose own noise moves a baseline's
p99 by 3x between runs (bench/RESULTS.md), that ratio says more about the
host than about the attack. As with the GPU's paired runs, the verdict is
the median of the per-round ratios, with each round's ratio shown::

    python bench/attack_rounds.py ROUND1/attacks.json ROUND2/attacks.json ...
"""

from __future__ import annotations

import json
import statistics
import sys

TARGET = 2.0  # honest heartbeat p99 <= 2 x its own baseline


def p99_over_own_baseline(results: dict[str, dict]) -> dict[str, float]:
    """Each attack's heartbeat p99 over its own baseline's (``alone#NAME``, ``--alternate``);
    an attack without both figures (no baseline, or it failed) is left out."""
    out = {}
    for run, figures in results.items():
        base = results.get(f"alone#{run}", {}).get("heartbeat_p99_ms")
        if not run.startswith("alone") and base and figures.get("heartbeat_p99_ms"):
            out[run] = figures["heartbeat_p99_ms"] / base
    return out


def ratios(path: str) -> dict[str, float]:
    """``p99_over_own_baseline`` of one run's JSON (``--out``)."""
    return p99_over_own_baseline(json.load(open(path))["results"])


def verdict(paths: list[str]) -> str:
    rounds = [ratios(path) for path in paths]
    attacks = list(dict.fromkeys(name for r in rounds for name in r))
    lines = [f"{'attack':32} {'median':>6}  per round (p99 / own baseline p99), target <= {TARGET:g}"]
    within = 0
    for name in attacks:
        seen = [r[name] for r in rounds if name in r]
        median = statistics.median(seen)
        within += median <= TARGET
        lines.append(f"{name:32} {median:>6.2f}  " + " ".join(f"{x:.2f}" for x in seen))
    lines.append(f"{within} of {len(attacks)} attacks within {TARGET:g}x at the median of {len(paths)} rounds")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(verdict(sys.argv[1:]))
