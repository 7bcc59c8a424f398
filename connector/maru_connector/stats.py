"""The connector's own counters, named as in ``docs/architecture.md``.

One :class:`ConnectorCounters` per connector half (process). Its values are
plain numbers keyed by the exported metric name; labelled counters (failure
reasons) use ``name{reason="..."}`` keys with a bounded set of reasons.
When ``maru_stats_path`` is set, :class:`StatsDumper` appends a JSON line
(``role``, ``pid``, ``time``, ``counters``) whenever the values changed;
:func:`read_stats` sums the latest line of every process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

LOOKUPS = "maru_lookups_total"
LOOKUP_HIT_TOKENS = "maru_lookup_hit_tokens_total"
PARKED_REQUESTS = "maru_parked_requests"
LOAD_BYTES = "maru_load_bytes_total"
LOAD_SECONDS = "maru_load_duration_seconds_sum"
LOAD_COUNT = "maru_load_duration_seconds_count"
LOAD_FAILURES = "maru_load_failures_total"
RECOMPUTED_TOKENS = "maru_recomputed_tokens_total"
LAYER_WAIT_SECONDS = "maru_layer_wait_seconds_sum"
LAYER_WAIT_COUNT = "maru_layer_wait_seconds_count"
STORE_BYTES = "maru_store_bytes_total"
STORE_SECONDS = "maru_store_duration_seconds_sum"
STORE_COUNT = "maru_store_duration_seconds_count"
STORE_FAILURES = "maru_store_failures_total"

# Bounded label values: every failure is one of these.
LOAD_FAILURE_REASONS = (
    "miss",
    "short_reply",
    "long_reply",
    "index_error",
    "timeout",
    "header_mismatch",
    "copy_error",
)
STORE_FAILURE_REASONS = ("index_error", "no_space", "copy_error", "commit_error")


def labelled(name: str, reason: str) -> str:
    return f'{name}{{reason="{reason}"}}'


class ConnectorCounters:
    """Thread-safe counters and gauges of one connector half."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = defaultdict(float)
        self._version = 0

    def add(self, name: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[name] += amount
            self._version += 1

    def set(self, name: str, value: float) -> None:
        with self._lock:
            if self._values.get(name) != value:
                self._values[name] = value
                self._version += 1

    def observe(self, name_sum: str, name_count: str, seconds: float) -> None:
        with self._lock:
            self._values[name_sum] += seconds
            self._values[name_count] += 1
            self._version += 1

    def load_failure(self, reason: str) -> None:
        if reason not in LOAD_FAILURE_REASONS:
            raise ValueError(f"unknown load failure reason {reason!r}")
        self.add(labelled(LOAD_FAILURES, reason))

    def store_failure(self, reason: str) -> None:
        if reason not in STORE_FAILURE_REASONS:
            raise ValueError(f"unknown store failure reason {reason!r}")
        self.add(labelled(STORE_FAILURES, reason))

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0.0)

    def snapshot(self) -> tuple[int, dict[str, float]]:
        with self._lock:
            return self._version, dict(self._values)


class StatsDumper:
    """Appends a counters snapshot to ``path`` when they changed (JSON lines)."""

    def __init__(self, path: str | None, role: str, counters: ConnectorCounters) -> None:
        self._path = Path(path) if path else None
        self._role = role
        self._counters = counters
        self._written_version = -1

    def maybe_dump(self) -> None:
        if self._path is None:
            return
        version, values = self._counters.snapshot()
        if version == self._written_version:
            return
        line = json.dumps(
            {"role": self._role, "pid": os.getpid(), "time": time.time(), "counters": values}
        )
        # One write of one line with O_APPEND: lines of several processes never interleave.
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        self._written_version = version


def read_stats(path: str | os.PathLike[str]) -> dict[str, float]:
    """Sum the latest snapshot of every (role, pid) found in a stats file."""
    latest: dict[tuple[str, int], dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            latest[(record["role"], record["pid"])] = record["counters"]
    total: dict[str, float] = defaultdict(float)
    for counters in latest.values():
        for name, value in counters.items():
            total[name] += value
    return dict(total)
