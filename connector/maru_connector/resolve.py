"""Resolve a load: pin every object, check the reply and the slot headers.

Used by the synchronous load path and by the async loader alike. Nothing here
touches a vLLM block: a load only starts copying once :func:`resolve_load`
has returned, that is once every (chunk, layer) key resolved to a pinned slot
whose header names that key and generation (and, when asked, whose payload
matches the checksum in that header). Any failure unpins what was
pinned (never a pin another load of the same lease holds) and raises
:class:`LoadFailure` with a bounded ``reason``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from maru_core.keys import layer_key
from maru_core.pool.slot_check import SlotHeaderCheck

from maru_connector.transfer import ChunkLoad

logger = logging.getLogger(__name__)


class LoadFailure(Exception):
    """A load that cannot go ahead; ``reason`` is a metric label value."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class PinnedLoad:
    """Copies ready to submit, and the pinned object keys to unpin after them."""

    chunks: list[ChunkLoad]
    object_keys: list[bytes]


def object_keys(fmt: Any, chunk_keys: Sequence[bytes]) -> list[bytes]:
    """The keys of the objects of these chunks: chunk-major, then true layer."""
    if not fmt.layerwise:
        return list(chunk_keys)
    indices = fmt.layout.layer_indices
    return [layer_key(ck, layer) for ck in chunk_keys for layer in indices]


def _index_failure(exc: BaseException) -> LoadFailure:
    text = f"{type(exc).__name__}: {exc}"
    timed_out = isinstance(exc, TimeoutError) or "timed out" in text.lower() or "timeout" in text.lower()
    return LoadFailure("timeout" if timed_out else "index_error", text)


class _HeldPins:
    """Per index client (one lease), how many pins its loads in flight hold per key.

    The index counts pins per lease and key, so an unpin by a load that did
    not pin would take a pin another load of the same lease still copies
    under. Only keys no load in flight holds may be unpinned on a guess.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_client: weakref.WeakKeyDictionary[Any, Counter] = weakref.WeakKeyDictionary()

    def add(self, client: Any, keys: list[bytes]) -> None:
        with self._lock:
            self._by_client.setdefault(client, Counter()).update(keys)

    def remove(self, client: Any, keys: list[bytes]) -> None:
        with self._lock:
            held = self._by_client.get(client)
            if held is not None:
                held.subtract(keys)
                for key in set(keys):
                    if held[key] <= 0:
                        del held[key]

    def not_held(self, client: Any, keys: list[bytes]) -> list[bytes]:
        with self._lock:
            held = self._by_client.get(client, Counter())
            return [k for k in keys if k not in held]


_HELD = _HeldPins()


def _unpin_quietly(client: Any, keys: list[bytes]) -> None:
    try:
        client.unpin(keys)
    except Exception as exc:  # the lease releases the pins if this fails
        logger.warning("unpin of %d keys failed (%s); the lease will release them", len(keys), exc)


def _check_reply(keys: list[bytes], locations: list[Any], object_bytes: int) -> None:
    if len(locations) < len(keys):
        raise LoadFailure("short_reply", f"{len(locations)} locations for {len(keys)} keys")
    if len(locations) > len(keys):
        raise LoadFailure("long_reply", f"{len(locations)} locations for {len(keys)} keys")
    misses = sum(loc is None for loc in locations)
    if misses:
        raise LoadFailure("miss", f"{misses} of {len(keys)} objects are no longer in the pool")
    for loc in locations:
        if loc.length != object_bytes:
            raise LoadFailure(
                "header_mismatch", f"object of {loc.length} bytes where {object_bytes} expected"
            )


def _check_headers(
    pool: Any, keys: list[bytes], locations: list[Any], fmt: Any, verify_payload: bool
) -> None:
    # One vectorised pass over the whole batch (a layerwise 16k-token hit has
    # 2,048 objects: checked one by one they cost 11-24 ms of its TTFT); the
    # one-object check only words a failure.
    offsets = np.fromiter((loc.offset for loc in locations), dtype=np.int64, count=len(locations))
    generations = np.fromiter((loc.generation for loc in locations), dtype=np.uint64, count=len(locations))
    ok = SlotHeaderCheck(pool)(b"".join(keys), offsets, generations, layout=fmt.fingerprint)
    for i in np.flatnonzero(~ok)[:1]:
        _header_of(pool, keys[i], locations[i], fmt.fingerprint)
        raise LoadFailure(  # the slot changed between the two reads: not ours either way
            "header_mismatch", f"slot at offset {locations[i].offset} changed while it was checked"
        )
    if verify_payload:
        for key, loc in zip(keys, locations):
            header = _header_of(pool, key, loc, fmt.fingerprint)
            if not pool.payload_matches(loc.offset, header):
                what = "does not match its checksum" if header.checksum else "carries no checksum"
                raise LoadFailure(  # the metric label of every slot-header check
                    "header_mismatch", f"payload of key {key.hex()} at offset {loc.offset} {what}"
                )


def _header_of(pool: Any, key: bytes, loc: Any, layout: int) -> Any:
    """The slot header at ``loc`` if it names ``key``, its generation and ``layout``; else
    the ``LoadFailure`` that says why not."""
    header = pool.read_slot_header(loc.offset)
    if header is None or not header.names(key, loc.generation):
        raise LoadFailure(
            "header_mismatch",
            f"slot at offset {loc.offset} no longer holds key {key.hex()} generation {loc.generation}",
        )
    if header.layout != layout:
        # Same key, other byte arrangement: a writer whose worker detected another
        # KV layout (or an object written before layouts were recorded).
        raise LoadFailure(
            "header_mismatch",
            f"object of key {key.hex()} was written in layout {header.layout:#x}, this worker's is {layout:#x}",
        )
    return header


def resolve_load(
    client: Any,
    pool: Any,
    fmt: Any,
    chunk_keys: Sequence[bytes],
    block_ids: Sequence[tuple[int, ...]],
    verify_payload: bool = False,
) -> PinnedLoad:
    """Pin the objects of ``chunk_keys`` and plan their copies into ``block_ids``.

    With ``verify_payload`` (``MaruConfig.verify_payload``), every object's
    payload is checked against the checksum in its slot header, once pinned
    and before any copy: the request is released only over bytes the writer
    vouched for.

    Raises:
        LoadFailure: the index failed or timed out, the reply was short, long
            or had a miss, a slot header does not name its key and
            generation, or (``verify_payload``) a payload does not match its
            checksum. Nothing stays pinned in that case.
    """
    keys = object_keys(fmt, chunk_keys)
    try:
        # A failed retrieve leaves nothing pinned: the index client unpins what
        # a reply it rejects shows pinned (else lets that lease lapse), and a
        # timeout or lost connection makes it leave the lease to lapse.
        locations = list(client.retrieve(keys))
    except Exception as exc:
        raise _index_failure(exc) from exc
    try:
        _check_reply(keys, locations, fmt.object_bytes)
        _check_headers(pool, keys, locations, fmt, verify_payload)
    except LoadFailure:
        if None not in locations:  # every key hit, so this retrieve pinned every key
            _unpin_quietly(client, keys)
        else:
            # An index pins nothing when a key misses, but a reply altered on
            # the way may hide pins: give back those no other load holds.
            _unpin_quietly(client, _HELD.not_held(client, keys))
        raise
    per_chunk = fmt.objects_per_chunk
    chunks = [
        ChunkLoad(
            tuple(blocks),
            tuple(loc.offset for loc in locations[i * per_chunk : (i + 1) * per_chunk]),
        )
        for i, blocks in enumerate(block_ids)
    ]
    _HELD.add(client, keys)
    return PinnedLoad(chunks, keys)


def release_pins(client: Any, pinned: PinnedLoad) -> None:
    """Unpin after every copy from those slots completed (invariant 8)."""
    _HELD.remove(client, pinned.object_keys)
    _unpin_quietly(client, pinned.object_keys)
