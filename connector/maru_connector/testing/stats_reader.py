"""Read the connector's own counters from `maru_stats_path`.

The connector appends a JSON line per process whenever its counters change
(`maru_connector.stats`); this sums the latest line of each process. A
missing file means the connector has recorded nothing yet: all zero.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

LOAD_FAILURES_PREFIX = "maru_load_failures_total"
STORE_FAILURES_PREFIX = "maru_store_failures_total"


def read_connector_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Counter name -> value (summed over processes); zeros when nothing was dumped yet."""
    from maru_connector.stats import read_stats

    if not os.path.exists(path):
        return defaultdict(float)
    values: dict[str, Any] = defaultdict(float)
    values.update(read_stats(path))
    return values


def failures(stats: dict[str, Any], prefix: str = LOAD_FAILURES_PREFIX) -> dict[str, float]:
    """`{reason: count}` of the labelled failure counters under `prefix`."""
    found = {}
    for name, value in stats.items():
        if name.startswith(prefix + "{"):
            reason = name[len(prefix) + 1 : -1].split("=", 1)[1].strip('"')
            found[reason] = value
    return found


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """Per-name change between two readings (names missing before count from zero)."""
    return {name: after[name] - before.get(name, 0.0) for name in after if after[name] != before.get(name, 0.0)}
