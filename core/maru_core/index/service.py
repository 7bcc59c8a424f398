"""Composition root of the index process: registry, restore, server, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import gc
import logging
from typing import Any

from maru_core.index.aliases import DEFAULT_MAX_ALIASES, AliasTable
from maru_core.index.metrics import IndexMetrics
from maru_core.index.limits import ServerLimits
from maru_core.index.quotas import EVICT_WINDOW_S, MAX_LEASE_EVICT_FRACTION, MAX_LEASE_PIN_FRACTION
from maru_core.index.registry import MAX_EVICT_FRACTION, MAX_FENCE_S, MAX_LEASE_POOL_FRACTION, Registry
from maru_core.index.server import IndexServer
from maru_core.pool.slots import SlotState
from maru_core.protocol import Location

log = logging.getLogger(__name__)

#: How long a scrape waits for the event loop to hand over the stats.
_STATS_TIMEOUT_S = 2.0


class _Default(enum.Enum):
    AS_LEASE = "as the lease's"


#: A per-peer quota that follows its lease's (``build_service``).
AS_LEASE = _Default.AS_LEASE


def freeze_startup_objects() -> int:
    """Move every object alive now (modules, classes, functions, the restored state) out of the
    garbage collector's reach; return how many. A full collection walks every tracked object,
    and runs in the event loop's thread: with the start-up heap in it, one took 10-20 ms on a
    small VM, a stall for every client. Frozen objects are still freed by reference counting;
    only a reference cycle among them would never be collected, and start-up builds none that
    dies. Called once the index is built, before it serves."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclasses.dataclass
class IndexService:
    server: IndexServer
    metrics: IndexMetrics | None
    restored: int

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        await self.server.close()


def restore_registry(registry: Registry, pool: Any) -> int:
    """Rebuild ``registry`` from the intact committed objects in ``pool``'s slot
    table; return how many it kept. This also starts the registry's quarantine
    (no slot handed out for one lease period): writers of the previous index
    may still be copying into slots it had reserved.

    Only a head that an index marked committed is a commit record. Pending
    heads (written, never committed: aborted, dropped by the scheduler,
    lapsed, or their writer or the index died first; and every head written
    by a release before commit records) are left out: their pages are free.
    """
    restored = registry.restore(
        (header.key, Location(offset, header.length, header.generation))
        for offset, header in pool.iter_slot_headers(SlotState.COMMITTED)
    )
    pending = sum(1 for _ in pool.iter_slot_headers(SlotState.PENDING))
    if pending:
        log.info("left out %d objects whose slot headers record no commit (never committed, "
                 "or written by a MaruCache release before commit records)", pending)  # fmt: skip
    return restored


def build_service(
    pool: Any,
    *,
    token: str | None,
    lease_ttl_s: float,
    reservation_ttl_s: float,
    with_metrics: bool,
    fresh_pool: bool = False,
    expiry_interval_s: float | None = None,
    watermarks: tuple[float, float] = (0.95, 0.85),
    limits: ServerLimits | None = None,
    max_evict_fraction: float = MAX_EVICT_FRACTION,
    max_lease_pool_fraction: float = MAX_LEASE_POOL_FRACTION,
    max_fence_s: float = MAX_FENCE_S,
    max_lease_pin_fraction: float = MAX_LEASE_PIN_FRACTION,
    max_lease_evict_fraction: float | None = MAX_LEASE_EVICT_FRACTION,
    evict_window_s: float = EVICT_WINDOW_S,
    max_peer_pool_fraction: float | _Default = AS_LEASE,
    max_peer_pin_fraction: float | _Default = AS_LEASE,
    max_peer_evict_fraction: float | None | _Default = AS_LEASE,
    max_aliases: int = DEFAULT_MAX_ALIASES,
) -> IndexService:
    """Build the index of ``pool``; call inside the running loop that will serve it.

    ``fresh_pool`` says the pool was just created: nothing to restore and no
    writer of an earlier index to wait for. ``watermarks`` is (high, low):
    the used fractions at which eviction starts and down to which it evicts.
    ``limits`` bound what one connection may cost; ``max_evict_fraction`` what
    one reserve may evict; ``max_lease_pool_fraction`` the share of the pool
    one lease may hold reserved or fenced; ``max_fence_s`` how long a live
    writer's lapsed reservation stays fenced; ``max_lease_pin_fraction`` the
    share one lease may pin; ``max_lease_evict_fraction`` the share one lease's
    reserves may evict per ``evict_window_s`` (``None``: no such bound);
    ``max_peer_pool_fraction``, ``max_peer_pin_fraction`` and
    ``max_peer_evict_fraction`` the same for all the leases of one peer
    (``AS_LEASE``: as its lease's, so raising a lease's quota never leaves an
    engine, one lease of its peer, held to a lower one); ``max_aliases`` the
    block aliases the index keeps (``maru_core.index.aliases``).
    """
    high, low = watermarks
    if max_peer_pool_fraction is AS_LEASE:
        max_peer_pool_fraction = max_lease_pool_fraction
    if max_peer_pin_fraction is AS_LEASE:
        max_peer_pin_fraction = max_lease_pin_fraction
    if max_peer_evict_fraction is AS_LEASE:
        max_peer_evict_fraction = max_lease_evict_fraction
    registry = Registry(pool.geometry, lease_ttl_s=lease_ttl_s, reservation_ttl_s=reservation_ttl_s,
                        high_watermark=high, low_watermark=low,
                        max_evict_fraction=max_evict_fraction, max_lease_pages_fraction=max_lease_pool_fraction,
                        max_fence_s=max_fence_s, max_lease_pin_fraction=max_lease_pin_fraction,
                        max_lease_evict_fraction=max_lease_evict_fraction, evict_window_s=evict_window_s,
                        max_peer_pages_fraction=max_peer_pool_fraction, max_peer_pin_fraction=max_peer_pin_fraction,
                        max_peer_evict_fraction=max_peer_evict_fraction)  # fmt: skip
    aliases = AliasTable(max_aliases)
    restored = 0
    if not fresh_pool:
        restored = restore_registry(registry, pool)
        log.info("restored %d objects from the slot headers; no new slots for %.3g s", restored, registry.quarantine_s)
    metrics = None
    if with_metrics:
        loop = asyncio.get_running_loop()

        async def stats() -> Any:
            return registry.stats()

        # Scrapes arrive on the HTTP thread; the registry belongs to the loop.
        def read_stats() -> Any:
            return asyncio.run_coroutine_threadsafe(stats(), loop).result(_STATS_TIMEOUT_S)

        metrics = IndexMetrics(read_stats, pool.geometry.capacity_bytes, aliases=aliases)
    interval = expiry_interval_s or min(1.0, lease_ttl_s / 4)
    server = IndexServer(registry, pool, token=token, expiry_interval_s=interval, metrics=metrics, limits=limits,
                         aliases=aliases)
    return IndexService(server=server, metrics=metrics, restored=restored)
