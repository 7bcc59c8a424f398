"""The pool header at offset 0: its binary form, and its validation on attach.

Little-endian, followed by a CRC32 of all the bytes before it:

```
magic 8s "MARUPOOL" | format version u32 | header bytes u32 | pool uuid 16s
total size u64 | page size u64 | page count u64 | table offset u64
data offset u64 | created-at f64 (unix seconds) | slot header bytes u32
creator host 64s (utf-8, zero padded) | crc32 u32
```

Validation goes from the cheapest, most telling check to the most specific:
magic (is it a pool at all?), version (can this code read it?), CRC (is it
intact?), then geometry (do the fields agree with each other and with the
size of the file or device?).
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
    PoolSizeMismatch,
    PoolTooSmall,
    PoolVersionError,
)
from maru_core.pool.geometry import HEADER_REGION, SLOT_HEADER_BYTES, PoolGeometry

MAGIC = b"MARUPOOL"
FORMAT_VERSION = 1
_BODY = struct.Struct("<8sII16sQQQQQdI64s")
_CRC = struct.Struct("<I")
HEADER_BYTES = _BODY.size + _CRC.size
_CREATOR_BYTES = 64


@dataclasses.dataclass(frozen=True)
class PoolHeader:
    """A pool's geometry plus when and on which host it was created."""

    geometry: PoolGeometry
    created_at: float
    creator: str
    version: int = FORMAT_VERSION

    @classmethod
    def new(cls, geometry: PoolGeometry, creator: str | None = None) -> "PoolHeader":
        return cls(geometry=geometry, created_at=time.time(), creator=creator or socket.gethostname())

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
        )
        return body + _CRC.pack(zlib.crc32(body))


def parse_header(data: bytes | memoryview, actual_size: int, where: str) -> PoolHeader:
    """Validate and decode the header in ``data`` (the first bytes of a pool).

    ``actual_size`` is the size of the file or device; ``where`` names it in
    errors. Raises a ``PoolFormatError`` or ``PoolSizeError`` subclass that
    says what is wrong and what to do.
    """
    if actual_size < HEADER_REGION:
        raise PoolTooSmall(f"{where} is {actual_size} bytes, too small to hold a pool header; it is not a pool")
    raw = bytes(data[:HEADER_BYTES])
    if raw[:8] != MAGIC:
        if not any(data[:HEADER_REGION]):
            raise PoolForeign(f"{where} holds no pool (its header is all zeros): create the pool first")
        raise PoolForeign(
            f"{where} is not a MaruCache pool (magic {raw[:8]!r}, expected {MAGIC!r}): "
            "check the path; to turn it into a pool, destroying its contents, create it with force"
        )
    version = int.from_bytes(raw[8:12], "little")
    if version != FORMAT_VERSION:
        raise PoolVersionError(
            f"{where} is a pool of format version {version}; this MaruCache reads version "
            f"{FORMAT_VERSION}: run a matching MaruCache, or recreate the pool"
        )
    body, (crc,) = raw[: _BODY.size], _CRC.unpack(raw[_BODY.size :])
    if zlib.crc32(body) != crc:
        raise PoolCorrupt(
            f"{where}: pool header CRC mismatch (stored {crc:#010x}, computed {zlib.crc32(body):#010x}); "
            "the header was overwritten: recreate the pool with force"
        )
    fields = _BODY.unpack(body)
    (_, _, header_bytes, uuid_bytes, size, page_size, num_pages, table_offset, data_offset,
     created_at, slot_bytes, creator) = fields  # fmt: skip
    geometry = PoolGeometry(
        uuid=str(uuid_module.UUID(bytes=uuid_bytes)),
        size=size,
        page_size=page_size,
        num_pages=num_pages,
        table_offset=table_offset,
        data_offset=data_offset,
    )
    problem = geometry.inconsistency()
    if header_bytes != HEADER_BYTES or slot_bytes != SLOT_HEADER_BYTES:
        problem = f"header of {header_bytes} bytes with {slot_bytes}-byte slot headers"
    if problem:
        raise PoolGeometryError(f"{where}: inconsistent pool geometry: {problem}; recreate the pool")
    if size != actual_size:
        raise PoolSizeMismatch(
            f"{where}: the pool header says {size} bytes but the file or device has {actual_size}; "
            "it was resized after creation: restore its size or recreate the pool"
        )
    return PoolHeader(
        geometry=geometry,
        created_at=created_at,
        creator=creator.rstrip(b"\0").decode("utf-8", "replace"),
        version=version,
    )
