"""Choosing which objects found in a pool's slot table a restarted index keeps."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from maru_core.keys import KEY_BYTES
from maru_core.pool.geometry import PoolGeometry
from maru_core.protocol.locations import Location

_I63 = 2**63


def select_restorable(
    objects: Iterable[tuple[bytes, Location]], geometry: PoolGeometry
) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(keys, first pages, page counts, lengths, generations)`` of the objects to keep, by page.

    Skipped: a malformed key, a length or generation out of range, an offset
    that is not a page start of the data area, an object running past the
    end. Of two objects with one key, or two whose pages overlap, the one of
    higher generation is kept.
    """
    keys, offsets, lengths, gens = [], [], [], []
    for key, (offset, length, generation) in objects:
        if type(key) is bytes and len(key) == KEY_BYTES and 0 < length < _I63 and 0 < generation < _I63 and 0 <= offset < _I63:
            keys.append(key)
            offsets.append(offset)
            lengths.append(length)
            gens.append(generation)
    offsets_a = np.array(offsets, dtype=np.int64)
    lengths_a = np.array(lengths, dtype=np.int64)
    gens_a = np.array(gens, dtype=np.int64)
    ps, n_pages = geometry.page_size, geometry.num_pages
    rel = offsets_a - geometry.data_offset
    pages = rel // ps
    counts = -(-lengths_a // ps)
    valid = (rel >= 0) & (rel % ps == 0) & (pages + counts <= n_pages)
    # Newest first, then keep the first occurrence of each key.
    order = np.flatnonzero(valid)
    order = order[np.argsort(-gens_a[order], kind="stable")]
    seen: dict[bytes, int] = {}
    order = np.array([i for i in order.tolist() if seen.setdefault(keys[i], i) == i], dtype=np.int64)
    order = _without_overlaps(order, pages, counts, n_pages)
    order = order[np.argsort(pages[order], kind="stable")]
    return [keys[i] for i in order.tolist()], pages[order], counts[order], lengths_a[order], gens_a[order]


def _without_overlaps(newest_first: np.ndarray, pages: np.ndarray, counts: np.ndarray, n_pages: int) -> np.ndarray:
    """Drop every object that overlaps one of higher generation (earlier in ``newest_first``)."""
    by_page = newest_first[np.argsort(pages[newest_first], kind="stable")]
    ends = pages[by_page] + counts[by_page]
    if not len(by_page) or not np.any(pages[by_page][1:] < ends[:-1]):
        return newest_first
    occupied = np.zeros(n_pages, dtype=bool)
    kept = []
    for i in newest_first.tolist():
        run = occupied[pages[i] : pages[i] + counts[i]]
        if not run.any():
            run[:] = True
            kept.append(i)
    return np.array(kept, dtype=np.int64)
