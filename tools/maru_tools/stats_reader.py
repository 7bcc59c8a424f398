"""Read the connector's counters from a stats directory, under their exported names.

Every connector process writes its counters into a region file of the stats
directory (`maru_core.stats`): the sidecar's directory, or `maru_stats_dir`
in direct attach. This sums them exactly as the sidecar does
(`maru_core.stats_aggregate.RegionAggregator`, finished processes folded
into a retained total) and names them as `/metrics` does:
`maru_lookup_hit_tokens_total`, `maru_parked_requests`,
`maru_load_failures_total{reason="miss"}`, `maru_layer_wait_seconds_count`
and `_sum`. A directory where nothing was recorded yet reads as all zero.
"""

from __future__ import annotations

import os
from pathlib import Path

from maru_core.stats import decode
from maru_core.stats_aggregate import RegionAggregator

LOAD_FAILURES_PREFIX = "maru_load_failures_total"
STORE_FAILURES_PREFIX = "maru_store_failures_total"


def read_connector_stats(stats_dir: str | os.PathLike[str]) -> dict[str, float]:
    """Exported metric name -> value, summed over the processes that wrote into `stats_dir`."""
    snapshot = decode(RegionAggregator(Path(stats_dir)).scan().values)
    values: dict[str, float] = {}
    for name, value in snapshot["counters"].items():
        values[f"maru_{name}_total"] = value
    for name, value in snapshot["gauges"].items():
        values[f"maru_{name}"] = value
    for reason, value in snapshot["load_failures"].items():
        values[f'{LOAD_FAILURES_PREFIX}{{reason="{reason}"}}'] = value
    for reason, value in snapshot["store_failures"].items():
        values[f'{STORE_FAILURES_PREFIX}{{reason="{reason}"}}'] = value
    for name, hist in snapshot["histograms"].items():
        values[f"maru_{name}_count"] = hist["count"]
        values[f"maru_{name}_sum"] = hist["sum"]
    return values


def failures(stats: dict[str, float], prefix: str = LOAD_FAILURES_PREFIX) -> dict[str, float]:
    """`{reason: count}` of the labelled failure counters under `prefix`."""
    found = {}
    for name, value in stats.items():
        if name.startswith(prefix + "{"):
            reason = name[len(prefix) + 1 : -1].split("=", 1)[1].strip('"')
            found[reason] = value
    return found


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Per-name change between two readings (names missing before count from zero)."""
    return {name: after[name] - before.get(name, 0.0) for name in after if after[name] != before.get(name, 0.0)}
