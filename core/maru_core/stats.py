"""The connector's counters, and the shared stats region that carries them to the sidecar.

The connector records every event (a lookup, a load, a failure, a layer wait)
into a `ConnectorStats`. With a stats directory (the sidecar's socket
directory, handed over by `maru_core.handoff`), the counters live in a small
fixed-layout file mapped `MAP_SHARED`, one file per process; the sidecar maps
the same files read-only and sums them at each scrape, so reporting an event
costs a few stores into memory and never a network round trip. Without a
directory the same counters live in process memory (tests, direct attach).

Region layout (little-endian, every slot 8 bytes and 8-byte aligned, so a
reader never sees a torn value):

    0   magic  b"MARUSTAT"         8
    8   format version (u32)        4
    12  slot count (u32)            4
    16  layout digest (16 bytes)    16   blake2b of the slot names and buckets
    32  writer pid (u32)            4
    36  reserved                    4
    40  created, unix ns (u64)      8
    48  role (16 bytes, ASCII)      16
    64  slots: i64 counters/gauges/bucket counts, f64 histogram sums

A file has one writer process; its threads serialise on a lock, so the plain
read-modify-write of a slot is safe. The writer holds an exclusive `flock` on
its file for its whole life: a reader that can take a shared lock knows the
writer has gone (across PID namespaces too, which a pid cannot tell). A file
appears under its final name only once it is initialised and locked.
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"MARUSTAT"
FORMAT_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sII16sII Q16s")
REGION_PREFIX = "maru-stats."
REGION_SUFFIX = ".region"

COUNTERS = (
    "lookups", "lookup_hit_tokens", "load_bytes", "recomputed_tokens", "store_bytes", "parked_loads",
    "early_pinned_loads", "head_start_loads",
)
# The counters of the layouts older connectors write, oldest first: a reader
# maps their slots by name (a slot they lack reads 0), so a sidecar newer than
# the connector in its pod still exports that connector's metrics.
PREVIOUS_COUNTERS = (
    ("lookups", "lookup_hit_tokens", "load_bytes", "recomputed_tokens", "store_bytes", "parked_loads"),
    COUNTERS[:-1],  # before head_start_loads
)
GAUGES = ("parked_requests",)
# Failure reasons are a closed set: they become a label, which must stay bounded.
LOAD_FAILURE_REASONS = (
    "miss",  # a key resolved at lookup was gone at retrieve
    "short_reply",  # the index answered fewer locations than keys
    "long_reply",  # the index answered more locations than keys
    "header_mismatch",  # a slot header did not name the key and generation resolved
    "index_error",  # the index refused the request or the connection broke
    "timeout",  # the index did not answer in time
    "copy_error",  # the copy into the KV cache failed
    "aborted",  # the request was aborted or preempted while parked
    "other",
)
STORE_FAILURE_REASONS = (
    "no_space",  # the index had no free slots even after eviction
    "index_error",
    "timeout",
    "copy_error",
    "commit_error",  # the commit was refused or its reply lost
    "aborted",
    "other",
    "load_failed",  # computed in a step whose forward used a failed load: never committed
    "quarantined",  # the index restarted over the pool and hands out no slot yet
)
HISTOGRAMS = ("load_duration_seconds", "layer_wait_seconds", "store_duration_seconds")
# Upper bounds in seconds; one more bucket (+Inf) follows. From 10 us (one
# layer's wait when its copy already landed) to 10 s (a long load).
BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


# The store failure reasons before "quarantined" (the last) was added.
_STORE_REASONS_BEFORE_QUARANTINED = STORE_FAILURE_REASONS[:-1]
# Older connectors' layouts (counters, store failure reasons), oldest first,
# read by name as above.
PREVIOUS_LAYOUTS = (
    *((counters, _STORE_REASONS_BEFORE_QUARANTINED) for counters in PREVIOUS_COUNTERS),
    (PREVIOUS_COUNTERS[-1], STORE_FAILURE_REASONS),
)


def _slot_names(counters: tuple[str, ...] = COUNTERS,
                store_reasons: tuple[str, ...] = STORE_FAILURE_REASONS) -> tuple[str, ...]:
    names = [f"counter:{c}" for c in counters]
    names += [f"gauge:{g}" for g in GAUGES]
    names += [f"load_failures:{r}" for r in LOAD_FAILURE_REASONS]
    names += [f"store_failures:{r}" for r in store_reasons]
    for h in HISTOGRAMS:
        names += [f"hist:{h}:bucket:{i}" for i in range(len(BUCKETS) + 1)]
        names += [f"hist:{h}:count", f"hist:{h}:sum"]
    return tuple(names)


SLOT_NAMES = _slot_names()
SLOT_INDEX = {name: i for i, name in enumerate(SLOT_NAMES)}
FLOAT_SLOTS = frozenset(i for i, n in enumerate(SLOT_NAMES) if n.endswith(":sum"))
GAUGE_SLOTS = frozenset(i for i, n in enumerate(SLOT_NAMES) if n.startswith("gauge:"))


def _layout_digest(names: tuple[str, ...]) -> bytes:
    return hashlib.blake2b(repr((names, BUCKETS)).encode(), digest_size=16, person=b"maru-stats").digest()


LAYOUT_DIGEST = _layout_digest(SLOT_NAMES)
REGION_BYTES = HEADER_BYTES + 8 * len(SLOT_NAMES)
# Every layout this version reads: layout digest -> its slot names.
READABLE_LAYOUTS = {
    _layout_digest(names): names
    for names in (SLOT_NAMES, *(_slot_names(*layout) for layout in PREVIOUS_LAYOUTS))
}
_READABLE_SIZES = {HEADER_BYTES + 8 * len(names) for names in READABLE_LAYOUTS.values()}
# histogram -> (slot of bucket 0, slot of count, slot of sum), resolved once: recording stays ~1 us.
_HISTOGRAM_SLOTS = {
    h: (SLOT_INDEX[f"hist:{h}:bucket:0"], SLOT_INDEX[f"hist:{h}:count"], SLOT_INDEX[f"hist:{h}:sum"])
    for h in HISTOGRAMS
}


class StatsRegionError(ValueError):
    """A stats region file that this version cannot read (wrong magic, version or layout)."""


class StatsRegionInvalid(StatsRegionError):
    """A file in the stats directory that is no usable region: not a regular file,
    or a region holding a value no connector writes (negative, not finite, too large)."""


#: No counter of a real connector reaches this (2**53: still exact as a float); a value
#: above it would only overflow a sum.
MAX_SLOT_VALUE = 2**53


def zero_values() -> list[int | float]:
    """A slot vector of zeros (ints, floats for histogram sums)."""
    return [0.0 if i in FLOAT_SLOTS else 0 for i in range(len(SLOT_NAMES))]


def decode(values: list[int | float]) -> dict[str, Any]:
    """Turn a slot vector into the nested dict that `ConnectorStats.snapshot` returns.

    Histogram buckets are per bucket (not cumulative), the last one is +Inf.
    """
    get = lambda name: values[SLOT_INDEX[name]]  # noqa: E731
    return {
        "counters": {c: get(f"counter:{c}") for c in COUNTERS},
        "gauges": {g: get(f"gauge:{g}") for g in GAUGES},
        "load_failures": {r: get(f"load_failures:{r}") for r in LOAD_FAILURE_REASONS},
        "store_failures": {r: get(f"store_failures:{r}") for r in STORE_FAILURE_REASONS},
        "histograms": {
            h: {
                "buckets": [get(f"hist:{h}:bucket:{i}") for i in range(len(BUCKETS) + 1)],
                "count": get(f"hist:{h}:count"),
                "sum": get(f"hist:{h}:sum"),
            }
            for h in HISTOGRAMS
        },
    }


class ConnectorStats:
    """Counters of one connector process, in a shared stats region or in memory.

    `ConnectorStats()` keeps them in process memory; `ConnectorStats(directory)`
    creates a region file `maru-stats.<pid>.<random>.region` in `directory` (the
    `stats_dir` of a `PoolHandoff`) that the sidecar exports. Every `record_*`
    method is thread-safe and cheap (no I/O, no allocation beyond Python's).
    Reasons must be one of `LOAD_FAILURE_REASONS` / `STORE_FAILURE_REASONS`.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, role: str = "connector"):
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.path: Path | None = None
        if directory is None:
            self._buffer: mmap.mmap | bytearray = bytearray(REGION_BYTES)
        else:
            self._fd, self.path, self._buffer = _create_region(Path(directory), role)
        slots = memoryview(self._buffer)[HEADER_BYTES:]
        self._ints = slots.cast("q")
        self._floats = slots.cast("d")

    # -- recording -----------------------------------------------------------

    def record_lookup(self, hit_tokens: int = 0) -> None:
        """One scheduler lookup that found `hit_tokens` tokens in the cache (0: a miss)."""
        with self._lock:
            self._add("counter:lookups", 1)
            self._add("counter:lookup_hit_tokens", hit_tokens)

    def record_hit_tokens(self, tokens: int) -> None:
        """Hit tokens counted apart from their lookup: the connector counts a hit
        once, when its load is planned, however often vLLM asked before."""
        with self._lock:
            self._add("counter:lookup_hit_tokens", tokens)

    def record_load(self, nbytes: int, seconds: float) -> None:
        """A completed load of `nbytes` bytes, from start to the last copy's completion."""
        with self._lock:
            self._add("counter:load_bytes", nbytes)
            self._observe("load_duration_seconds", seconds)

    def record_load_failure(self, reason: str, recomputed_tokens: int = 0) -> None:
        """A failed load; its `recomputed_tokens` tokens are computed again by vLLM."""
        slot = _reason_slot("load_failures", reason, LOAD_FAILURE_REASONS)
        with self._lock:
            self._ints[slot] += 1
            self._add("counter:recomputed_tokens", recomputed_tokens)

    def record_recomputed_tokens(self, tokens: int) -> None:
        """Tokens recomputed because their KV could not be loaded (without a failure event)."""
        with self._lock:
            self._add("counter:recomputed_tokens", tokens)

    def record_parked_load(self) -> None:
        """A hit whose load runs while its request waits parked (not in the step that computes it)."""
        with self._lock:
            self._add("counter:parked_loads", 1)

    def record_early_pinned_load(self) -> None:
        """A load that copied under the pins its lookup took, with no retrieve of its own."""
        with self._lock:
            self._add("counter:early_pinned_loads", 1)

    def record_head_start_load(self) -> None:
        """A load that reused the copies its head start queued before vLLM allocated its blocks."""
        with self._lock:
            self._add("counter:head_start_loads", 1)

    def set_parked_requests(self, count: int) -> None:
        """The number of requests parked waiting for their KV to load, now."""
        with self._lock:
            self._ints[SLOT_INDEX["gauge:parked_requests"]] = count

    def record_layer_wait(self, seconds: float) -> None:
        """Time the forward pass waited in `wait_for_layer_load` for one layer."""
        with self._lock:
            self._observe("layer_wait_seconds", seconds)

    def record_store(self, nbytes: int, seconds: float) -> None:
        """A committed store of `nbytes` bytes, from reserve to commit."""
        with self._lock:
            self._add("counter:store_bytes", nbytes)
            self._observe("store_duration_seconds", seconds)

    def record_store_failure(self, reason: str) -> None:
        """A store that was skipped or abandoned (a lost store is only a future miss)."""
        slot = _reason_slot("store_failures", reason, STORE_FAILURE_REASONS)
        with self._lock:
            self._ints[slot] += 1

    # -- reading -------------------------------------------------------------

    def values(self) -> list[int | float]:
        """The raw slot vector (see `SLOT_NAMES`)."""
        with self._lock:
            return _read_slots(self._ints, self._floats)

    def snapshot(self) -> dict[str, Any]:
        """All counters as a nested dict (see `decode`)."""
        return decode(self.values())

    def close(self) -> None:
        """Unmap the region and release its lock; the file stays for the sidecar to fold.

        The counters stay readable (and writable, in memory) after `close`.
        """
        with self._lock:
            if self._fd is None:
                return
            mapped = self._buffer
            assert isinstance(mapped, mmap.mmap)  # a region with a file descriptor is a mapping
            final = bytearray(mapped)
            self._ints.release()
            self._floats.release()
            mapped.close()
            os.close(self._fd)  # releases the flock: the sidecar sees a finished writer
            self._fd = None
            self._buffer = final
            slots = memoryview(final)[HEADER_BYTES:]
            self._ints, self._floats = slots.cast("q"), slots.cast("d")

    def __enter__(self) -> ConnectorStats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------

    def _add(self, name: str, amount: int) -> None:
        if amount < 0:
            raise ValueError(f"stats: {name} cannot decrease (got {amount})")
        self._ints[SLOT_INDEX[name]] += int(amount)

    def _observe(self, histogram: str, seconds: float) -> None:
        first_bucket, count, total = _HISTOGRAM_SLOTS[histogram]
        self._ints[first_bucket + bisect.bisect_left(BUCKETS, seconds)] += 1  # le: bound included
        self._floats[total] += float(seconds)
        self._ints[count] += 1


def _reason_slot(kind: str, reason: str, allowed: tuple[str, ...]) -> int:
    if reason not in allowed:
        raise ValueError(f"stats: unknown {kind} reason {reason!r}; use one of {', '.join(allowed)}")
    return SLOT_INDEX[f"{kind}:{reason}"]


def _read_slots(ints: memoryview[int], floats: memoryview[float], names: tuple[str, ...] = SLOT_NAMES) -> list[int | float]:
    """The region's values in this version's slot order (``names``: the region's layout)."""
    # Element-wise loads of aligned 8-byte values: never torn.
    if names is SLOT_NAMES:
        return [floats[i] if i in FLOAT_SLOTS else ints[i] for i in range(len(SLOT_NAMES))]
    values = zero_values()
    for i, name in enumerate(names):
        slot = SLOT_INDEX.get(name)
        if slot is not None:
            values[slot] = floats[i] if slot in FLOAT_SLOTS else ints[i]
    return values


def _create_region(directory: Path, role: str) -> tuple[int, Path, mmap.mmap]:
    if not directory.is_dir():
        raise FileNotFoundError(
            f"stats directory {directory} does not exist; it is the directory of the "
            "sidecar's socket, which must be a volume shared with the sidecar"
        )
    name = f"{REGION_PREFIX}{os.getpid()}.{secrets.token_hex(4)}{REGION_SUFFIX}"
    tmp = directory / f".{name}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, REGION_BYTES)
        buffer = mmap.mmap(fd, REGION_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        header = _HEADER.pack(
            MAGIC, FORMAT_VERSION, len(SLOT_NAMES), LAYOUT_DIGEST,
            os.getpid(), 0, time.time_ns(), role.encode("ascii", "replace")[:16],
        )  # fmt: skip
        buffer[: len(header)] = header
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(tmp, directory / name)  # visible only once initialised and locked
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd, directory / name, buffer


@dataclass(frozen=True)
class RegionReading:
    """What a reader found in one region file."""

    path: Path
    pid: int
    role: str
    created_ns: int
    alive: bool  # the writer still holds its lock
    values: list[int | float]


def read_region(path: str | os.PathLike[str]) -> RegionReading:
    """Read one region file (read-only) and tell whether its writer is still alive.

    A region of an older connector's layout (`PREVIOUS_LAYOUTS`) is read by
    slot name; a slot it lacks reads 0.

    Raises `StatsRegionError` for a file of another format or of a layout
    this version does not know (a newer connector), `StatsRegionInvalid` for a file
    that is not a regular file or holds a value out of range, `OSError` if it
    vanished. Opening never blocks (a FIFO named like a region is refused).
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StatsRegionInvalid(f"{path}: not a regular file")
        size = os.fstat(fd).st_size
        if size not in _READABLE_SIZES:
            raise StatsRegionError(f"{path}: size {size}, expected {REGION_BYTES}")
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as buffer:
            magic, version, count, digest, pid, _, created, role = _HEADER.unpack_from(buffer)
            if magic != MAGIC or version != FORMAT_VERSION:
                raise StatsRegionError(f"{path}: not a stats region of format {FORMAT_VERSION}")
            names = READABLE_LAYOUTS.get(digest)
            if names is None:
                raise StatsRegionError(f"{path}: written by a MaruCache with another counter layout")
            if count != len(names) or size != HEADER_BYTES + 8 * count:
                raise StatsRegionError(f"{path}: not a stats region of format {FORMAT_VERSION}")
            slots = memoryview(buffer)[HEADER_BYTES:]
            ints, floats = slots.cast("q"), slots.cast("d")
            try:
                values = _read_slots(ints, floats, names)
            finally:
                ints.release()
                floats.release()
                slots.release()
        if not all(0 <= v <= MAX_SLOT_VALUE for v in values):  # also refuses nan
            raise StatsRegionInvalid(f"{path}: holds a value no connector writes (negative, not finite or too large)")
        return RegionReading(path, pid, role.rstrip(b"\0").decode("ascii", "replace"),
                             created, _writer_alive(fd), values)  # fmt: skip
    finally:
        os.close(fd)


def _writer_alive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def region_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The published region files in `directory` (not the ones being created)."""
    return sorted(
        p for p in Path(directory).glob(f"{REGION_PREFIX}*{REGION_SUFFIX}") if not p.name.startswith(".")
    )
