"""The index's watch over its pool file's size (``maru_core.pool.truncation``).

Any engine that maps the pool can ``ftruncate`` a pool file. The index looks
at the file's size before it hands out slots, before it records commits
(writing a commit mark past the file's end would kill it with SIGBUS) and
once per sweep; a pool found short is given its size back at once, and the
objects whose bytes were lost are dropped (their slot headers cleared, so
no reader takes them) and counted. Commits of reservations in the lost range
are refused (their pages are fenced: the writer's bytes are gone).
"""

from __future__ import annotations

import logging
from typing import Any

from maru_core.pool.truncation import first_lost_page, regrow

log = logging.getLogger(__name__)


class PoolSizeWatch:
    """``check()``: a cheap ``fstat``; repairs and reports a truncated pool file."""

    def __init__(self, pool: Any, registry: Any, metrics: Any = None) -> None:
        self._pool = pool
        self._registry = registry
        self._metrics = metrics
        self.truncations = 0  # times the pool was found short
        self.objects_lost = 0

    def check(self) -> None:
        lost_from = regrow(self._pool)
        if lost_from is None:
            return
        geometry = self._pool.geometry
        offsets, lengths = self._registry.drop_pages_from(first_lost_page(geometry, lost_from))
        for offset, length in zip(offsets.tolist(), lengths.tolist()):
            self._pool.invalidate_slot(offset, length)
        self.truncations += 1
        self.objects_lost += len(offsets)
        if self._metrics is not None:
            self._metrics.count_truncated_objects(len(offsets))
        log.error(
            "the pool file %s ended at pool byte %d of %d: a process truncated it. The index gave it its "
            "size back and dropped the %d objects whose bytes were lost (misses from now on); find the "
            "process that resized the pool (docs/security.md, 'The pool's size')",
            self._pool.where, lost_from, geometry.size, len(offsets),
        )  # fmt: skip
