"""Prometheus metrics of the index, on an explicit ``CollectorRegistry``.

Pool, key, eviction and lease figures are read from the registry's stats at
scrape time, the block aliases' from their table (a collector keeps no state
between scrapes); RPC durations and
errors are recorded by the server as requests are answered. Names and labels
are those of ``docs/architecture.md`` (Metrics).

Every ``maru_index_rpc_errors_total{op,type}`` series the protocol can produce
exists at zero from start-up: a series born at its first error has no earlier
sample, so ``rate()`` and ``increase()`` (and the alerts built on them) would
miss that first error.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from maru_core.index.aliases import AliasTable
from maru_core.index.peers import RATE_LIMIT_REASONS
from maru_core.index.quotas import QUOTAS
from maru_core.protocol import OPS, REPLY_ERROR_TYPES

log = logging.getLogger(__name__)

#: RPC duration buckets in seconds: from a small lookup (tens of
#: microseconds) to a stalled request.
RPC_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
POOL_STATES = ("free", "reserved", "committed", "pinned")
#: The ``op`` label: every op of the protocol, and ``invalid`` for a request
#: that names none the server can parse (the server's label for it).
RPC_OPS = (*OPS, "invalid")
#: The ``reason`` label of closed connections (``maru_core.index.server.CLOSE_REASONS``).
CLOSE_REASONS = ("auth", "bad_frame", "connection_limit", "lease_cap", "hello_timeout", "stalled", "idle")
#: The ``type`` label of errors: every error type an index replies with.
RPC_ERROR_TYPES = tuple(error_type.value for error_type in REPLY_ERROR_TYPES)


class PoolCollector:
    """Reads the registry's stats at scrape time.

    ``read_stats`` returns the registry's ``RegistryStats`` (or ``None`` when
    it cannot be read right now: the scrape then carries no pool figures
    rather than failing). ``capacity_bytes`` is the pool's data area.
    """

    def __init__(self, read_stats: Callable[[], Any], capacity_bytes: int) -> None:
        self._read_stats = read_stats
        self._capacity_bytes = capacity_bytes

    def collect(self) -> Iterator[Metric]:
        capacity = GaugeMetricFamily(
            "maru_pool_capacity_bytes", "Bytes of the pool's data area.", value=self._capacity_bytes
        )
        yield capacity
        try:
            stats = self._read_stats()
        except Exception:
            log.warning("registry stats unavailable for this scrape", exc_info=True)
            return
        if stats is None:
            return
        by_state = GaugeMetricFamily(
            "maru_pool_bytes", "Bytes of the pool's data area by state.", labels=["state"]
        )
        for state in POOL_STATES:
            by_state.add_metric([state], getattr(stats, f"{state}_bytes"))
        yield by_state
        yield GaugeMetricFamily("maru_keys", "Committed keys in the index.", value=stats.keys)
        yield CounterMetricFamily(
            "maru_evictions", "Objects evicted to make room.", value=stats.evictions
        )
        yield GaugeMetricFamily("maru_leases", "Live client leases.", value=stats.leases)


class AliasCollector:
    """Reads the alias table's size and counters at scrape time (``len`` and ints:
    safe to read from the scrape's thread)."""

    def __init__(self, table: AliasTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("maru_index_aliases", "Block aliases the index holds (--max-aliases at most).",
                                value=len(self._table))  # fmt: skip
        yield CounterMetricFamily("maru_index_alias_evictions",
                                  "Block aliases dropped, least recently used first, to stay within --max-aliases.",
                                  value=self._table.evicted)  # fmt: skip


class GcPauses:
    """Times every garbage collection of the process into ``histogram`` by generation: a
    collection runs in whichever thread allocated last, the event loop's mostly, and holds
    every client meanwhile (``gc.callbacks``; ``close`` stops timing)."""

    def __init__(self, histogram: Histogram) -> None:
        # Every series from start-up (see the module docstring), resolved now: the callback then
        # takes no lock of the histogram's own (a collection may start while another thread holds it).
        self._by_generation = [histogram.labels(str(generation)) for generation in range(3)]
        self._started: dict[int, float] = {}  # per thread: a collection runs in one thread at a time
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = time.perf_counter()
        elif (started := self._started.pop(thread, None)) is not None:
            self._by_generation[info["generation"]].observe(time.perf_counter() - started)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class IndexMetrics:
    """The index's metrics. ``observe_rpc`` is thread-safe and cheap (a few µs)."""

    def __init__(
        self,
        read_stats: Callable[[], Any],
        capacity_bytes: int,
        registry: CollectorRegistry | None = None,
        *,
        process_metrics: bool = True,
        aliases: AliasTable | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._duration = Histogram(
            "maru_index_rpc_duration_seconds",
            "Time the index took to answer a request, by op.",
            ["op"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._errors = Counter(
            "maru_index_rpc_errors",
            "Requests answered with an error, by op and error type.",
            ["op", "type"],
            registry=self.registry,
        )
        for op in RPC_OPS:  # at zero from the start (see the module docstring)
            for error_type in RPC_ERROR_TYPES:
                self._errors.labels(op, error_type)
        self._closed = Counter(
            "maru_index_connections_closed",
            "Connections the index closed, by reason (auth, bad_frame, connection_limit, lease_cap, hello_timeout, "
            "stalled, idle).",
            ["reason"],
            registry=self.registry,
        )
        for reason in CLOSE_REASONS:
            self._closed.labels(reason)
        self._auth_failures = Counter(
            "maru_index_auth_failures", "hello requests with a wrong or missing token.", registry=self.registry
        )
        self._rate_limited = Counter(
            "maru_index_rate_limited",
            "Peers held to their budgets, by reason: connections (a new connection closed at accept), "
            "auth_failures (a wrong-token answer held back), received_bytes (a connection's reading paused).",
            ["reason"],
            registry=self.registry,
        )
        for reason in RATE_LIMIT_REASONS:
            self._rate_limited.labels(reason)
        self._quota_refusals = Counter(
            "maru_index_quota_refusals",
            "Calls a lease's quota refused (error 'quota') or cut short (some objects got no slot), by quota "
            "(reservations, pins, evictions; peer_reservations, peer_pins, peer_evictions: the quotas of all "
            "the leases of one peer together).",
            ["quota"],
            registry=self.registry,
        )
        for quota in QUOTAS:
            self._quota_refusals.labels(quota)
        self._objects_lost = Counter(
            "maru_index_pool_truncated_objects",
            "Objects dropped because something truncated the pool file under the index (which then gave "
            "the file its size back); any increase means a process shrank the pool.",
            registry=self.registry,
        )
        self._flushed = Counter(
            "maru_index_flushed_objects",
            "Objects removed by flush requests (marucache flush), apart from the evictions that make room.",
            registry=self.registry,
        )
        self.registry.register(PoolCollector(read_stats, capacity_bytes))
        if aliases is not None:
            self.registry.register(AliasCollector(aliases))
        self._gc_pauses: GcPauses | None = None
        if process_metrics:
            ProcessCollector(registry=self.registry)
            self._gc_pauses = GcPauses(Histogram(
                "maru_index_gc_pause_seconds",
                "Time the index's garbage collections took, by generation (0, 1, 2: full); the event loop "
                "answers nobody meanwhile.",
                ["generation"],
                buckets=RPC_BUCKETS,
                registry=self.registry,
            ))
        self._http: Any = None
        self._thread: threading.Thread | None = None

    def observe_rpc(self, op: str, seconds: float, error_type: str | None = None) -> None:
        self._duration.labels(op).observe(seconds)
        if error_type is not None:
            self._errors.labels(op, error_type).inc()

    def count_closed(self, reason: str) -> None:
        self._closed.labels(reason).inc()

    def count_auth_failure(self) -> None:
        self._auth_failures.inc()

    def count_rate_limited(self, reason: str) -> None:
        self._rate_limited.labels(reason).inc()

    def count_quota_refusal(self, quota: str) -> None:
        self._quota_refusals.labels(quota).inc()

    def count_flushed(self, objects: int) -> None:
        self._flushed.inc(objects)

    def count_truncated_objects(self, objects: int) -> None:
        self._objects_lost.inc(objects)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; return the bound port."""
        self._http, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._gc_pauses is not None:
            self._gc_pauses.close()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
