"""Objects for the quota tests of real index processes: numbered keys, stored as a connector stores them."""

from __future__ import annotations

from maru_core.index.client import IndexClient
from maru_core.pool import Pool, SlotHeader

OBJECT = 64  # bytes: an object per page


def numbered(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def store(client: IndexClient, pool: Pool, keys: list[bytes], length: int = OBJECT) -> None:
    """Reserve, write each slot header (as a connector's store does), commit."""
    slots = list(client.reserve([(k, length) for k in keys]))
    assert None not in slots
    for k, slot in zip(keys, slots):
        pool.write_slot_header(slot.offset, SlotHeader(key=k, generation=slot.generation, length=length))
    assert client.commit(keys) == [True] * len(keys)
