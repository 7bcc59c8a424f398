"""maru_core.stats: the connector's counters, in memory and in a shared region read by another process."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading

import pytest

from maru_core import stats
from maru_core.stats import ConnectorStats, StatsRegionError, decode, read_region, region_files


def test_in_memory_counters_and_histograms():
    s = ConnectorStats()
    s.record_lookup(256)
    s.record_lookup(0)
    s.record_load(4096, 0.003)
    s.record_load_failure("short_reply", recomputed_tokens=128)
    s.record_recomputed_tokens(32)
    s.set_parked_requests(3)
    s.record_parked_load()
    s.record_early_pinned_load()
    s.record_head_start_load()
    s.record_layer_wait(0.00001)  # exactly on a bucket bound: counted in that bucket (le)
    s.record_store(8192, 20.0)  # above the last bound: +Inf
    s.record_store_failure("no_space")
    snap = s.snapshot()
    assert snap["counters"] == {
        "lookups": 2, "lookup_hit_tokens": 256, "load_bytes": 4096,
        "recomputed_tokens": 160, "store_bytes": 8192, "parked_loads": 1,
        "early_pinned_loads": 1, "head_start_loads": 1,
    }  # fmt: skip
    assert snap["gauges"]["parked_requests"] == 3
    assert snap["load_failures"]["short_reply"] == 1 and sum(snap["load_failures"].values()) == 1
    assert snap["store_failures"]["no_space"] == 1
    load = snap["histograms"]["load_duration_seconds"]
    assert load["count"] == 1 and load["sum"] == pytest.approx(0.003)
    assert load["buckets"][stats.BUCKETS.index(5e-3)] == 1
    assert snap["histograms"]["layer_wait_seconds"]["buckets"][0] == 1
    assert snap["histograms"]["store_duration_seconds"]["buckets"][-1] == 1
    assert s.path is None


def test_unknown_reason_and_negative_amounts_are_refused():
    s = ConnectorStats()
    with pytest.raises(ValueError, match="unknown load_failures reason 'gone'.*miss"):
        s.record_load_failure("gone")
    with pytest.raises(ValueError, match="unknown store_failures reason"):
        s.record_store_failure("miss")
    with pytest.raises(ValueError, match="cannot decrease"):
        s.record_load(-1, 0.1)
    assert sum(s.snapshot()["load_failures"].values()) == 0


def test_concurrent_threads_lose_no_increment():
    s = ConnectorStats()

    def hammer():
        for _ in range(5000):
            s.record_lookup(2)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.snapshot()["counters"]["lookups"] == 20000
    assert s.snapshot()["counters"]["lookup_hit_tokens"] == 40000


def test_region_is_read_by_another_process_and_liveness_follows_the_writer(tmp_path, stats_writers):
    writer = stats_writers(tmp_path, role="scheduler")
    writer.do("lookup 64")
    writer.do("park 2")
    writer.do("load_fail timeout 64")
    reading = read_region(writer.path)
    assert reading.alive and reading.pid == writer.proc.pid and reading.role == "scheduler"
    values = decode(reading.values)
    assert values["counters"]["lookups"] == 1 and values["counters"]["recomputed_tokens"] == 64
    assert values["gauges"]["parked_requests"] == 2
    assert values["load_failures"]["timeout"] == 1
    writer.kill()  # SIGKILL: the kernel drops the writer's lock, the counters stay
    reading = read_region(writer.path)
    assert not reading.alive
    assert decode(reading.values)["counters"]["lookup_hit_tokens"] == 64


def test_close_keeps_counters_readable_and_marks_the_region_finished(tmp_path):
    s = ConnectorStats(tmp_path)
    s.record_store(100, 0.5)
    assert read_region(s.path).alive
    s.close()
    s.close()  # twice is harmless
    assert not read_region(s.path).alive
    assert decode(read_region(s.path).values)["counters"]["store_bytes"] == 100
    s.record_store(1, 0.1)  # after close: in memory only
    assert s.snapshot()["counters"]["store_bytes"] == 101
    assert decode(read_region(s.path).values)["counters"]["store_bytes"] == 100


def test_only_published_regions_are_listed(tmp_path):
    (tmp_path / f".{stats.REGION_PREFIX}1.x{stats.REGION_SUFFIX}.tmp").write_bytes(b"half-made")
    (tmp_path / "unrelated.txt").write_text("x")
    with ConnectorStats(tmp_path) as s:
        assert region_files(tmp_path) == [s.path]
        assert s.path.name.startswith(f"{stats.REGION_PREFIX}{os.getpid()}.")


def test_foreign_regions_are_refused(tmp_path):
    s = ConnectorStats(tmp_path)
    s.close()
    data = bytearray(s.path.read_bytes())
    data[16] ^= 0xFF  # the layout digest: a connector of another version
    s.path.write_bytes(bytes(data))
    with pytest.raises(StatsRegionError, match="another counter layout"):
        read_region(s.path)
    s.path.write_bytes(b"MARUSTAT" + bytes(stats.REGION_BYTES - 8))
    with pytest.raises(StatsRegionError, match="not a stats region"):
        read_region(s.path)
    s.path.write_bytes(b"short")
    with pytest.raises(StatsRegionError, match="size 5"):
        read_region(s.path)


def test_missing_directory_says_what_to_share():
    with pytest.raises(FileNotFoundError, match="shared with the sidecar"):
        ConnectorStats("/nonexistent/maru-socket-dir")


def test_handoff_and_stats_import_without_prometheus_or_vllm():
    code = (
        "import sys\n"
        "for name in ('prometheus_client', 'vllm', 'torch'):\n"
        "    sys.modules[name] = None  # any import of them fails\n"
        "import maru_core.handoff, maru_core.stats\n"
        "maru_core.stats.ConnectorStats().record_lookup(1)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("layout", stats.PREVIOUS_LAYOUTS,
                         ids=["before_early_pins", "before_quarantined", "before_head_starts"])
def test_a_region_of_an_older_connector_is_read_by_name(tmp_path, layout):
    """A sidecar newer than the connector in its pod: the older layout's slots
    are read by name, and a counter or reason that layout lacks reads 0."""
    counters, _ = layout
    names = stats._slot_names(*layout)
    assert names != stats.SLOT_NAMES
    values = [0.0 if n.endswith(":sum") else 0 for n in names]
    values[names.index("counter:load_bytes")] = 4096
    values[names.index("counter:parked_loads")] = 3
    values[names.index("store_failures:load_failed")] = 5  # the reason before the one it lacks
    if "early_pinned_loads" in counters:
        values[names.index("counter:early_pinned_loads")] = 7
    values[names.index("hist:load_duration_seconds:count")] = 2
    values[names.index("hist:load_duration_seconds:sum")] = 0.5
    header = stats._HEADER.pack(stats.MAGIC, stats.FORMAT_VERSION, len(names), stats._layout_digest(names),
                                4242, 0, 0, b"worker")
    body = b"".join(struct.pack("<d" if n.endswith(":sum") else "<q", v) for n, v in zip(names, values))
    path = tmp_path / f"{stats.REGION_PREFIX}4242.old{stats.REGION_SUFFIX}"
    path.write_bytes(header.ljust(stats.HEADER_BYTES, b"\0") + body)
    snap = decode(read_region(path).values)
    assert snap["counters"]["load_bytes"] == 4096 and snap["counters"]["parked_loads"] == 3
    assert snap["counters"]["early_pinned_loads"] == (7 if "early_pinned_loads" in counters else 0)
    assert snap["store_failures"]["load_failed"] == 5
    assert snap["store_failures"]["quarantined"] == 0  # absent, or never counted
    assert snap["counters"]["head_start_loads"] == 0  # in none of them
    assert snap["histograms"]["load_duration_seconds"]["count"] == 2
    assert snap["histograms"]["load_duration_seconds"]["sum"] == pytest.approx(0.5)
    path.write_bytes(path.read_bytes()[:-8])  # its size no longer matches its layout
    with pytest.raises(StatsRegionError):
        read_region(path)
