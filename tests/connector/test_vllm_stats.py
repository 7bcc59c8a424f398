"""The connector's figures in vLLM's own connector stats (``vllm:maru_*``).

Real worker halves on a real pool (the fake index of ``worker_env``) record
their events; :class:`StepStatsReader` turns them into the per-step payloads
vLLM collects from each worker, which it then sums, ships as a dict, rebuilds
with ``build_kv_connector_stats`` and feeds to the Prometheus metrics that
``build_prom_metrics`` registered. The end-to-end path through a real vLLM
engine is ``tests/e2e/test_vllm_metrics.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from maru_core.stats import LOAD_FAILURE_REASONS, ConnectorStats
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from maru_connector.connector import MaruKVConnector
from maru_connector.vllm_stats import MaruKVConnectorStats, StepStatsReader

from worker_env import LAYERS, WorkerEnv, load_meta, step, store_meta, tokens


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def _counters(half) -> dict:
    return half.stats.snapshot()


def test_two_workers_aggregate_to_the_sum_of_their_counters(env):
    """A writer's stores and a reader's loads (one hit, one miss) sum as vLLM sums two workers."""
    writer, _ = env.worker(seed=1, maru_async_store=False)
    reader, _ = env.worker(seed=2, maru_overlap_load_with_compute=True)
    writer_reader, reader_reader = StepStatsReader(), StepStatsReader()
    keys = env.keys(tokens(96))
    step(writer, store_meta("w", keys, first_block=0))
    errors, _ = step(reader, load_meta("hit", keys, first_block=10))
    assert not errors
    errors, _ = step(reader, load_meta("gone", env.keys(tokens(64, start=500)), first_block=20))
    assert errors, "keys never stored: the load fails"

    from_writer = writer_reader.take(writer.stats)
    from_reader = reader_reader.take(reader.stats)
    assert from_writer is not None and from_reader is not None
    total = from_writer.aggregate(from_reader)

    written, read = _counters(writer), _counters(reader)
    assert total.data["stored_bytes"] == written["counters"]["store_bytes"] > 0
    assert total.data["loaded_bytes"] == read["counters"]["load_bytes"] > 0
    assert total.load_failures() == {"miss": 1} == {
        r: n for r, n in read["load_failures"].items() if n
    }
    waits = read["histograms"]["layer_wait_seconds"]
    assert total.data["layer_waits"] == waits["count"] >= LAYERS
    assert total.data["layer_wait_seconds"] == pytest.approx(waits["sum"])
    summary = total.reduce()
    assert summary["load_failures"] == 1
    assert summary["loaded_MiB"] == round(read["counters"]["load_bytes"] / (1 << 20), 3)


def test_take_reports_each_event_once(env):
    """vLLM asks every step: a take returns what came since the last one and
    then nothing, while the counters the sidecar reads keep their totals."""
    writer, _ = env.worker(seed=1, maru_async_store=False)
    reader = StepStatsReader()
    step(writer, store_meta("a", env.keys(tokens(64)), first_block=0))
    first = reader.take(writer.stats)
    assert first is not None and first.data["stored_bytes"] > 0
    assert reader.take(writer.stats) is None, "nothing new: no stats for this step"

    step(writer, store_meta("b", env.keys(tokens(32, start=900)), first_block=8))
    second = reader.take(writer.stats)
    assert second is not None
    assert set(second.data) == {"stored_bytes"}
    assert first.data["stored_bytes"] + second.data["stored_bytes"] == _counters(writer)["counters"]["store_bytes"]


def test_a_replaced_stats_object_starts_from_zero():
    """The worker swaps its in-memory counters for the pool's at
    register_kv_caches: the new object's counts are reported in full."""
    reader = StepStatsReader()
    before = ConnectorStats(role="worker")
    before.record_load(4096, 0.01)
    assert reader.take(before).data == {"loaded_bytes": 4096}
    after = ConnectorStats(role="worker")
    after.record_load(1000, 0.01)
    assert reader.take(after).data == {"loaded_bytes": 1000}


def test_the_connector_reports_the_half_it_runs():
    """``get_kv_connector_stats`` reads the scheduler half's counters in the scheduler."""
    scheduler_half = SimpleNamespace(stats=ConnectorStats(role="scheduler"))
    connector = SimpleNamespace(worker_half=None, scheduler_half=scheduler_half, _step_stats=StepStatsReader())
    scheduler_half.stats.record_hit_tokens(128)
    scheduler_half.stats.record_recomputed_tokens(64)
    got = MaruKVConnector.get_kv_connector_stats(connector)
    assert got.data == {"hit_tokens": 128, "recomputed_tokens": 64}
    assert MaruKVConnector.get_kv_connector_stats(connector) is None


def test_the_payload_survives_vllms_serialization_and_rebuild():
    stats = ConnectorStats(role="worker")
    stats.record_load(3 << 20, 0.02)
    stats.record_load_failure("timeout")
    stats.record_layer_wait(0.004)
    sent = StepStatsReader().take(stats)
    assert sent is not None
    wire = MsgpackEncoder().encode(sent.to_dict())
    received = MsgpackDecoder(dict).decode(wire)
    rebuilt = MaruKVConnector.build_kv_connector_stats(received)
    assert isinstance(rebuilt, MaruKVConnectorStats)
    assert rebuilt.data == sent.data
    assert rebuilt.reduce() == sent.reduce()
    assert rebuilt.reduce()["avg_layer_wait_ms"] == pytest.approx(4.0)
    # The logger accumulates into the first object it rebuilt: the payload it
    # was built from (shared with the Prometheus logger) must not change.
    rebuilt.aggregate(MaruKVConnector.build_kv_connector_stats(received))
    assert received == sent.data
    assert MaruKVConnector.build_kv_connector_stats(None).is_empty()
    with pytest.raises(TypeError, match="MaruKVConnectorStats"):
        rebuilt.aggregate(SimpleNamespace(data={}))  # type: ignore[arg-type]


def _metric_types(registry: CollectorRegistry) -> dict:
    """vLLM's metric classes, bound to a registry of the test's own."""

    def bound(base):
        return type(base.__name__, (base,), {"__init__": lambda self, *a, **kw: base.__init__(
            self, *a, registry=registry, **kw)})

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_prom_metrics_register_and_observe_per_engine():
    registry = CollectorRegistry()
    labels = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    metrics = MaruKVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), _metric_types(registry), ["model_name", "engine"], labels)
    sample = registry.get_sample_value
    engine1 = {"model_name": "tiny", "engine": "1"}
    # Every series exists at 0 before the first event, each reason too.
    for reason in LOAD_FAILURE_REASONS:
        assert sample("vllm:maru_load_failures_total", {**engine1, "reason": reason}) == 0
    assert sample("vllm:maru_hit_tokens_total", engine1) == 0

    payload = {"hit_tokens": 320, "loaded_bytes": 81920, "stored_bytes": 4096,
               "load_failures:copy_error": 2, "layer_waits": 4, "layer_wait_seconds": 0.5}
    metrics.observe(payload, engine_idx=1)
    metrics.observe({"hit_tokens": 64, "a_key_of_a_newer_connector": 1}, engine_idx=1)
    assert sample("vllm:maru_hit_tokens_total", engine1) == 384
    assert sample("vllm:maru_loaded_bytes_total", engine1) == 81920
    assert sample("vllm:maru_stored_bytes_total", engine1) == 4096
    assert sample("vllm:maru_load_failures_total", {**engine1, "reason": "copy_error"}) == 2
    assert sample("vllm:maru_layer_waits_total", engine1) == 4
    assert sample("vllm:maru_layer_wait_seconds_total", engine1) == 0.5
    assert sample("vllm:maru_hit_tokens_total", {"model_name": "tiny", "engine": "0"}) == 0
