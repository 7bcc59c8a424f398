"""Commit records: the index marks a committed object's head entry *committed*.

A writer leaves its object's head *pending* (``maru_core.pool.slots``); a
pending head says only that bytes were written, not that the index ever made
them visible: the scheduler may have dropped the store, the writer may have
aborted it or died, its reservation may have lapsed. The index, and only the
index, turns the head committed, in its own mapping of the pool, while it
commits the key and before it acknowledges the commit. A restarted index
rebuilds itself from committed heads alone, and a reader accepts no other.

The index promotes a whole batch at once: the head entries are gathered with
one numpy take, their state byte set and CRC32 made anew (one ``zlib.crc32``
call per entry, as the commit's check does), and each written back as one
64-byte row. Its continuations stay as they are (they are the head's copy
with the continuation state, whichever state the head is in). A crash
between the promotion and the acknowledgement leaves committed heads of
objects whose writer had completed its copy and header before it asked for
the commit: restoring those is right. A torn promotion fails its CRC: that
object is neither restored nor read (a miss).
"""

from __future__ import annotations

import zlib

import numpy as np

from maru_core.pool.geometry import SLOT_HEADER_BYTES
from maru_core.pool.slots import SlotState

_STATE_BYTE = 4
_CRC_SPAN = 60


class CommitRecords:
    """``record(offsets)``: mark the head entries of the objects at these data
    ``offsets`` of ``pool`` committed (``Registry.commit``'s ``record``).

    The caller has just checked each of them is a valid pending head naming
    the key being committed (``SlotHeaderCheck`` in the pending state); an
    entry found in another state is left alone. Returns how many it marked.
    """

    def __init__(self, pool) -> None:
        self._pool = pool

    def __call__(self, offsets: np.ndarray) -> int:
        g = self._pool.geometry
        offsets = np.asarray(offsets, dtype=np.int64)
        if not len(offsets):
            return 0
        rel = offsets - g.data_offset
        if np.any((rel < 0) | (rel % g.page_size != 0) | (rel >= g.num_pages * g.page_size)):
            raise ValueError("commit records are written for data offsets of objects in the pool only")
        pages = rel // g.page_size
        table = np.frombuffer(self._pool.buffer, dtype=np.uint8, count=g.num_pages * SLOT_HEADER_BYTES,
                              offset=g.table_offset).reshape(g.num_pages, SLOT_HEADER_BYTES)  # fmt: skip
        try:
            entries = table.take(pages, axis=0)
            pending = entries[:, _STATE_BYTE] == SlotState.PENDING
            entries = entries[pending]
            entries[:, _STATE_BYTE] = SlotState.COMMITTED
            bodies = np.ascontiguousarray(entries[:, :_CRC_SPAN]).view(f"V{_CRC_SPAN}").ravel().tolist()
            crcs = np.fromiter(map(zlib.crc32, bodies), dtype="<u4", count=len(entries))
            entries[:, _CRC_SPAN:] = crcs.view(np.uint8).reshape(-1, 4)
            table[pages[pending]] = entries
        finally:
            del table  # no view of the mapping outlives the call, so the pool can be closed
        return int(pending.sum())
