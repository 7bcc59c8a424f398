"""Page allocation: contiguous runs of pages out of coalescing free extents.

Free space is a set of maximal free extents (runs of pages), kept twice:
by start (to find and merge neighbours on free) and by (length, start) (to
find the best fit). Allocation is best fit, lowest address first among equal
fits, carved from the start of the extent: it leaves the large extents
whole for large objects and keeps fragmentation low. Freed runs merge with
free neighbours at once, so the free list never holds two adjacent extents.
Memory is per free extent, not per page: a TiB pool costs nothing more than
a small one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from sortedcontainers import SortedDict, SortedList


class AllocatorError(Exception):
    """A run freed twice or outside the pool: a bug in the caller, never a user error."""


class ExtentAllocator:
    """Allocates runs of pages in ``[0, num_pages)``."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"an allocator needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.free_pages = 0
        self._by_start: SortedDict = SortedDict()
        self._by_size: SortedList = SortedList()
        self._add(0, num_pages)

    @classmethod
    def from_occupied(cls, num_pages: int, starts: np.ndarray, counts: np.ndarray) -> "ExtentAllocator":
        """An allocator whose occupied runs are exactly ``starts``/``counts``
        (sorted by start, not overlapping): every gap between them is free."""
        alloc = cls(num_pages)
        alloc._remove(0, num_pages)
        ends = starts + counts
        gap_starts = np.concatenate(([0], ends))
        gap_ends = np.concatenate((starts, [num_pages]))
        if len(starts) and (np.any(gap_ends < gap_starts) or starts[0] < 0 or ends[-1] > num_pages):
            raise AllocatorError("occupied runs overlap or lie outside the pool")
        keep = gap_ends > gap_starts
        for start, end in zip(gap_starts[keep].tolist(), gap_ends[keep].tolist()):
            alloc._add(start, end - start)
        return alloc

    def _add(self, start: int, count: int) -> None:
        self._by_start[start] = count
        self._by_size.add((count, start))
        self.free_pages += count

    def _remove(self, start: int, count: int) -> None:
        del self._by_start[start]
        self._by_size.remove((count, start))
        self.free_pages -= count

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def largest_free(self) -> int:
        """Pages in the largest free extent: the largest object that fits now."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def extent_count(self) -> int:
        return len(self._by_start)

    def fragmentation(self) -> float:
        """1 - largest free extent / free pages: 0 when all free space is one run."""
        return 0.0 if not self.free_pages else 1.0 - self.largest_free / self.free_pages

    def extents(self) -> Iterator[tuple[int, int]]:
        """``(start, count)`` of every free extent, by start."""
        return iter(self._by_start.items())

    def allocate(self, count: int) -> int | None:
        """First page of a newly allocated run of ``count`` pages, or ``None`` when no extent fits."""
        if count <= 0:
            raise ValueError(f"allocate a positive number of pages, not {count}")
        i = self._by_size.bisect_left((count, -1))
        if i == len(self._by_size):
            return None
        size, start = self._by_size[i]
        self._remove(start, size)
        if size > count:
            self._add(start + count, size - count)
        return start

    def allocate_at(self, start: int, count: int) -> bool:
        """Allocate exactly ``[start, start+count)``; ``False`` when any of it is not free."""
        i = self._by_start.bisect_right(start) - 1
        if i < 0 or count <= 0:
            return False
        ext_start, ext_count = self._by_start.peekitem(i)
        if start + count > ext_start + ext_count:
            return False
        self._remove(ext_start, ext_count)
        if start > ext_start:
            self._add(ext_start, start - ext_start)
        end, ext_end = start + count, ext_start + ext_count
        if end < ext_end:
            self._add(end, ext_end - end)
        return True

    def free(self, start: int, count: int) -> None:
        """Return ``[start, start+count)`` to the free extents, merging neighbours."""
        if count <= 0 or start < 0 or start + count > self.num_pages:
            raise AllocatorError(f"run [{start}, {start + count}) is outside [0, {self.num_pages})")
        i = self._by_start.bisect_right(start)
        if i > 0:
            prev_start, prev_count = self._by_start.peekitem(i - 1)
            if prev_start + prev_count > start:
                raise AllocatorError(f"run [{start}, {start + count}) is already (partly) free")
            if prev_start + prev_count == start:
                self._remove(prev_start, prev_count)
                start, count = prev_start, prev_count + count
                i -= 1
        if i < len(self._by_start):
            next_start, next_count = self._by_start.peekitem(i)
            if next_start < start + count:
                raise AllocatorError(f"run [{start}, {start + count}) is already (partly) free")
            if next_start == start + count:
                self._remove(next_start, next_count)
                count += next_count
        self._add(start, count)

    def free_runs(self, starts: np.ndarray, counts: np.ndarray) -> None:
        """Free many runs at once; adjacent runs are merged before they reach the free lists."""
        if not len(starts):
            return
        order = np.argsort(starts, kind="stable")
        starts, counts = starts[order], counts[order]
        ends = starts + counts
        if np.any(starts[1:] < ends[:-1]):
            raise AllocatorError("runs freed together overlap each other")
        # A new merged run begins wherever a run does not start where the previous one ended.
        breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
        run_starts = starts[np.concatenate(([0], breaks))]
        run_ends = ends[np.concatenate((breaks - 1, [len(starts) - 1]))]
        for start, end in zip(run_starts.tolist(), run_ends.tolist()):
            self.free(start, end - start)
