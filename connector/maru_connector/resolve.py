"""Resolve a load: pin every object, check the reply and the slot headers.

Used by the synchronous load path and by the async loader alike. Nothing here
touches a vLLM block: a load only starts copying once :func:`resolve_load`
has returned, that is once every (chunk, layer) key resolved to a pinned slot
whose header names that key and generation (and, when asked, records a
payload checksum, which the transfer engine then checks over the bytes it
received). Any failure unpins what was
pinned (never a pin another load of the same lease holds) and raises
:class:`LoadFailure` with a bounded ``reason``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union, cast

import numpy as np
from maru_core.index.api import IndexApi
from maru_core.keys import KEY_BYTES, split_keys
from maru_core.pool.slot_check import SlotHeaderCheck
from maru_core.pool.slots import ChecksumKind, SlotHeader, SlotState
from maru_core.protocol import Location, LocationList

from maru_connector.held_pins import (  # LoadFailure and hold are imported from here too
    _HELD,
    LoadFailure,
    hold,
    index_failure,
    unpin_hidden,
    unpin_quietly,
)
from maru_connector.log import get_logger
from maru_connector.transfer import ChecksumMismatch, ChunkLoad, PayloadCheck

if TYPE_CHECKING:
    from maru_core.pool import Pool

    from maru_connector.early_pins import EarlyPin
    from maru_connector.object_format import ObjectFormat
    from maru_connector.transfer.engine import HeadStart

#: A retrieve's answer as the index client gives it (a ``LocationList``), or as
#: tests build it: one ``Location`` or ``None`` per key.
Locations = Union[LocationList, Sequence[Union[Location, None]]]

logger = get_logger(__name__)


@dataclass(frozen=True)
class PinnedLoad:
    """Copies ready to submit, and the pinned object keys to unpin after them
    (packed end to end, as the index takes them). ``early``: the lookup's
    early pin these copies read under (it unpins instead; ``early_pins.py``)."""

    chunks: list[ChunkLoad]
    object_keys: bytes
    early: EarlyPin | None = None
    check: PayloadCheck | None = None  # what the copies' bytes are verified against

    @property
    def num_objects(self) -> int:
        return len(self.object_keys) // KEY_BYTES

    @property
    def head(self) -> HeadStart | None:
        """The head start of these copies (``TransferEngine.start_head``), if any."""
        return self.early.head if self.early is not None else None


def packed_object_keys(fmt: ObjectFormat, chunk_keys: Sequence[bytes]) -> bytes:
    """The keys of the objects of these chunks, end to end: chunk-major, then
    true layer. Packed, a load's keys cost no object per key on their way to
    the index (a layerwise 16k-token hit has 2,048)."""
    return fmt.strategy.object_keys(chunk_keys, fmt.layout.layer_indices)


def object_keys(fmt: ObjectFormat, chunk_keys: Sequence[bytes]) -> list[bytes]:
    """``packed_object_keys`` as a list of keys."""
    return cast("list[bytes]", split_keys(packed_object_keys(fmt, chunk_keys)))


def copy_failure_reason(error: BaseException | None) -> str:
    """The metric label of a load whose copies failed: a payload that did not match
    its checksum counts with the other slot checks (``header_mismatch``)."""
    return "header_mismatch" if isinstance(error, ChecksumMismatch) else "copy_error"


@dataclass(frozen=True)
class _Reply:
    """A retrieve's answer as columns (numpy ``uint64``; offset 0: a miss).

    A layerwise 16k-token hit answers 2,048 locations; reading them as
    columns spares building a tuple per object (``LocationList`` keeps them
    packed). Any other sequence of ``Location | None`` is read item by item.
    """

    offsets: np.ndarray
    lengths: np.ndarray
    generations: np.ndarray

    @classmethod
    def of(cls, locations: Locations) -> "_Reply":
        if isinstance(locations, LocationList):
            columns = (locations.offsets(), locations.lengths(), locations.generations())
            return cls(*(np.frombuffer(c, dtype=np.uint64) for c in columns))
        rows = [(0, 0, 0) if loc is None else (loc.offset, loc.length, loc.generation) for loc in locations]
        table = np.array(rows, dtype=np.uint64).reshape(-1, 3)
        return cls(table[:, 0], table[:, 1], table[:, 2])

    def __len__(self) -> int:
        return len(self.offsets)

    def misses(self) -> int:
        return int(np.count_nonzero(self.offsets == 0))


def misses_in(locations: Locations) -> int:
    """Keys a retrieve reply answered as not in the pool."""
    return _Reply.of(locations).misses()


def _check_reply(count: int, reply: _Reply, object_bytes: int) -> None:
    if len(reply) < count:
        raise LoadFailure("short_reply", f"{len(reply)} locations for {count} keys")
    if len(reply) > count:
        raise LoadFailure("long_reply", f"{len(reply)} locations for {count} keys")
    misses = reply.misses()
    if misses:
        raise LoadFailure("miss", f"{misses} of {count} objects are no longer in the pool")
    wrong = np.flatnonzero(reply.lengths != object_bytes)
    if wrong.size:
        raise LoadFailure(
            "header_mismatch", f"object of {reply.lengths[wrong[0]]} bytes where {object_bytes} expected"
        )


def _check_headers(
    pool: Pool, keys: bytes, reply: _Reply, fmt: ObjectFormat, verify_payload: bool
) -> PayloadCheck | None:
    """Check every slot header; with ``verify_payload``, what the transfer engine
    is to check the bytes it receives against (``PayloadCheck``)."""
    # One vectorised pass over the whole batch (a layerwise 16k-token hit has
    # 2,048 objects: checked one by one they cost 11-24 ms of its TTFT); the
    # one-object check only words a failure.
    offsets = reply.offsets.astype(np.int64)
    check = SlotHeaderCheck(pool)
    _fail_first(pool, keys, reply, offsets, check(keys, offsets, reply.generations, layout=fmt.fingerprint), fmt)
    if not verify_payload:
        return None
    stored, kinds = check.stored_checksums_and_kinds(offsets)
    for i in np.flatnonzero(kinds == ChecksumKind.NONE)[:1]:
        _fail_payload(keys, offsets, i, "carries no checksum")
    older = np.flatnonzero(kinds == ChecksumKind.XXH3_64)
    if older.size:
        _check_older_payloads(pool, keys, reply, offsets, older, stored, fmt, check)
    return PayloadCheck.of(stored, kinds == ChecksumKind.POSITION_SUM)


def _check_older_payloads(pool: Pool, keys: bytes, reply: _Reply, offsets: np.ndarray, older: np.ndarray,
                          stored: np.ndarray, fmt: ObjectFormat, check: SlotHeaderCheck) -> None:
    """Objects of older writers (XXH3-64 of the bytes as they lay in the pool) are
    checked the old way: hashed in the pool, once pinned and before any copy."""
    try:
        found = pool.payload_checksums(offsets[older].tolist(), fmt.object_bytes, kind=ChecksumKind.XXH3_64)
    except ImportError as exc:  # xxhash is not installed here
        _fail_payload(keys, offsets, int(older[0]), f"carries an XXH3 checksum, which cannot be checked here ({exc})")
    # The headers again, after the hashing, as one batch: the payloads were
    # hashed under the headers checked here (pinned, they cannot change; a
    # slot that did is refused all the same).
    _fail_first(pool, keys, reply, offsets, check(keys, offsets, reply.generations, layout=fmt.fingerprint), fmt)
    for j in np.flatnonzero(stored[older] != np.asarray(found, dtype=np.uint64))[:1]:
        _fail_payload(keys, offsets, int(older[j]), "does not match its checksum")


def _fail_payload(keys: bytes, offsets: np.ndarray, i: int, what: str) -> None:
    key = keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
    raise LoadFailure(  # the metric label of every slot-header check
        "header_mismatch", f"payload of key {key.hex()} at offset {offsets[i]} {what}"
    )


def _fail_first(
    pool: Pool, keys: bytes, reply: _Reply, offsets: np.ndarray, ok: np.ndarray, fmt: ObjectFormat
) -> None:
    """Raise the ``LoadFailure`` of the first object whose header the batch check refused
    (the one-object check words why)."""
    for i in np.flatnonzero(~ok)[:1]:
        key = keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
        _header_of(pool, key, int(offsets[i]), int(reply.generations[i]), fmt.fingerprint)
        raise LoadFailure(  # the slot changed between the two reads: not ours either way
            "header_mismatch", f"slot at offset {offsets[i]} changed while it was checked"
        )


def _header_of(pool: Pool, key: bytes, offset: int, generation: int, layout: int) -> SlotHeader:
    """The slot header at ``offset`` if it names ``key``, ``generation`` and ``layout``;
    else the ``LoadFailure`` that says why not."""
    header = pool.read_slot_header(offset)
    if header is None:
        pending = pool.read_slot_header(offset, SlotState.PENDING)
        if pending is not None and pending.names(key, generation):
            raise LoadFailure(
                "header_mismatch",
                f"slot at offset {offset} holds key {key.hex()} but its header records no commit "
                "(an index older than this connector records none: upgrade the index)",
            )
    if header is None or not header.names(key, generation):
        raise LoadFailure(
            "header_mismatch",
            f"slot at offset {offset} no longer holds key {key.hex()} generation {generation}",
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
    client: IndexApi,
    pool: Pool,
    fmt: ObjectFormat,
    chunk_keys: Sequence[bytes],
    block_ids: Sequence[tuple[int, ...]],
    verify_payload: bool = False,
    early: EarlyPin | None = None,
) -> PinnedLoad:
    """Pin the objects of ``chunk_keys`` and plan their copies into ``block_ids``.

    With ``verify_payload`` (``MaruConfig.verify_payload``), an object whose
    header records no checksum fails here; the returned ``check`` holds the
    checksum each header records, for the transfer engine to verify the
    bytes it receives (``submit_load(..., check=pinned.check)``) before any
    layer is used (``transfer/checks.py``). Objects of older writers
    (XXH3-64) are hashed in the pool here, once pinned and before any copy.

    ``early``: the request's :class:`~maru_connector.early_pins.EarlyPin`,
    now the caller's. When it covers these objects its pins are used (checked
    exactly as a retrieve's) and no retrieve is sent; otherwise it is released
    and ``client`` retrieves.

    Raises:
        LoadFailure: the index failed or timed out, the reply was short, long
            or had a miss, a slot header does not name its key and
            generation, or (``verify_payload``) a header records no checksum
            or an older writer's payload does not match its XXH3 checksum.
            Nothing stays pinned in that case.
    """
    keys = packed_object_keys(fmt, chunk_keys)
    if early is not None:
        reply = _early_reply(early, keys, client.timeout_s, fmt.object_bytes)
        if reply is not None:
            try:
                check = _check_headers(pool, keys, reply, fmt, verify_payload)
            except LoadFailure:
                early.release()
                raise
            return PinnedLoad(_plan(reply, block_ids, fmt.objects_per_chunk), keys, early=early, check=check)
    try:
        # A failed retrieve leaves nothing pinned: the index client unpins what
        # a reply it rejects shows pinned (else lets that lease lapse), and a
        # timeout or lost connection makes it leave the lease to lapse.
        reply = _Reply.of(client.retrieve(keys))
    except Exception as exc:
        raise index_failure(exc) from exc
    try:
        _check_reply(len(keys) // KEY_BYTES, reply, fmt.object_bytes)
        check = _check_headers(pool, keys, reply, fmt, verify_payload)
    except LoadFailure:
        if not reply.misses():  # every key hit, so this retrieve pinned every key
            unpin_quietly(client, keys)
        else:
            unpin_hidden(client, keys)
        raise
    pinned = PinnedLoad(_plan(reply, block_ids, fmt.objects_per_chunk), keys, check=check)
    hold(client, pinned)
    return pinned


def _early_reply(early: EarlyPin, keys: bytes, timeout_s: float, object_bytes: int) -> _Reply | None:
    """The early pin's reply for ``keys`` (its leading objects), checked like a
    retrieve's; ``None`` (and the pin released) when it was pinned from
    another first chunk than the load's."""
    if not early.object_keys.startswith(keys):
        early.release()  # pinned from another first chunk than the load's
        return None
    try:
        answer = early.reply(timeout_s)
    except LoadFailure:
        early.release()  # unpins once the retrieve is back, if it pinned
        raise
    reply = _Reply.of(answer)
    try:
        _check_reply(len(early.object_keys) // KEY_BYTES, reply, object_bytes)
    except LoadFailure:
        early.release()
        raise
    n = len(keys) // KEY_BYTES
    return _Reply(reply.offsets[:n], reply.lengths[:n], reply.generations[:n])


def _plan(reply: _Reply, block_ids: Sequence[tuple[int, ...]], per_chunk: int) -> list[ChunkLoad]:
    sources = _chunk_sources(reply, len(block_ids), per_chunk)
    return [ChunkLoad(tuple(blocks), src) for blocks, src in zip(block_ids, sources)]


def _chunk_sources(reply: _Reply, num_chunks: int, per_chunk: int) -> list[tuple[int, ...]]:
    offsets = reply.offsets[: num_chunks * per_chunk].tolist()
    return [tuple(offsets[i * per_chunk : (i + 1) * per_chunk]) for i in range(num_chunks)]


def head_sources(locations: Locations, num_chunks: int, per_chunk: int) -> list[tuple[int, ...]] | None:
    """The pool offsets of the first ``num_chunks`` chunks' objects in a
    retrieve reply, per chunk, exactly as the load's ``ChunkLoad``s will
    carry them; ``None`` when the reply is short or has a miss among them
    (the load will fail its checks; nothing to start)."""
    reply = _Reply.of(locations)
    count = num_chunks * per_chunk
    if num_chunks <= 0 or len(reply) < count or np.count_nonzero(reply.offsets[:count] == 0):
        return None
    return _chunk_sources(reply, num_chunks, per_chunk)


def release_pins(client: IndexApi | None, pinned: PinnedLoad) -> None:
    """Unpin after every copy from those slots completed (invariant 8); early
    pins go back through their own lookup client, others through ``client``."""
    if pinned.early is not None:
        pinned.early.release()
        return
    if client is None:
        raise AssertionError("pins taken by a retrieve without the client that took them")
    _HELD.remove(client, pinned)
    unpin_quietly(client, pinned.object_keys)
