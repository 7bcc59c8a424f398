"""The pool header at the pool's start: its binary form, and its validation on attach.

Little-endian, followed by a CRC32 of all the bytes before it:

```
magic 8s "MARUPOOL" | format version u32 | header bytes u32 | pool uuid 16s
total size u64 | page size u64 | page count u64 | table offset u64
data offset u64 | created-at f64 (unix seconds) | slot header bytes u32
creator host 64s (utf-8, zero padded) | region offset u64 | flags u32 | crc32 u32
```

The region offset is where the pool starts in its file or device (0 unless
the pool is one region of a shared device). Flag ``SPANS_FILE``: the pool is
a file made for it, so the file's size must stay the pool's size; without it
the pool is a region whose extent only its header gives.

Validation goes from the cheapest, most telling check to the most specific:
magic (is it a pool at all?), version (can this code read it?), CRC (is it
intact?), geometry (do the fields agree with each other?), then placement
(``check_placement``: is it the pool at this offset, of the size expected,
inside its file or device?).
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import time
import uuid as uuid_module
import zlib

from maru_core.pool.errors import (
    PoolCorrupt,
    PoolForeign,
    PoolGeometryError,
    PoolOffsetMismatch,
    PoolRegionError,
    PoolSizeMismatch,
    PoolVersionError,
)
from maru_core.pool.geometry import HEADER_REGION, SLOT_HEADER_BYTES, PoolGeometry

MAGIC = b"MARUPOOL"
FORMAT_VERSION = 2  # 2: region offset and flags
_BODY = struct.Struct("<8sII16sQQQQQdI64sQI")
# Format 1, still read (each release reads its format and the one before, so
# an index upgraded in place opens the pool the previous release made): no
# region offset and no flags; such a pool lies at offset 0, sized by its header.
_BODY_V1 = struct.Struct("<8sII16sQQQQQdI64s")
_BODIES = {1: _BODY_V1, FORMAT_VERSION: _BODY}
_CRC = struct.Struct("<I")
HEADER_BYTES = _BODY.size + _CRC.size
_CREATOR_BYTES = 64
#: Flag: the pool is its whole file (see the module docstring).
SPANS_FILE = 1
_KNOWN_FLAGS = SPANS_FILE


@dataclasses.dataclass(frozen=True)
class PoolHeader:
    """A pool's geometry, where it lies in its file or device, and when and on which host it was created.

    ``region_offset``: the byte of the file or device where the pool starts.
    ``spans_file``: the pool is the whole file made for it (else a region of
    a larger file or device, sized by its header alone).
    """

    geometry: PoolGeometry
    created_at: float
    creator: str
    region_offset: int = 0
    spans_file: bool = False
    version: int = FORMAT_VERSION

    @classmethod
    def new(cls, geometry: PoolGeometry, creator: str | None = None, *, region_offset: int = 0,
            spans_file: bool = False) -> "PoolHeader":  # fmt: skip
        return cls(geometry=geometry, created_at=time.time(), creator=creator or socket.gethostname(),
                   region_offset=region_offset, spans_file=spans_file)  # fmt: skip

    def pack(self) -> bytes:
        g = self.geometry
        creator = self.creator.encode("utf-8")[:_CREATOR_BYTES]
        body = _BODY.pack(
            MAGIC,
            self.version,
            HEADER_BYTES,
            uuid_module.UUID(g.uuid).bytes,
            g.size,
            g.page_size,
            g.num_pages,
            g.table_offset,
            g.data_offset,
            self.created_at,
            SLOT_HEADER_BYTES,
            creator,
            self.region_offset,
            SPANS_FILE if self.spans_file else 0,
        )
        return body + _CRC.pack(zlib.crc32(body))


def parse_header(data: bytes | memoryview, where: str) -> PoolHeader:
    """Validate and decode the header in ``data`` (the first ``HEADER_REGION``
    bytes of a pool); ``where`` names the pool in errors.

    Raises a ``PoolFormatError`` subclass that says what is wrong and what to
    do. Where the pool lies is checked by ``check_placement``.
    """
    raw = bytes(data[:HEADER_BYTES])
    if raw[:8] != MAGIC:
        if not any(data[:HEADER_REGION]):
            raise PoolForeign(f"{where} holds no pool (its header is all zeros): create the pool first")
        raise PoolForeign(
            f"{where} is not a MaruCache pool (magic {raw[:8]!r}, expected {MAGIC!r}): "
            "check the path and offset; to turn it into a pool, destroying its contents, create it with force"
        )
    version = int.from_bytes(raw[8:12], "little")
    layout = _BODIES.get(version)
    if layout is None:
        raise PoolVersionError(
            f"{where} is a pool of format version {version}; this MaruCache reads versions "
            f"{min(_BODIES)} to {FORMAT_VERSION}: run a MaruCache at most one release apart from the one "
            "that made it, or recreate the pool"
        )
    body, (crc,) = raw[: layout.size], _CRC.unpack(raw[layout.size : layout.size + _CRC.size])
    if zlib.crc32(body) != crc:
        raise PoolCorrupt(
            f"{where}: pool header CRC mismatch (stored {crc:#010x}, computed {zlib.crc32(body):#010x}); "
            "the header was overwritten: recreate the pool with force"
        )
    fields = layout.unpack(body) + ((0, 0) if layout is _BODY_V1 else ())  # format 1: offset 0, no flags
    (_, _, header_bytes, uuid_bytes, size, page_size, num_pages, table_offset, data_offset,
     created_at, slot_bytes, creator, region_offset, flags) = fields  # fmt: skip
    geometry = PoolGeometry(
        uuid=str(uuid_module.UUID(bytes=uuid_bytes)),
        size=size,
        page_size=page_size,
        num_pages=num_pages,
        table_offset=table_offset,
        data_offset=data_offset,
    )
    problem = geometry.inconsistency()
    if header_bytes != layout.size + _CRC.size or slot_bytes != SLOT_HEADER_BYTES:
        problem = f"header of {header_bytes} bytes with {slot_bytes}-byte slot headers"
    elif flags & ~_KNOWN_FLAGS:
        problem = f"unknown flags {flags:#x}"
    if problem:
        raise PoolGeometryError(f"{where}: inconsistent pool geometry: {problem}; recreate the pool")
    return PoolHeader(
        geometry=geometry,
        created_at=created_at,
        creator=creator.rstrip(b"\0").decode("utf-8", "replace"),
        region_offset=region_offset,
        spans_file=bool(flags & SPANS_FILE),
        version=version,
    )


def check_placement(header: PoolHeader, where: str, offset: int, backing_bytes: int,
                    expected_size: int | None) -> None:  # fmt: skip
    """Check that ``header``, read at ``offset`` of a file or device of
    ``backing_bytes``, is the pool expected there: created at this offset, of
    ``expected_size`` bytes (when given), and lying inside the file or device.

    A pool found at another offset than it was created at is refused, never
    reinterpreted. Raises ``PoolOffsetMismatch``, ``PoolSizeMismatch`` or
    ``PoolRegionError``.
    """
    size = header.geometry.size
    if header.region_offset != offset:
        raise PoolOffsetMismatch(
            f"{where}: the pool header at offset {offset} says the pool was created at offset "
            f"{header.region_offset}; it is not the pool of this region: attach it at offset "
            f"{header.region_offset} (--pool-offset), or recreate the pool at {offset} with force"
        )
    if expected_size is not None and size != expected_size:
        raise PoolSizeMismatch(
            f"{where}: the pool at offset {offset} is {size} bytes but {expected_size} were expected: "
            "point at the right pool or fix the expected size (--pool-size)"
        )
    if offset + size > backing_bytes:
        raise PoolRegionError(
            f"{where}: the pool header says {size} bytes from offset {offset}, but the file or device "
            f"ends at {backing_bytes}: it was truncated or the wrong device is named; recreate the pool"
        )
    if header.spans_file and size != backing_bytes:
        raise PoolSizeMismatch(
            f"{where}: the pool header says {size} bytes but the file has {backing_bytes}; "
            "it was resized after creation: restore its size or recreate the pool"
        )
