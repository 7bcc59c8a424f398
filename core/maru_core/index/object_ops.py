"""The index's ``list_objects`` and ``flush`` ops: what the cache holds, by
model layout and storage format, and its eviction on an operator's request.

Keys are hashes: the index cannot tell from a key whose KV it names. What it
can tell is what the writer recorded in the object's head entry in the pool
(``maru_core.pool.slots``): the storage format and the layout fingerprint,
the connector's digest of the model's KV layout as its worker detected it
(kind, block size, KV heads, head size, dtype, the model's layer indices,
chunk tokens and format). Objects of two models differ in it unless both
models have the same KV geometry and dtype (two fine-tunes of one base model
share it). An object whose head entry no longer checks as its committed head
is listed under format ``unknown`` and layout 0.

Both ops walk the record table by row ranges (``maru_core.index.maintenance``):
at most ``limit`` rows per request (``MAX_SCAN_ROWS``), a slice of rows per
step with other connections answered in between, and a ``next_cursor`` to
send back for the next range (``None``: done). The server counts them, as
every op, in ``maru_index_rpc_duration_seconds{op}``, and the objects a flush
removed in ``maru_index_flushed_objects_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from maru_core.index.maintenance import CommittedRows
from maru_core.pool.slot_check import SlotHeaderCheck
from maru_core.protocol.messages import OBJECT_FORMATS

if TYPE_CHECKING:
    from maru_core.index.connection import Reply
    from maru_core.index.registry import Registry
    from maru_core.pool import Pool

_UNKNOWN = OBJECT_FORMATS.index("unknown")
#: A flush cut short by an eviction window asks to be sent again after this share of the window.
RETRY_SHARE_OF_WINDOW = 0.125

#: One group of a ``list_objects`` reply: (layout, format) -> [objects, pages, bytes, pinned].
Groups = dict[tuple[int, str], list[int]]


class ListArgs(TypedDict):
    """A ``list_objects`` request's arguments, as ``protocol.messages.SCHEMAS`` checked them."""

    cursor: int
    limit: int


class FlushArgs(ListArgs):
    """A ``flush`` request's arguments: which objects (``None``: any layout, any format)."""

    layout: int | None
    format: str | None


class ObjectOps:
    """``list_objects`` and ``flush`` over ``registry`` and the slot headers of ``pool``;
    ``slice_rows`` rows per step; ``flushed(objects)`` is told what each flush step evicted."""

    def __init__(self, registry: "Registry", pool: "Pool", slice_rows: int, flushed: Callable[[int], object]) -> None:
        self._registry = registry
        self._heads = SlotHeaderCheck(pool)  # committed heads
        self._page_size = int(pool.geometry.page_size)
        self._slice_rows = slice_rows
        self._flushed = flushed

    def list_objects(self, lease_id: str, args: ListArgs) -> Generator[None, None, "Reply"]:
        """Committed objects among rows ``[cursor, cursor + limit)``, grouped by layout and format."""
        groups: Groups = {}
        next_cursor: int | None = args["cursor"]
        end = args["cursor"] + args["limit"]
        while next_cursor is not None and next_cursor < end:
            if next_cursor != args["cursor"]:
                yield  # other connections between slices
            self._registry.renew(lease_id)
            found = self._registry.committed_rows(next_cursor, min(self._slice_rows, end - next_cursor))
            _, codes, layouts = self._identities(found)
            _add_groups(groups, found, codes, layouts)
            next_cursor = found.next_cursor
        return {"groups": [{"layout": layout, "format": fmt, "objects": n, "pages": pages, "bytes": size,
                            "pinned": pinned} for (layout, fmt), (n, pages, size, pinned) in groups.items()],
                "next_cursor": next_cursor}  # fmt: skip

    def flush(self, lease_id: str, args: FlushArgs) -> Generator[None, None, "Reply"]:
        """Evict the unpinned committed objects among rows ``[cursor, cursor + limit)`` whose
        layout and format match ``layout`` and ``format`` (``None``: any). Stops at the first
        slice an eviction window cut short, whose rows the ``next_cursor`` it answers starts at."""
        totals = {"evicted": 0, "evicted_bytes": 0, "pinned": 0, "held_back": 0}
        quota, retry_after_s = None, 0.0
        next_cursor: int | None = args["cursor"]
        end = args["cursor"] + args["limit"]
        while next_cursor is not None and next_cursor < end:
            if next_cursor != args["cursor"]:
                yield
            found = self._registry.committed_rows(next_cursor, min(self._slice_rows, end - next_cursor))
            _, codes, layouts = self._identities(found)
            chosen = np.ones(len(found.rows), dtype=bool)
            if args["layout"] is not None:
                chosen &= layouts == np.uint64(args["layout"])
            if args["format"] is not None:
                chosen &= codes == OBJECT_FORMATS.index(args["format"])
            outcome = self._registry.flush_rows(lease_id, found, chosen)
            self._flushed(outcome.evicted)
            totals["evicted"] += outcome.evicted
            totals["evicted_bytes"] += outcome.evicted_pages * self._page_size
            totals["held_back"] += outcome.held_back
            if outcome.quota is None:
                totals["pinned"] += outcome.pinned  # a step cut short counts its pinned objects when sent again
            else:
                quota = outcome.quota
                retry_after_s = self._registry.evict_window_s * RETRY_SHARE_OF_WINDOW
                break  # this slice's rows again, once the window allows
            next_cursor = found.next_cursor
        return {**totals, "quota": quota, "retry_after_s": retry_after_s, "next_cursor": next_cursor}

    def _identities(self, found: CommittedRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(whether each head checks, its format as an index of ``OBJECT_FORMATS``, its layout)."""
        ok, fmt, layout = self._heads.formats_and_layouts(found.keys, found.offsets, found.generations)
        codes = np.where(ok, fmt, _UNKNOWN).astype(np.int64)
        return ok, codes, layout


def _add_groups(groups: Groups, found: CommittedRows, codes: np.ndarray, layouts: np.ndarray) -> None:
    """Add the objects of ``found`` to ``groups`` (one vectorised pass per distinct group)."""
    if not len(found.rows):
        return
    pairs = np.stack([layouts, codes.astype(np.uint64)], axis=1)
    distinct, which = np.unique(pairs, axis=0, return_inverse=True)
    which = which.reshape(-1)
    for i, (layout, code) in enumerate(distinct.tolist()):
        members = which == i
        entry = groups.setdefault((int(layout), OBJECT_FORMATS[int(code)]), [0, 0, 0, 0])
        entry[0] += int(members.sum())
        entry[1] += int(found.pages[members].sum())
        entry[2] += int(found.lengths[members].sum())
        entry[3] += int(found.pinned[members].sum())
