"""Health of the sidecar: readiness is "the hand-off works"; the index is only watched.

The cache is an accelerator, never a dependency of serving: with the index
away the connector treats every lookup as a miss and vLLM recomputes. So
`/readyz` never asks the index (a sidecar that went NotReady with it would
pull every vLLM pod out of its Service at each index restart or node drain).
The index is probed in the background instead, and its reachability is
exported as `maru_sidecar_index_reachable` and logged when it changes.
"""

from __future__ import annotations

import logging
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)

LABELS = ("cache", "namespace", "pod")


def handoff_readiness(pool_error: Callable[[], str | None], serving: Callable[[], bool],
                      socket_path: Path) -> tuple[bool, str]:
    """(ready, why): the pool is attached, the hand-off server is serving, and its socket is in place.

    `pool_error()` is None once the pool is attached, else why not;
    `serving()` says whether the hand-off server's accept loop runs.
    """
    problem = pool_error()
    if problem is not None:
        return False, f"not ready: pool not attached: {problem}"
    if not serving():
        return False, f"not ready: the hand-off server on {socket_path} has stopped; see the sidecar's log"
    try:
        mode = socket_path.lstat().st_mode
    except OSError as exc:
        return False, f"not ready: hand-off socket {socket_path} is gone ({exc.strerror}); restart the pod"
    if not stat.S_ISSOCK(mode):
        return False, f"not ready: {socket_path} is no longer a socket; restart the pod"
    return True, f"ready: pool attached, hand-off served on {socket_path}"


class IndexProbe:
    """Checks the index with a fresh client: its `hello` (address, token, protocol version) and one `heartbeat`.

    A fresh connection per probe tells the truth about the index as a new
    connector would meet it (address, token, protocol version), at the cost of
    one short-lived lease per probe, which lapses after the index's lease TTL.
    """

    def __init__(self, url: str, read_token: Callable[[], str | None], timeout_s: float, client_name: str,
                 mapped: Callable[[], Any] | None = None):
        self._url, self._read_token = url, read_token
        self._timeout_s, self._client_name = timeout_s, client_name
        # The PoolIdentity of the pool the sidecar attached (None before): an index serving another
        # region is reported as refused, as the connector refuses it (WrongPool).
        self._mapped = mapped or (lambda: None)
        self._lock = threading.Lock()  # probes run one at a time

    def check(self) -> tuple[bool, str]:
        """(reachable, a sentence saying what was found)."""
        from maru_core.index.client import IndexClient, IndexRejected, IndexUnavailable

        with self._lock:
            try:
                client = IndexClient(self._url, token=self._read_token(), client_name=self._client_name,
                                     timeout_s=self._timeout_s, heartbeat=False, pool=self._mapped())  # fmt: skip
                try:
                    client.heartbeat()  # connects: hello, then heartbeat
                finally:
                    client.close()
            except IndexRejected as exc:
                return False, f"index {self._url} refused the sidecar: {exc}"
            except (IndexUnavailable, OSError, ValueError) as exc:
                return False, f"index {self._url} unreachable: {exc}"
        return True, f"index {self._url} answered"


class IndexWatch:
    """Probes the index every `interval_s` in a thread; keeps the last answer for metrics and `/readyz`'s text."""

    def __init__(self, probe: IndexProbe, interval_s: float, stop: threading.Event):
        self._probe, self._interval_s, self._stop = probe, interval_s, stop
        self._state: tuple[bool, str] | None = None  # None: not probed yet
        self._thread = threading.Thread(target=self._run, name="maru-index-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.probe_once()
            if self._stop.wait(self._interval_s):
                return

    def probe_once(self) -> tuple[bool, str]:
        state = self._probe.check()
        if self._state is None or state[0] != self._state[0]:
            (log.info if state[0] else log.warning)("%s%s", state[1], "" if state[0] else
                                                    "; the connector treats the cache as empty meanwhile")
        self._state = state
        return state

    @property
    def state(self) -> tuple[bool, str] | None:
        return self._state

    def close(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()


class IndexReachabilityCollector:
    """`maru_sidecar_index_reachable`: 1 when the last probe of the index answered (absent before the first)."""

    def __init__(self, watch: IndexWatch, labels: Mapping[str, str]):
        self._watch = watch
        self._label_values = [labels[name] for name in LABELS]

    def collect(self) -> Iterator[Metric]:
        state = self._watch.state
        if state is None:
            return
        family = GaugeMetricFamily(
            "maru_sidecar_index_reachable",
            "1 when the index answered the sidecar's last probe (hello with the cache token); "
            "0 means connectors miss and vLLM recomputes.", labels=LABELS,
        )  # fmt: skip
        family.add_metric(self._label_values, 1 if state[0] else 0)
        yield family
