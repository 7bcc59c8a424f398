"""Slot headers: one 64-byte entry per page, naming the object stored there.

An object occupies a run of pages. The entry of its first page is the
*head*: it names the object's key, generation, length and format. The
entries of its other pages are *continuations*, byte-for-byte copies of the
head except for the state (and so the CRC). An object is intact only when its
head and every continuation are in place, so an object whose pages a later
object took over (its head or one of its continuations overwritten) is never
resurrected when the index rebuilds itself from the table.

A head is in one of two states. A writer writes it *pending* (state 1:
written, not committed) once its copy completed. The index alone turns it
*committed* (state 3), in its own mapping of the pool, while it commits the
key and before it acknowledges the commit. A head is no commit record until
then: an aborted, dropped or lapsed object, or one whose writer died before
its commit, stays pending. Only committed heads are rebuilt by a restarted
index and accepted by a reader after pinning. The continuations never
change: they are the head's copy with state 2 whichever state the head is in.

Entries of MaruCache releases before commit records wrote their heads in
state 1 before the index's commit, the state that now reads *pending*: such
an object is never restored (whether it was committed cannot be told), and
a reader refuses it. The index still commits a key whose head such a writer
wrote (it checks a pending head); it marks the head committed.

Entry layout (little-endian), CRC32 over the first 60 bytes:

```
magic 4s "MSLT" | state u8 | format u8 | checksum kind u8 | reserved u8 | key 16s
generation u64 | length u64 | page count u32 | payload checksum u64 | layout u64 | crc32 u32
```

The payload checksum (``maru_core.pool.checksum``) covers the object's bytes;
its kind says which function: 2, the position-weighted sum that writers
record now (any value, 0 included); 1, XXH3-64 (older writers; never 0); 0,
none recorded (entries written before checksums existed read that way: the
bytes were reserved zeros). An unknown kind makes the entry invalid.
``layout`` is the writer's fingerprint of how the bytes are arranged (the
KV layout its worker detected, ``ObjectFormat.fingerprint``); 0: none. A
reader uses an object only when it names the reader's own layout.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib

from maru_core.keys import KEY_BYTES
from maru_core.pool.geometry import SLOT_HEADER_BYTES

SLOT_MAGIC = b"MSLT"
_BODY = struct.Struct("<4sBBBx16sQQIQQ")
_CRC = struct.Struct("<I")
if _BODY.size + _CRC.size != SLOT_HEADER_BYTES:  # pragma: no cover - a layout edit gone wrong
    raise ImportError("slot header entry is not SLOT_HEADER_BYTES long")
_U64_MAX = 2**64 - 1
_U32_MAX = 2**32 - 1


class SlotState(enum.IntEnum):
    """The state byte of a table entry (see the module docstring)."""

    EMPTY = 0
    PENDING = 1  # a head written, not committed (before commit records: every head)
    CONTINUATION = 2
    COMMITTED = 3  # a head whose commit the index recorded


#: The states of a head entry.
HEAD_STATES = (SlotState.PENDING, SlotState.COMMITTED)


class ChecksumKind(enum.IntEnum):
    """Which payload checksum a header carries."""

    NONE = 0
    XXH3_64 = 1  # older writers: XXH3-64 of the payload as it lay in the pool
    POSITION_SUM = 2  # sum_j (j+1) * w_j mod 2**64 over the payload's 32-bit words


#: The kind writers record now.
CURRENT_CHECKSUM_KIND = ChecksumKind.POSITION_SUM


def checksum_value_valid(kind: int, checksum: int) -> bool:
    """Whether ``checksum`` is a value a header of ``kind`` may carry."""
    if kind == ChecksumKind.NONE:
        return checksum == 0
    if kind == ChecksumKind.XXH3_64:
        return 0 < checksum <= _U64_MAX
    return kind == ChecksumKind.POSITION_SUM and 0 <= checksum <= _U64_MAX


class SlotFormat(enum.IntEnum):
    """How the object's bytes are grouped (see ``maru_core.keys.FORMATS``)."""

    UNSPECIFIED = 0
    CHUNKWISE = 1
    LAYERWISE = 2


@dataclasses.dataclass(frozen=True, slots=True)
class SlotHeader:
    """What a slot holds: the object's ``key``, the ``generation`` the index
    gave its slot, its ``length`` in bytes, its ``fmt``, the ``checksum`` of
    its payload (``None``: not recorded) of kind ``checksum_kind`` (the
    current kind unless given; ``NONE`` when ``checksum`` is None) and the
    ``layout`` fingerprint of its bytes' arrangement (0: not recorded)."""

    key: bytes
    generation: int
    length: int
    fmt: SlotFormat = SlotFormat.UNSPECIFIED
    checksum: int | None = None
    layout: int = 0
    checksum_kind: ChecksumKind = CURRENT_CHECKSUM_KIND

    def __post_init__(self) -> None:
        if type(self.key) is not bytes or len(self.key) != KEY_BYTES:
            raise ValueError(f"SlotHeader.key must be {KEY_BYTES} bytes, got {self.key!r}")
        if type(self.generation) is not int or not 0 < self.generation <= _U64_MAX:
            raise ValueError(f"SlotHeader.generation must be an int in [1, 2**64), got {self.generation!r}")
        if type(self.length) is not int or not 0 < self.length <= _U64_MAX:
            raise ValueError(f"SlotHeader.length must be a positive int, got {self.length!r}")
        object.__setattr__(self, "fmt", SlotFormat(self.fmt))
        kind = ChecksumKind(self.checksum_kind)
        if self.checksum is None or kind == ChecksumKind.NONE:
            kind = ChecksumKind.NONE if self.checksum is None else CURRENT_CHECKSUM_KIND
        object.__setattr__(self, "checksum_kind", kind)
        if self.checksum is not None and (type(self.checksum) is not int
                                          or not checksum_value_valid(kind, self.checksum)):
            raise ValueError(f"SlotHeader.checksum must be None or a valid {kind.name} value, got {self.checksum!r}")
        if type(self.layout) is not int or not 0 <= self.layout <= _U64_MAX:
            raise ValueError(f"SlotHeader.layout must be an int in [0, 2**64), got {self.layout!r}")

    def names(self, key: bytes, generation: int) -> bool:
        """Whether this header names ``key`` at ``generation`` (a reader's check after pinning)."""
        return self.key == key and self.generation == generation


def pack_entry(header: SlotHeader, state: SlotState, page_count: int) -> bytes:
    """One table entry for ``header`` in ``state``."""
    if not 0 < page_count <= _U32_MAX:
        raise ValueError(f"an object spans 1 to 2**32-1 pages, not {page_count}")
    kind = header.checksum_kind
    body = _BODY.pack(SLOT_MAGIC, state, header.fmt, kind, header.key, header.generation, header.length,
                      page_count, header.checksum or 0, header.layout)  # fmt: skip
    return body + _CRC.pack(zlib.crc32(body))


def unpack_head(entry: bytes | memoryview, page_size: int,
                state: SlotState = SlotState.COMMITTED) -> tuple[SlotHeader, int] | None:  # fmt: skip
    """``(header, page_count)`` of a valid head entry in ``state``, else ``None``.

    Invalid: wrong magic, bad CRC, another state, or a page count that does
    not match the length.
    """
    if state not in HEAD_STATES:
        raise ValueError(f"a head entry is pending or committed, not {state!r}")
    entry = bytes(entry)
    if entry[:4] != SLOT_MAGIC or entry[4] != state:
        return None
    body = entry[: _BODY.size]
    if zlib.crc32(body) != _CRC.unpack_from(entry, _BODY.size)[0]:
        return None
    _, _, fmt, kind, key, generation, length, page_count, checksum, layout = _BODY.unpack(body)
    if generation == 0 or length == 0 or page_count != -(-length // page_size) or fmt not in SlotFormat._value2member_map_:
        return None
    if not checksum_value_valid(kind, checksum):
        return None
    header = SlotHeader(key=key, generation=generation, length=length, fmt=SlotFormat(fmt),
                        checksum=None if kind == ChecksumKind.NONE else checksum, layout=layout,
                        checksum_kind=ChecksumKind(kind))  # fmt: skip
    return header, page_count


def with_state(entry: bytes, state: SlotState) -> bytes:
    """``entry`` with its state byte set to ``state`` and its CRC made anew."""
    body = bytearray(entry[: _BODY.size])
    body[4] = state
    return bytes(body) + _CRC.pack(zlib.crc32(body))


def continuation_of(head_entry: bytes) -> bytes:
    """The continuation entry that goes with ``head_entry`` (pending or committed: the same)."""
    return with_state(head_entry, SlotState.CONTINUATION)
