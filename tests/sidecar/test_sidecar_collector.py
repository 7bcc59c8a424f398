"""maru_sidecar.collector: metric families built from the stats regions at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from maru_core.handoff import ERROR_TYPES
from maru_core.stats import LOAD_FAILURE_REASONS, STORE_FAILURE_REASONS
from maru_sidecar.collector import ConnectorCollector, SidecarCollector
from maru_sidecar.handoff_server import RESULTS as HANDOFF_RESULTS
from maru_core.stats_aggregate import RegionAggregator

LABELS = {"cache": "c1", "namespace": "ns1", "pod": "pod-a"}


def scrape(registry: CollectorRegistry) -> dict[str, dict[tuple, float]]:
    """name -> {sorted label items: value}, from the text exposition."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def single(samples: dict[tuple, float], **extra: str) -> float:
    key = tuple(sorted({**LABELS, **extra}.items()))
    return samples[key]


def test_connector_counters_are_exported_with_names_units_and_labels(tmp_path, stats_writers):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConnectorCollector(RegionAggregator(tmp_path).scan, LABELS))
    before = scrape(registry)
    assert single(before["maru_lookups_total"]) == 0
    assert {dict(k)["reason"] for k in before["maru_load_failures_total"]} == set(LOAD_FAILURE_REASONS)
    assert {dict(k)["reason"] for k in before["maru_store_failures_total"]} == set(STORE_FAILURE_REASONS)

    writer = stats_writers(tmp_path)
    writer.do("lookup 96")
    writer.do("load 2048 0.004")
    writer.do("load 2048 0.02")
    writer.do("load_fail header_mismatch 32")
    writer.do("park 2")
    writer.do("layer_wait 0.0002")
    writer.do("store 4096 0.5")
    writer.do("store_fail commit_error")
    after = scrape(registry)  # fresh values at each scrape, nothing cached
    assert single(after["maru_lookups_total"]) == 1
    assert single(after["maru_lookup_hit_tokens_total"]) == 96
    assert single(after["maru_load_bytes_total"]) == 4096
    assert single(after["maru_recomputed_tokens_total"]) == 32
    assert single(after["maru_store_bytes_total"]) == 4096
    assert single(after["maru_parked_requests"]) == 2
    assert single(after["maru_load_failures_total"], reason="header_mismatch") == 1
    assert single(after["maru_load_failures_total"], reason="miss") == 0
    assert single(after["maru_store_failures_total"], reason="commit_error") == 1
    assert single(after["maru_load_duration_seconds_count"]) == 2
    assert abs(single(after["maru_load_duration_seconds_sum"]) - 0.024) < 1e-9
    assert single(after["maru_load_duration_seconds_bucket"], le="0.005") == 1  # cumulative
    assert single(after["maru_load_duration_seconds_bucket"], le="0.025") == 2
    assert single(after["maru_load_duration_seconds_bucket"], le="+Inf") == 2
    assert single(after["maru_layer_wait_seconds_bucket"], le="0.00025") == 1
    assert single(after["maru_store_duration_seconds_count"]) == 1
    assert single(after["maru_sidecar_stats_regions"], state="live") == 1


def test_sidecar_state_is_exported():
    attached = {"value": False}
    results = {"auth": 2, "wrong_cache": 1}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(lambda: attached["value"], lambda: results, LABELS))
    first = scrape(registry)
    assert single(first["maru_sidecar_pool_attached"]) == 0
    # Every result has its series from the first scrape, so rate() sees the first of each.
    assert {dict(k)["result"] for k in first["maru_sidecar_handoffs_total"]} == set(HANDOFF_RESULTS)
    assert set(HANDOFF_RESULTS) == {"ok", *ERROR_TYPES, "send_failed"}
    assert single(first["maru_sidecar_handoffs_total"], result="ok") == 0
    assert single(first["maru_sidecar_handoffs_total"], result="unavailable") == 0
    assert single(first["maru_sidecar_handoffs_total"], result="auth") == 2
    attached["value"] = True
    results["ok"] = 5
    second = scrape(registry)
    assert single(second["maru_sidecar_pool_attached"]) == 1
    assert single(second["maru_sidecar_handoffs_total"], result="ok") == 5
