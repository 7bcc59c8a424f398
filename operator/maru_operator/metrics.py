"""The operator's Prometheus metrics, in an explicit registry."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .pods import REASONS as STALE_REASONS
from .results import ReconcileResult

RESULTS = tuple(result.value for result in ReconcileResult)
# Every status.phase a MaruCache can have (conditions.phase); maru_cache_phase has one series for each.
PHASES = ("Ready", "Starting", "Pending", "Invalid")


@dataclasses.dataclass
class OperatorMetrics:
    registry: CollectorRegistry
    reconciles: Counter
    duration: Histogram
    stale_pods: Gauge
    cache_ready: Gauge
    cache_phase: Gauge
    leader: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> OperatorMetrics:
        registry = registry if registry is not None else CollectorRegistry()
        reconciles = Counter("maru_operator_reconciles", "MaruCache reconciles by result", ["result"],
                             registry=registry)
        duration = Histogram("maru_operator_reconcile_duration_seconds", "Time one MaruCache reconcile took",
                             registry=registry,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        for result in RESULTS:
            reconciles.labels(result=result)
        stale_pods = Gauge("maru_operator_stale_pods",
                           "Opted-in pods that do not run with their cache's current pool, by reason "
                           "(old_placement: injected before a resize or move; not_injected: created while the "
                           "webhook was not answering); re-create them (kubectl rollout restart)",
                           ["namespace", "cache", "reason"], registry=registry)
        cache_ready = Gauge("maru_cache_ready", "1 while the MaruCache's status says Ready, else 0",
                            ["namespace", "cache"], registry=registry)
        cache_phase = Gauge("maru_cache_phase", "1 for the MaruCache's status.phase, 0 for every other phase",
                            ["namespace", "cache", "phase"], registry=registry)
        leader = Gauge("maru_operator_leader", "1 while this replica reconciles (holds the leader Lease, or runs "
                       "without leader election), 0 while it waits and only serves the webhook", registry=registry)
        return cls(registry, reconciles, duration, stale_pods, cache_ready, cache_phase, leader)

    def record_phase(self, namespace: str, cache: str, phase: str) -> None:
        """Export the phase this process last wrote (or found written) in a cache's status."""
        self.cache_ready.labels(namespace=namespace, cache=cache).set(1 if phase == "Ready" else 0)
        for known in dict.fromkeys((*PHASES, phase)):
            self.cache_phase.labels(namespace=namespace, cache=cache, phase=known).set(1 if known == phase else 0)

    def forget_cache(self, namespace: str, cache: str) -> None:
        """Drop every per-cache series of a deleted cache."""
        series = [(self.cache_ready, ()), *((self.cache_phase, (p,)) for p in PHASES),
                  *((self.stale_pods, (r,)) for r in STALE_REASONS)]
        for gauge, extra in series:
            try:
                gauge.remove(namespace, cache, *extra)
            except KeyError:
                pass

    def count_reconcile(self, result: ReconcileResult) -> None:
        self.reconciles.labels(result=result.value).inc()

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.duration.observe(time.perf_counter() - start)

    def serve(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve `/metrics`; stop with `server.shutdown()`."""
        return start_http_server(port, addr=addr, registry=self.registry)
