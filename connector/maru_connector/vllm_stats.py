"""The connector's figures in vLLM's own statistics: ``vllm:maru_*`` on the engine's ``/metrics``.

vLLM asks each connector for its stats after every step, in every worker
(``get_kv_connector_stats``, carried back in the model runner's output) and in
the scheduler; it sums the workers' payloads with
:meth:`MaruKVConnectorStats.aggregate`, adds the scheduler's, rebuilds the
object in the front end from the dict (``build_kv_connector_stats``), feeds it
to :class:`MaruPromMetrics` (the engine's ``/metrics``, labelled
``model_name`` and ``engine``) and, every logging interval, to its log line
through :meth:`MaruKVConnectorStats.reduce`.

The figures are the increments of the half's own `ConnectorStats` (the
counters the sidecar exports, `maru_core.stats`) since the last step's
report: :class:`StepStatsReader` takes them, so no event is recorded twice
and the two views count the same events. The scheduler half contributes the
hit and recomputed tokens, the workers the bytes, load failures and layer
waits; both go through the same class, as vLLM requires one stats type per
connector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maru_core.stats import LOAD_FAILURE_REASONS, SLOT_INDEX, ConnectorStats, zero_values
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_FAILURE_PREFIX = "load_failures:"

# Payload key -> the `ConnectorStats` slot whose increments it carries.
PAYLOAD_SLOTS: dict[str, str] = {
    "hit_tokens": "counter:lookup_hit_tokens",
    "recomputed_tokens": "counter:recomputed_tokens",
    "loaded_bytes": "counter:load_bytes",
    "stored_bytes": "counter:store_bytes",
    "layer_waits": "hist:layer_wait_seconds:count",
    "layer_wait_seconds": "hist:layer_wait_seconds:sum",
    **{f"{_FAILURE_PREFIX}{reason}": f"load_failures:{reason}" for reason in LOAD_FAILURE_REASONS},
}
_PAYLOAD_INDEX = {key: SLOT_INDEX[slot] for key, slot in PAYLOAD_SLOTS.items()}

_MIB = 1 << 20


@dataclass
class MaruKVConnectorStats(KVConnectorStats):
    """One interval's increments, as ``{payload key: amount}`` (keys of
    `PAYLOAD_SLOTS`; a key absent is 0). Plain numbers under string keys:
    the dict crosses vLLM's process boundaries as it is."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> MaruKVConnectorStats:
        """Add ``other``'s increments (another worker's, the scheduler's, a later step's)."""
        if not isinstance(other, MaruKVConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into MaruKVConnectorStats")
        for key, amount in other.data.items():
            self.data[key] = self.data.get(key, 0) + amount
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures for vLLM's ``KV Transfer metrics:`` log line."""
        get = self.data.get
        waits = get("layer_waits", 0)
        return {
            "hit_tokens": get("hit_tokens", 0),
            "recomputed_tokens": get("recomputed_tokens", 0),
            "loaded_MiB": round(get("loaded_bytes", 0) / _MIB, 3),
            "stored_MiB": round(get("stored_bytes", 0) / _MIB, 3),
            "load_failures": sum(self.load_failures().values()),
            "avg_layer_wait_ms": round(1e3 * get("layer_wait_seconds", 0.0) / waits, 3) if waits else 0.0,
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def load_failures(self) -> dict[str, int]:
        """Failed loads by reason (only reasons that occurred)."""
        return {
            key[len(_FAILURE_PREFIX):]: amount
            for key, amount in self.data.items()
            if key.startswith(_FAILURE_PREFIX) and amount
        }


class StepStatsReader:
    """Turns one half's cumulative `ConnectorStats` into per-report increments.

    Each :meth:`take` returns what was recorded since the previous one (and
    so "resets" the report without touching the counters the sidecar reads).
    A half whose `ConnectorStats` is replaced (the worker swaps its in-memory
    one for the pool's at ``register_kv_caches``) starts over from zero.
    """

    def __init__(self) -> None:
        self._source: ConnectorStats | None = None
        self._last: list[int | float] = zero_values()

    def take(self, stats: ConnectorStats) -> MaruKVConnectorStats | None:
        """The increments since the last call; None when nothing moved (vLLM
        then carries no stats for this step)."""
        values = stats.values()
        if stats is not self._source:
            self._source, self._last = stats, zero_values()
        last, self._last = self._last, values
        delta = {key: values[i] - last[i] for key, i in _PAYLOAD_INDEX.items() if values[i] != last[i]}
        return MaruKVConnectorStats(data=delta) if delta else None


# (payload key, metric name without the `_total` the exposition adds, help)
_COUNTERS = (
    ("hit_tokens", "vllm:maru_hit_tokens",
     "Prompt tokens whose KV MaruCache loads from the pool (counted when the load is planned)"),
    ("recomputed_tokens", "vllm:maru_recomputed_tokens",
     "Hit tokens recomputed because their KV could not be loaded"),
    ("loaded_bytes", "vllm:maru_loaded_bytes", "Bytes copied from the MaruCache pool into the KV cache"),
    ("stored_bytes", "vllm:maru_stored_bytes", "Bytes stored from the KV cache into the MaruCache pool (committed)"),
    ("layer_wait_seconds", "vllm:maru_layer_wait_seconds",
     "Seconds the forward waited in wait_for_layer_load for MaruCache loads, summed over layers and workers"),
    ("layer_waits", "vllm:maru_layer_waits",
     "wait_for_layer_load calls while MaruCache loads were in flight (one per layer and worker)"),
)  # fmt: skip
_FAILURES = ("vllm:maru_load_failures", "MaruCache loads that failed, by reason; vLLM recomputed their tokens")


class MaruPromMetrics(KVConnectorPromMetrics):
    """Registers the ``vllm:maru_*`` counters with vLLM's metric classes and labels.

    Every series, each failure reason included, exists per engine from the
    start at 0, so ``rate()`` and alerts work before the first event.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # (payload key, engine index) -> the counter with its labels bound
        self._series: dict[tuple[str, int], Any] = {}
        for key, name, documentation in _COUNTERS:
            counter = self._counter_cls(name=name, documentation=documentation, labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._series[(key, engine)] = counter.labels(*values)
        name, documentation = _FAILURES
        failures = self._counter_cls(name=name, documentation=documentation, labelnames=[*labelnames, "reason"])
        for engine, values in per_engine_labelvalues.items():
            for reason in LOAD_FAILURE_REASONS:
                self._series[(f"{_FAILURE_PREFIX}{reason}", engine)] = failures.labels(*values, reason)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one aggregated payload (a step's, all workers and the scheduler) to the counters."""
        for key, amount in transfer_stats_data.items():
            series = self._series.get((key, engine_idx))
            if series is not None and amount > 0:  # a key of a newer connector: left out
                series.inc(amount)
