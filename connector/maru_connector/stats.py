"""Where the connector's counters go: one `maru_core.stats.ConnectorStats` per half.

Each half (the scheduler in the engine-core process, each worker in its own)
records into its own `ConnectorStats`, whose directory is:

- with ``maru_sidecar_socket``: the ``stats_dir`` that the sidecar's hand-off
  names (the sidecar sums the region files there and exports them on
  ``/metrics``);
- in direct attach: ``maru_stats_dir`` when set (tools such as the
  end-to-end harness and ``marucache demo`` sum it with
  `maru_core.stats_aggregate.RegionAggregator`);
- otherwise none: the counters live in process memory only.

Names, reasons and buckets are those of `maru_core.stats`; the connector
keeps no counters of its own.
"""

from __future__ import annotations

import os

from maru_core.stats import ConnectorStats

from maru_connector.config import MaruConfig, MaruConfigError


def open_stats(cfg: MaruConfig, role: str, stats_dir: str | None = None) -> ConnectorStats:
    """The `ConnectorStats` of one half.

    Args:
        cfg: the parsed knobs.
        role: ``"scheduler"`` or ``"worker"`` (recorded in the region header).
        stats_dir: the hand-off's ``stats_dir`` when the caller already did the
            hand-off (the worker, which receives the pool that way); with
            ``maru_sidecar_socket`` and no ``stats_dir`` the sidecar is asked.

    Raises:
        MaruConfigError: ``maru_stats_dir`` is not a directory.
        maru_core.handoff.HandoffError: no sidecar answered, or it refused.
    """
    if cfg.maru_sidecar_socket is not None:
        directory = stats_dir if stats_dir is not None else sidecar_stats_dir(cfg)
        return ConnectorStats(directory, role=role)
    if cfg.maru_stats_dir is None:
        return ConnectorStats(role=role)
    if not os.path.isdir(cfg.maru_stats_dir):
        raise MaruConfigError(
            f"maru_stats_dir={cfg.maru_stats_dir!r} is not a directory; create it, "
            "or remove the knob to keep the counters in memory"
        )
    return ConnectorStats(cfg.maru_stats_dir, role=role)


def sidecar_stats_dir(cfg: MaruConfig) -> str:
    """Ask the sidecar where the stats regions go (one hand-off; its descriptor is closed at once)."""
    from maru_core.handoff import fetch_pool

    if cfg.maru_sidecar_socket is None:
        raise ValueError("no maru_sidecar_socket is set: the stats regions' directory comes from a sidecar")
    handoff = fetch_pool(cfg.maru_sidecar_socket, cfg.resolve_token(), cfg.maru_cache_name)
    os.close(handoff.fd)
    return handoff.stats_dir
