"""Storing objects into a real index and pool the way a connector's store
does (reserve, clear the slot headers, copy, write the pending head with its
payload checksum), and reading them back as a reader checks them, for the
tests that crash, truncate or restart things in between."""

from __future__ import annotations

import numpy as np

from maru_core.index.client import IndexClient
from maru_core.pool import Pool, SlotHeader
from maru_core.pool.slot_check import SlotHeaderCheck

OBJECT_BYTES = 4096


def numbered_keys(tag: int, n: int) -> list[bytes]:
    """``n`` distinct 16-byte keys starting with the byte ``tag``."""
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def write_objects(client: IndexClient, pool: Pool, keys: list[bytes], seed: int) -> tuple[dict, dict]:
    """Reserve, copy and head every key (not committed); return (bytes, offset) by key."""
    slots = list(client.reserve([(k, OBJECT_BYTES) for k in keys]))
    assert None not in slots
    rng = np.random.default_rng(seed)
    payloads, offsets = {}, {}
    for key, slot in zip(keys, slots):
        pool.invalidate_slot(slot.offset, OBJECT_BYTES)
        payloads[key], offsets[key] = rng.bytes(OBJECT_BYTES), slot.offset
        pool.view(slot.offset, OBJECT_BYTES)[:] = payloads[key]
        checksum = pool.payload_checksum(slot.offset, OBJECT_BYTES)
        pool.write_slot_header(slot.offset, SlotHeader(key, slot.generation, OBJECT_BYTES, checksum=checksum))
    return payloads, offsets


def assert_served_exactly(client: IndexClient, pool: Pool, keys: list[bytes], payloads: dict) -> None:
    """Every key is served, its committed slot header passes a reader's check,
    and its bytes are the writer's; the pins go back."""
    found = client.retrieve(keys)
    assert found.misses() == 0
    offsets = np.array([loc.offset for loc in found], dtype=np.int64)
    generations = np.array([loc.generation for loc in found], dtype=np.uint64)
    assert SlotHeaderCheck(pool)(b"".join(keys), offsets, generations).all()
    for key, loc in zip(keys, found):
        assert bytes(pool.view(loc.offset, loc.length)) == payloads[key]
    client.unpin(keys)
