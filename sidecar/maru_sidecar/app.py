"""The sidecar's composition root: builds the pool attacher, hand-off server, collectors and endpoints, and runs them."""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry

from maru_core.stats_aggregate import RegionAggregator
from maru_sidecar.collector import ConnectorCollector, SidecarCollector
from maru_sidecar.config import SidecarConfig
from maru_sidecar.credential_file import CredentialFile
from maru_sidecar.endpoints import EndpointServer
from maru_sidecar.handoff_server import HandoffServer, PoolNotReady, PoolOffer
from maru_sidecar.health import (IndexProbe, IndexReachabilityCollector, IndexWatch, handoff_readiness)

log = logging.getLogger(__name__)

ATTACH_RETRY_S = 1.0
# How often the index is probed for `maru_sidecar_index_reachable` (never for readiness).
INDEX_PROBE_INTERVAL_S = 5.0
# How often the stats regions are scanned between scrapes, so that a region is seen with a
# live writer (and folded when it ends) even when its process lives less than a scrape interval.
STATS_SCAN_INTERVAL_S = 2.0


class PoolAttacher:
    """Keeps trying to attach the pool until it exists (the index may create it after the sidecar starts)."""

    def __init__(self, config: SidecarConfig, stop: threading.Event):
        self._config, self._stop = config, stop
        self._pool: Any = None
        self._offer: PoolOffer | None = None
        self._last_error = "not tried yet"
        self._thread = threading.Thread(target=self._run, name="maru-pool-attach", daemon=True)

    def start(self) -> None:
        """Attach now if the pool is there (then the first hand-off already succeeds), else retry in the background."""
        if not self._try_attach():
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(ATTACH_RETRY_S):
            if self._try_attach():
                return

    def _try_attach(self) -> bool:
        from maru_core.pool import Pool, PoolError

        try:
            pool = Pool.attach(str(self._config.pool_path), offset=self._config.pool_offset)
        except PoolError as exc:
            if str(exc) != self._last_error:  # log each new reason once, not every second
                log.warning("cannot attach the pool yet (retrying every %.0f s): %s", ATTACH_RETRY_S, exc)
            self._last_error = str(exc)
            return False
        self._pool = pool
        self._offer = PoolOffer(fd=pool.fileno(), geometry=pool.geometry.to_dict(),
                                pool_path=str(self._config.pool_path), pool_offset=pool.offset)  # fmt: skip
        log.info("attached the pool %s at offset %d (%s)", self._config.pool_path, pool.offset, self._offer.geometry)
        return True

    def offer(self) -> PoolOffer:
        if self._offer is None:
            raise PoolNotReady(f"{self._config.pool_path}: {self._last_error}")
        return self._offer

    @property
    def attached(self) -> bool:
        return self._offer is not None

    def identity(self) -> Any:
        """The attached pool's `PoolIdentity` (None before it is attached)."""
        from maru_core.pool.pool_identity import PoolIdentity

        pool = self._pool
        return PoolIdentity.of_pool(pool) if pool is not None and self._offer is not None else None

    def close(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()
        if self._pool is not None:
            self._offer = None
            self._pool.close()
            self._pool = None


class Sidecar:
    """One sidecar process: `start()`, then `stop()` (idempotent) on SIGTERM."""

    def __init__(self, config: SidecarConfig):
        self.config = config
        self._stop = threading.Event()
        self.attacher = PoolAttacher(config, self._stop)
        self.credential = (CredentialFile(config.credential_file, config.pod_identity, config.socket_gid)
                           if config.credential_file is not None and config.pod_identity is not None else None)  # fmt: skip
        self.handoff = HandoffServer(
            config.socket_path,
            cache=config.cache,
            index_url=config.index_url,
            stats_dir=config.stats_dir,
            offer=self.attacher.offer,
            read_token=self._read_token,
            socket_gid=config.socket_gid,
            pod=config.pod_identity,
        )
        probe = IndexProbe(config.index_url, self._read_token, config.index_timeout_s, f"sidecar@{config.pod}",
                           mapped=self.attacher.identity)
        self.index_watch = IndexWatch(probe, INDEX_PROBE_INTERVAL_S, self._stop)
        self.registry = CollectorRegistry(auto_describe=False)
        self.regions = RegionAggregator(config.stats_dir, attested=True)
        self._region_scans = threading.Thread(target=self._scan_regions, name="maru-stats-scan", daemon=True)
        self.registry.register(ConnectorCollector(self.regions.scan, config.labels))
        self.registry.register(
            SidecarCollector(lambda: self.attacher.attached, self._handoff_results, config.labels)
        )
        self.registry.register(IndexReachabilityCollector(self.index_watch, config.labels))
        self.endpoints = EndpointServer(config.metrics_host, config.metrics_port, self.registry, self.readiness)
        self._stopped = False

    def start(self) -> None:
        self.attacher.start()
        if self.credential is not None:
            self._write_credential(self.credential)
        self.handoff.start()
        self.index_watch.start()
        self._region_scans.start()
        self.endpoints.start()

    def _write_credential(self, credential: CredentialFile) -> None:
        """Before the socket is bound: a connector that finds the socket finds its credential."""
        token = self.config.read_token()
        assert token is not None  # the config requires --token-file with --credential-file
        credential.write(token)
        log.info("pod %s: its credential is in %s (rewritten when the cache token changes)",
                 credential.pod, credential.path)  # fmt: skip

    def _read_token(self) -> str | None:
        """The cache token, read afresh (every hand-off, every index probe); a changed token
        rewrites the pod's credential, so a rotation reaches the file within a probe interval."""
        token = self.config.read_token()
        if token is not None and self.credential is not None:
            self.credential.refresh(token)
        return token

    def readiness(self) -> tuple[bool, str]:
        """Ready when the hand-off works: pool attached and the hand-off socket served.

        Never the index: with the index away connectors miss and vLLM
        recomputes, so the pod keeps serving; the index's state is only
        reported (after a `;`, and as `maru_sidecar_index_reachable`).
        """
        ready, message = handoff_readiness(self._pool_problem, self._handoff_serving, self.config.socket_path)
        state = self.index_watch.state
        return ready, message + (f"; {state[1]}" if state is not None else "; index not probed yet")

    def _pool_problem(self) -> str | None:
        try:
            self.attacher.offer()
        except PoolNotReady as exc:
            return str(exc)
        return None

    def _handoff_serving(self) -> bool:
        thread = self.handoff._thread  # noqa: SLF001 - the accept loop; None before start()
        return thread is not None and thread.is_alive()

    def _scan_regions(self) -> None:
        while not self._stop.wait(STATS_SCAN_INTERVAL_S):
            try:
                self.regions.scan()
            except OSError as exc:  # the next scrape reports it as a scan error
                log.debug("stats scan failed: %s", exc)

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stop.wait(timeout_s)

    def request_stop(self) -> None:
        """Signal-safe: only sets a flag; the main thread then calls `stop()`."""
        self._stop.set()

    def stop(self) -> None:
        """Stop serving, remove the socket file, close the pool. Connectors keep their own mappings."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        self.handoff.stop()
        self.endpoints.stop()
        self.attacher.close()
        self.index_watch.close()
        if self._region_scans.ident is not None:
            self._region_scans.join()

    def _handoff_results(self) -> dict[str, int]:
        return dict(self.handoff.results)
