"""What the registry raises and reports (errors, plain result records), and its argument checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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
    """What one ``expire`` released."""

    lapsed_leases: tuple[str, ...] = ()
    pins_released: int = 0
    reservations_released: int = 0


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One record, for inspection: ``state`` is ``"reserved"`` or ``"committed"``."""

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
    """``keys`` packed into one ``bytes``; ``BadRequest`` for anything but 16-byte keys."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        data = bytes(keys)
        if len(data) % KEY_BYTES:
            raise BadRequest(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {len(data)}")
        return data
    try:
        return join_keys(keys)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def key_list(keys: Keys) -> Sequence[bytes]:
    """``keys`` as a sequence of 16-byte ``bytes`` (packed keys are split; a sequence is kept)."""
    if not isinstance(keys, (bytes, bytearray, memoryview)):
        return keys
    data = joined_keys(keys)
    return [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)]


def first_occurrences(keys: Sequence[bytes]) -> np.ndarray:
    """Mask of the positions holding the first occurrence of their key."""
    n = len(keys)
    first_of = dict(zip(reversed(keys), range(n - 1, -1, -1)))
    if len(first_of) == n:
        return np.ones(n, dtype=bool)
    first = np.zeros(n, dtype=bool)
    first[list(first_of.values())] = True
    return first


def split_items(items: Sequence[tuple[bytes, int]]) -> tuple[list[bytes], np.ndarray]:
    """Keys and lengths of reserve items, checked."""
    try:
        keys, lengths = (list(column) for column in zip(*items)) if len(items) else ([], [])
    except (TypeError, ValueError):
        raise BadRequest("reserve items must be (key, length) pairs") from None
    if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {KEY_BYTES}):
        bad = next(i for i, k in enumerate(keys) if type(k) is not bytes or len(k) != KEY_BYTES)
        raise BadRequest(f"reserve item {bad}: a key must be {KEY_BYTES} bytes, got {keys[bad]!r}")
    if lengths and set(map(type, lengths)) != {int}:
        bad = next(i for i, n in enumerate(lengths) if type(n) is not int)
        raise BadRequest(f"reserve item {bad}: the length must be an int, got {lengths[bad]!r}")
    try:
        array = np.array(lengths, dtype=np.int64)
    except OverflowError:
        raise BadRequest("reserve lengths must be below 2**63 bytes") from None
    if len(array) and array.min() <= 0:
        bad = int(np.argmin(array))
        raise BadRequest(f"reserve item {bad}: the length must be positive, got {lengths[bad]}")
    return keys, array
