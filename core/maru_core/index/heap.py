"""Giving the heap that large requests freed back to the system.

A large request (a reserve or retrieve of 131,072 keys is a 2 MiB frame)
is decoded into a few objects of megabytes (its keys, its lengths, the
arrays made of them, its reply), freed once it is answered. glibc's
``malloc`` serves blocks of that size from the heap once a freed one has
raised its mmap threshold, and keeps the freed heap for reuse instead of
returning it: the index's resident memory stays at the high-water mark of
what its large requests, interleaved, ever held (10 MiB more than needed
after ten refused 2 MiB reserves), counted as the index's own by the node.
``malloc_trim(0)`` gives back every free page of every arena.

``HeapTrimmer`` counts the bytes of the frames the index received and sent
(each frees about its size, and more, once answered) and trims from the
event loop's periodic sweep:

- at most once per ``interval_s`` (1 s) while large frames keep coming
  (``threshold_bytes``, 64 MiB, since the last trim);
- ``settle_s`` (3 s) after the last trim when fewer came since
  (``settle_bytes``, 1 MiB, at least);
- once more ``settle_s`` after a trim that had frames to count: a request
  still under way when it ran (a large one runs in slices, the sweep between
  them) frees its memory after it.

So an idle index never trims, one that only heartbeats now and then, and a
flood of large frames once a second. A trim takes about 0.5 ms for the
10 MiB such a flood leaves free, 8 ms per 100 MiB free (the pages it gives
back fault in again as the heap grows). Where ``malloc_trim`` does not exist
(another C library than glibc, another system), nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from typing import Callable

log = logging.getLogger(__name__)

#: Bytes of frames received and sent since the last trim that make the next one due, and
#: the seconds between two trims at least: while large frames keep coming.
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024
TRIM_INTERVAL_S = 1.0
#: The same once they stopped: what the last of them left is given back this soon.
SETTLE_BYTES = 1024 * 1024
SETTLE_S = 3.0


def glibc_malloc_trim() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of the process's C library, or ``None`` where it has none (not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return lambda: function(0)


class HeapTrimmer:
    """Trims the heap after frames of many bytes, at most once per ``interval_s``
    (see the module docstring for when).

    ``trim`` defaults to glibc's ``malloc_trim(0)`` (where there is none,
    ``trim_if_due`` does nothing); ``clock`` to ``time.monotonic``. Not
    thread-safe: the event loop's thread calls ``note`` and ``trim_if_due``.
    """

    def __init__(
        self,
        threshold_bytes: int = TRIM_THRESHOLD_BYTES,
        interval_s: float = TRIM_INTERVAL_S,
        settle_bytes: int = SETTLE_BYTES,
        settle_s: float = SETTLE_S,
        *,
        trim: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= settle_bytes <= threshold_bytes:
            raise ValueError(f"settle_bytes ({settle_bytes}) must be at least 1 and at most threshold_bytes "
                             f"({threshold_bytes})")  # fmt: skip
        if not 0 <= interval_s <= settle_s:
            raise ValueError(f"interval_s ({interval_s}) must be zero or more seconds, and at most settle_s "
                             f"({settle_s})")  # fmt: skip
        self.threshold_bytes, self.interval_s = threshold_bytes, interval_s
        self.settle_bytes, self.settle_s = settle_bytes, settle_s
        self._trim = trim if trim is not None else glibc_malloc_trim()
        self._clock = clock
        self._pending = 0  # bytes of frames since the last trim
        self._last = -float("inf")  # when the last trim began
        self._follow_up = False  # the last trim counted frames: one more once settled
        self.trims = 0
        self.trim_seconds = 0.0  # time spent trimming, all trims together

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def note(self, nbytes: int) -> None:
        """``nbytes`` of a frame were received or sent (and are freed once answered)."""
        self._pending += nbytes

    def trim_if_due(self) -> bool:
        """Trim now if due (see the module docstring); whether it did."""
        pending = self._pending
        if self._trim is None or (pending < self.settle_bytes and not self._follow_up):
            return False
        started = self._clock()
        since = started - self._last
        if since < self.interval_s or (since < self.settle_s and pending < self.threshold_bytes):
            return False
        self._trim()
        took = self._clock() - started
        self._pending, self._last, self._follow_up = 0, started, pending >= self.settle_bytes
        self.trims += 1
        self.trim_seconds += took
        log.debug("heap trimmed in %.1f ms after %d MiB of frames", 1000 * took, pending >> 20)
        return True
