"""What the registry raises and reports (errors, plain result records), and its argument checks."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Generator, Sequence
from typing import TypeVar

import numpy as np

from maru_core.index.records import KEY_BYTES, join_keys


class RegistryError(Exception):
    """Base of the registry's refusals; ``error_type`` is the protocol's error type."""

    error_type = "internal"


class NoLease(RegistryError):
    """The lease id is unknown, closed or lapsed: open a new lease (``hello``)."""

    error_type = "no_lease"


class NoSpace(RegistryError):
    """None of a reserve's objects could be placed, even after eviction (or in quarantine)."""

    error_type = "no_space"


class Quarantined(NoSpace):
    """No slot is handed out yet: the index restarted over a pool in use (a
    ``NoSpace`` of its own type, so that a full pool and a restart read apart)."""

    error_type = "quarantined"


class QuotaExceeded(RegistryError):
    """The lease would pass one of its quotas (``maru_core.index.quotas``):
    pages held reserved or fenced, pages pinned, or pages evicted lately;
    ``quota`` names which, the message names the flag that sets it."""

    error_type = "quota"

    def __init__(self, message: str, quota: str = "reservations") -> None:
        super().__init__(message)
        self.quota = quota


class BadRequest(RegistryError, ValueError):
    """Arguments of the wrong type or range; the message names the item."""

    error_type = "bad_request"


@dataclasses.dataclass(frozen=True)
class RegistryStats:
    """Pool bytes by state (page-granular: ``free + reserved + committed ==
    capacity``; ``pinned`` is the part of ``committed`` held by pins), key
    counts, evictions since start, live leases."""

    capacity_bytes: int
    free_bytes: int
    reserved_bytes: int
    committed_bytes: int
    pinned_bytes: int
    largest_free_bytes: int
    keys: int
    reserved_keys: int
    pinned_keys: int
    evictions: int
    leases: int
    quarantined: bool


@dataclasses.dataclass(frozen=True)
class ExpiryReport:
    """What one ``expire`` released (``pins_released``: objects the lapsed leases pinned)."""

    lapsed_leases: tuple[str, ...] = ()
    pins_released: int = 0
    reservations_released: int = 0


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One record, for inspection: ``state`` is ``"reserved"`` or ``"committed"``;
    ``pins`` the pins on it, over all leases (each lease's count)."""

    state: str
    offset: int
    length: int
    generation: int
    pins: int
    lease_id: str | None


#: Keys as the registry takes them: a sequence of 16-byte keys, or all of
#: them packed into one bytes-like object (16 bytes each, as on the wire).
Keys = Sequence[bytes] | bytes | bytearray | memoryview


def joined_keys(keys: Keys) -> bytes:
    """``keys`` packed into one ``bytes`` (the very object when it already is); ``BadRequest``
    for anything but 16-byte keys."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        key_count(keys)  # checks the length
        return bytes(keys)
    try:
        return join_keys(keys)  # checks the total length only: the protocol checks each key
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def key_count(keys: Keys) -> int:
    """How many keys ``keys`` holds, read without packing them; ``BadRequest`` as ``joined_keys``."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        size = keys.nbytes if isinstance(keys, memoryview) else len(keys)
        if size % KEY_BYTES:
            raise BadRequest(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {size}")
        return size // KEY_BYTES
    return len(keys)


def select_keys(joined: bytes, positions: np.ndarray) -> bytes:
    """The keys of ``joined`` at ``positions``, packed."""
    return np.frombuffer(joined, dtype=f"V{KEY_BYTES}").take(positions).tobytes()


def first_occurrences(joined: bytes) -> np.ndarray:
    """Mask of the positions (of packed keys) holding the first occurrence of their key.

    A batch almost never repeats a key: one sort of the first words proves
    that; only a batch where two first words agree is sorted by both words
    (vectorised too: a batch built to collide costs no per-key Python work).
    """
    n = len(joined) // KEY_BYTES
    return _first_among(np.frombuffer(joined, dtype="<u8").reshape(n, 2))


def _first_among(words: np.ndarray) -> np.ndarray:
    """``first_occurrences`` of the keys ``words`` (``(n, 2)`` words)."""
    n = len(words)
    ordered = np.sort(words[:, 0])
    if not np.any(ordered[1:] == ordered[:-1]):
        return np.ones(n, dtype=bool)
    order = np.lexsort((words[:, 1], words[:, 0]))  # stable: equal keys stay in batch order
    by_key = words[order]
    starts = np.ones(n, dtype=bool)
    starts[1:] = np.any(by_key[1:] != by_key[:-1], axis=1)
    first = np.zeros(n, dtype=bool)
    first[order[starts]] = True
    return first


def first_occurrences_sliced(joined: bytes, keys_per_step: int) -> Generator[None, None, np.ndarray]:
    """``first_occurrences`` of a large batch, in steps of about ``keys_per_step``
    keys each (a generator that yields between steps; it returns the mask).

    Sorting 131,072 keys takes about 3 ms on a small VM, in one step. Here the
    batch is split into parts by a hash of both words of each key (equal keys
    share a part), with multipliers drawn per batch so that a batch cannot be
    built to crowd one part; each step sorts one part.
    """
    n = len(joined) // KEY_BYTES
    words = np.frombuffer(joined, dtype="<u8").reshape(n, 2)
    bits = max(0, (-(-n // keys_per_step) - 1).bit_length())
    if not bits:
        return _first_among(words)
    mix = np.frombuffer(os.urandom(16), dtype="<u8") | np.uint64(1)
    shift = np.uint64(64 - bits)
    part = np.empty(n, dtype=np.int32)
    for start in range(0, n, keys_per_step):  # hashing the whole batch at once took milliseconds too
        chunk = words[start : start + keys_per_step]
        mixed = chunk[:, 0] * mix[0]
        mixed += chunk[:, 1] * mix[1]
        part[start : start + keys_per_step] = mixed >> shift
        yield
    first = np.ones(n, dtype=bool)
    for p in range(1 << bits):
        members = np.flatnonzero(part == p)
        if len(members) > 1:
            first[members] = _first_among(words.take(members, axis=0))
        yield
    return first


def checked_lengths(lengths: Sequence[int] | np.ndarray, count: int) -> np.ndarray:
    """``lengths`` as an int64 array of ``count`` positive values; ``BadRequest`` otherwise."""
    if not isinstance(lengths, np.ndarray):
        if lengths and set(map(type, lengths)) != {int}:
            bad = next(i for i, n in enumerate(lengths) if type(n) is not int)
            raise BadRequest(f"reserve item {bad}: the length must be an int, got {lengths[bad]!r}")
        try:
            lengths = np.array(lengths, dtype=np.int64)
        except OverflowError:
            raise BadRequest("reserve lengths must be below 2**63 bytes") from None
    elif lengths.dtype.kind not in "iu" or (lengths.dtype.kind == "u" and len(lengths) and lengths.max() >= 2**63):
        raise BadRequest(f"reserve lengths must be integers below 2**63, got an array of {lengths.dtype}")
    lengths = lengths.astype(np.int64, copy=False)
    if lengths.shape != (count,):
        raise BadRequest(f"reserve got {count} keys but {len(lengths)} lengths")
    if count and lengths.min() <= 0:
        bad = int(np.argmin(lengths))
        raise BadRequest(f"reserve item {bad}: the length must be positive, got {int(lengths[bad])}")
    return lengths


def split_items(items: Sequence[tuple[bytes, int]]) -> tuple[bytes, np.ndarray]:
    """Packed keys and lengths of reserve items, checked."""
    try:
        keys, lengths = (list(column) for column in zip(*items)) if len(items) else ([], [])
    except (TypeError, ValueError):
        raise BadRequest("reserve items must be (key, length) pairs") from None
    if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {KEY_BYTES}):
        bad = next(i for i, k in enumerate(keys) if type(k) is not bytes or len(k) != KEY_BYTES)
        raise BadRequest(f"reserve item {bad}: a key must be {KEY_BYTES} bytes, got {keys[bad]!r}")
    return b"".join(keys), checked_lengths(lengths, len(keys))


T = TypeVar("T")


def run_to_end(steps: Generator[None, None, T]) -> T:
    """Run a sliced operation (a generator that yields between slices) at once; return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
