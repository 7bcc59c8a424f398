"""maru_core.stats_aggregate: summing regions of writer processes, folding finished ones, staying monotonic."""

from __future__ import annotations

import msgpack

from maru_core.stats import ConnectorStats, decode, region_files
from maru_core.stats_aggregate import RETAINED_NAME, RegionAggregator


def test_sums_live_writers_and_folds_dead_ones_keeping_counters_monotonic(tmp_path, stats_writers):
    a, b = stats_writers(tmp_path), stats_writers(tmp_path)
    a.do("lookup 10")
    a.do("park 4")
    a.do("load 1000 0.01")
    b.do("lookup 5")
    b.do("park 1")
    b.do("load_fail miss 7")
    aggregator = RegionAggregator(tmp_path)
    first = aggregator.scan()
    snap = decode(first.values)
    assert (first.live, first.folded, first.foreign) == (2, 0, 0)
    assert snap["counters"]["lookups"] == 2 and snap["counters"]["lookup_hit_tokens"] == 15
    assert snap["gauges"]["parked_requests"] == 5
    assert snap["histograms"]["load_duration_seconds"]["count"] == 1

    b.kill()
    second = aggregator.scan()
    snap = decode(second.values)
    assert (second.live, second.folded) == (1, 1)
    assert snap["counters"]["lookup_hit_tokens"] == 15  # b's counters are retained
    assert snap["load_failures"]["miss"] == 1
    assert snap["gauges"]["parked_requests"] == 4  # b's gauge is not: a dead process parks nothing
    assert b.path not in region_files(tmp_path)

    # A new sidecar (a restart) reads the retained total from the shared directory.
    again = decode(RegionAggregator(tmp_path).scan().values)
    assert again["counters"]["lookup_hit_tokens"] == 15 and again["load_failures"]["miss"] == 1


def test_a_region_folded_before_a_crash_is_not_counted_twice(tmp_path):
    s = ConnectorStats(tmp_path)
    s.record_lookup(100)
    s.close()
    saved = s.path.read_bytes()
    assert decode(RegionAggregator(tmp_path).scan().values)["counters"]["lookup_hit_tokens"] == 100
    assert not s.path.exists()
    # A crash between writing the retained total and removing the file leaves the file behind.
    s.path.write_bytes(saved)
    again = RegionAggregator(tmp_path).scan()
    assert decode(again.values)["counters"]["lookup_hit_tokens"] == 100
    assert not s.path.exists()
    record = msgpack.unpackb((tmp_path / RETAINED_NAME).read_bytes(), raw=False)
    assert record["folded"] == [s.path.name]


def test_foreign_regions_are_counted_and_skipped(tmp_path):
    s = ConnectorStats(tmp_path)
    s.record_lookup(3)
    data = bytearray(s.path.read_bytes())
    data[16] ^= 0xFF
    foreign = tmp_path / "maru-stats.99.deadbeef.region"
    foreign.write_bytes(bytes(data))
    aggregate = RegionAggregator(tmp_path).scan()
    assert (aggregate.live, aggregate.foreign) == (1, 1)
    assert decode(aggregate.values)["counters"]["lookup_hit_tokens"] == 3
    assert foreign.exists()  # never removed: it may belong to a newer sidecar
    s.close()


def test_unreadable_retained_total_restarts_from_zero(tmp_path):
    (tmp_path / RETAINED_NAME).write_bytes(b"\xc1garbage")
    s = ConnectorStats(tmp_path)
    s.record_lookup(2)
    assert decode(RegionAggregator(tmp_path).scan().values)["counters"]["lookup_hit_tokens"] == 2
    s.close()


def _injected_region(directory, lookups: int):
    """A region file with no writer, as any process with the shared directory could drop in."""
    s = ConnectorStats(directory)
    s.record_lookup(lookups)
    s.close()
    return s.path


def test_an_attested_scan_never_folds_a_region_it_never_saw_alive(tmp_path):
    injected = _injected_region(tmp_path, 9 * 10**15)
    aggregator = RegionAggregator(tmp_path, attested=True)
    aggregate = aggregator.scan()
    assert decode(aggregate.values)["counters"]["lookup_hit_tokens"] == 0
    assert (aggregate.folded, aggregate.unattested_removed) == (0, 1)
    assert not injected.exists()
    # nothing of it was retained for a later scan, by this sidecar or a restarted one
    assert decode(RegionAggregator(tmp_path, attested=True).scan().values)["counters"]["lookup_hit_tokens"] == 0


def test_an_attested_scan_folds_what_it_saw_alive_also_after_a_sidecar_restart(tmp_path, stats_writers):
    a, b = stats_writers(tmp_path), stats_writers(tmp_path)
    a.do("lookup 10")
    b.do("lookup 5")
    assert decode(RegionAggregator(tmp_path, attested=True).scan().values)["counters"]["lookup_hit_tokens"] == 15
    a.kill()  # ends while no sidecar runs
    restarted = RegionAggregator(tmp_path, attested=True)
    aggregate = restarted.scan()
    assert (aggregate.live, aggregate.folded, aggregate.unattested_removed) == (1, 1, 0)
    assert decode(aggregate.values)["counters"]["lookup_hit_tokens"] == 15
    b.kill()
    assert decode(restarted.scan().values)["counters"]["lookup_hit_tokens"] == 15
    record = msgpack.unpackb((tmp_path / RETAINED_NAME).read_bytes(), raw=False)
    assert record["seen"] == []  # folded names leave the list of names seen live

