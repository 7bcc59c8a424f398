"""Prometheus collectors of the sidecar: the connectors' counters and the sidecar's own state.

Both build their metric families afresh at every scrape from values that live
elsewhere (the stats regions, the hand-off server) and keep nothing between
scrapes. Every labelled counter has a closed label set, exported in full from
the first scrape (a series born at its first increment is invisible to
`rate()` for that increment). Names follow `docs/metrics.md`: prefix `maru_`, base units, `_total`
on counters; every series carries the `cache`, `namespace` and `pod` labels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from maru_core.stats import (
    BUCKETS,
    COUNTERS,
    HISTOGRAMS,
    LOAD_FAILURE_REASONS,
    STORE_FAILURE_REASONS,
    decode,
)
from maru_core.stats_aggregate import Aggregate
from maru_sidecar.handoff_server import RESULTS as HANDOFF_RESULTS

# counter slot -> (exported name without _total, help)
_COUNTER_HELP = {
    "lookups": ("maru_lookups", "Prefix lookups made by the connector's scheduler."),
    "lookup_hit_tokens": ("maru_lookup_hit_tokens", "Tokens found in the cache by those lookups."),
    "load_bytes": ("maru_load_bytes", "Bytes of KV loaded from the pool into vLLM's KV cache."),
    "recomputed_tokens": ("maru_recomputed_tokens", "Tokens recomputed because their KV failed to load."),
    "store_bytes": ("maru_store_bytes", "Bytes of KV stored from vLLM's KV cache into the pool."),
    "parked_loads": ("maru_parked_loads", "Hits loaded while their request waited parked, not in the step computing it."),
    "early_pinned_loads": ("maru_early_pinned_loads", "Loads that copied under the pins their lookup took (no retrieve of their own)."),
    "head_start_loads": ("maru_head_start_loads", "Loads whose first copies started when their lookup answered, before vLLM allocated blocks."),
}
_HISTOGRAM_HELP = {
    "load_duration_seconds": "Time of one load, from its start to the completion of its last copy.",
    "layer_wait_seconds": "Time the forward pass waited for one layer's KV to land.",
    "store_duration_seconds": "Time of one store, from reserve to commit.",
}
# The exported set must stay in step with the region layout.
if set(_COUNTER_HELP) != set(COUNTERS) or set(_HISTOGRAM_HELP) != set(HISTOGRAMS):
    raise ImportError("maru_sidecar.collector does not describe every counter of maru_core.stats")

LABELS = ("cache", "namespace", "pod")
log = logging.getLogger(__name__)


class ConnectorCollector:
    """Exports the sum of the connectors' stats regions (`maru_lookups_total`, `maru_load_bytes_total`, ...)."""

    def __init__(self, scan: Callable[[], Aggregate], labels: Mapping[str, str]):
        self._scan = scan
        self._label_values = [labels[name] for name in LABELS]
        self._scan_errors = 0

    def collect(self) -> Iterator[Metric]:
        try:
            aggregate = self._scan()
        except Exception:  # the scrape goes on: the sidecar's own metrics still matter
            self._scan_errors += 1
            log.warning("cannot read the stats regions for this scrape", exc_info=True)
            aggregate = None
        errors = CounterMetricFamily(
            "maru_sidecar_stats_scan_errors", "Scrapes whose stats regions could not be read.", labels=LABELS
        )
        errors.add_metric(self._label_values, self._scan_errors)
        yield errors
        if aggregate is not None:
            yield from self._families(aggregate)

    def _families(self, aggregate: Aggregate) -> Iterator[Metric]:
        snapshot = decode(aggregate.values)
        base = self._label_values
        for slot, (name, help_text) in _COUNTER_HELP.items():
            family = CounterMetricFamily(name, help_text, labels=LABELS)
            family.add_metric(base, snapshot["counters"][slot])
            yield family
        yield _failures("maru_load_failures", "Loads that failed (vLLM recomputed), by reason.",
                        base, snapshot["load_failures"], LOAD_FAILURE_REASONS)  # fmt: skip
        yield _failures("maru_store_failures", "Stores skipped or abandoned, by reason.",
                        base, snapshot["store_failures"], STORE_FAILURE_REASONS)  # fmt: skip
        parked = GaugeMetricFamily(
            "maru_parked_requests", "Requests parked in vLLM waiting for their KV to load.", labels=LABELS
        )
        parked.add_metric(base, snapshot["gauges"]["parked_requests"])
        yield parked
        for slot, help_text in _HISTOGRAM_HELP.items():
            yield _histogram(f"maru_{slot}", help_text, base, snapshot["histograms"][slot])
        regions = GaugeMetricFamily(
            "maru_sidecar_stats_regions",
            "Stats region files of running connector processes (live), of another counter layout (foreign), "
            "and files skipped as no usable region (invalid: not a regular file, or a value out of range).",
            labels=(*LABELS, "state"),
        )
        regions.add_metric([*base, "live"], aggregate.live)
        regions.add_metric([*base, "foreign"], aggregate.foreign)
        regions.add_metric([*base, "invalid"], aggregate.invalid)
        yield regions
        unattested = CounterMetricFamily(
            "maru_sidecar_stats_regions_unattested",
            "Stats region files removed uncounted because no scan saw their writer alive "
            "(a process that lived less than a scan interval, or a file put there).",
            labels=LABELS,
        )
        unattested.add_metric(base, aggregate.unattested_removed)
        yield unattested


class SidecarCollector:
    """Exports the sidecar's own state: pool attachment and hand-offs by result."""

    def __init__(
        self,
        pool_attached: Callable[[], bool],
        handoff_results: Callable[[], Mapping[str, int]],
        labels: Mapping[str, str],
    ):
        self._pool_attached, self._handoff_results = pool_attached, handoff_results
        self._label_values = [labels[name] for name in LABELS]

    def collect(self) -> Iterator[Metric]:
        base = self._label_values
        attached = GaugeMetricFamily(
            "maru_sidecar_pool_attached", "1 when the sidecar has the pool open and can hand it out.", labels=LABELS
        )
        attached.add_metric(base, 1 if self._pool_attached() else 0)
        yield attached
        handoffs = CounterMetricFamily(
            "maru_sidecar_handoffs",
            f"Pool hand-offs answered, by result ({', '.join(HANDOFF_RESULTS)}).",
            labels=(*LABELS, "result"),
        )
        results = self._handoff_results()
        for result in HANDOFF_RESULTS:  # every result at zero from the start, so rate() sees the first
            handoffs.add_metric([*base, result], results.get(result, 0))
        yield handoffs


def _failures(name: str, help_text: str, base: list[str], counts: Mapping[str, int], reasons: tuple[str, ...]):
    family = CounterMetricFamily(name, help_text, labels=(*LABELS, "reason"))
    for reason in reasons:
        family.add_metric([*base, reason], counts[reason])
    return family


def _histogram(name: str, help_text: str, base: list[str], hist: Mapping) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text, labels=LABELS)
    cumulative, buckets = 0, []
    for bound, count in zip((*BUCKETS, float("inf")), hist["buckets"]):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    family.add_metric(base, buckets, sum_value=hist["sum"])
    return family
