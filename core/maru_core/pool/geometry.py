"""Pool geometry: where the header, the slot-header table and the data area lie.

Offsets are from the pool's start, which is the start of its mapping: byte 0
of its file, or the region offset of a pool that is one region of a device.

```
offset 0            pool header (HEADER_REGION bytes)
table_offset        slot-header table: one SLOT_HEADER_BYTES entry per page
data_offset         data area, DATA_ALIGN aligned: num_pages pages of page_size bytes
```

Default page size: 64 KiB. The slot table costs 64 bytes per page, 1/1024 of
the pool (1 GiB for a 1 TiB pool, 64 MiB for 64 GiB), and the index keeps no
per-page state (free space is a list of extents), so the page count of a TiB
pool costs nothing but that table. Objects are whole pages, so the page
bounds the waste per object; KV objects are products of powers of two (chunk
tokens x KV heads x head size x dtype bytes, times layers), and the smallest
realistic ones (a 256-token chunk of one layer of a model with 2 KV heads of
64 dims in bf16: 128 KiB; of an 8-KV-head, 128-dim model: 1 MiB) are whole
multiples of 64 KiB, so they waste nothing. Larger pages shrink the table but
would waste up to half of a small model's layerwise objects.
"""

from __future__ import annotations

import dataclasses
import uuid as uuid_module
from typing import Any

#: Bytes reserved for the pool header at the pool's start.
HEADER_REGION = 4096
#: Bytes of one slot header (one per page).
SLOT_HEADER_BYTES = 64
#: Alignment of the data area: device DAX maps in 2 MiB units.
DATA_ALIGN = 2 * 1024 * 1024
#: Default page size; see the module docstring for why.
DEFAULT_PAGE_SIZE = 64 * 1024
MIN_PAGE_SIZE = 4096
MAX_PAGE_SIZE = 1024 * 1024 * 1024


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def check_page_size(page_size: int) -> None:
    """Raise ``ValueError`` unless ``page_size`` is a power of two in [4 KiB, 1 GiB]."""
    if (
        type(page_size) is not int
        or page_size < MIN_PAGE_SIZE
        or page_size > MAX_PAGE_SIZE
        or page_size & (page_size - 1)
    ):
        raise ValueError(
            f"page_size must be a power of two between {MIN_PAGE_SIZE} and {MAX_PAGE_SIZE} bytes, "
            f"got {page_size!r}"
        )


def check_region_offset(offset: int) -> None:
    """Raise ``ValueError`` unless ``offset`` (where a pool starts in its file
    or device) is a non-negative multiple of ``DATA_ALIGN``.

    ``mmap`` maps only from page boundaries, and device DAX only from its
    2 MiB alignment; the data area, 2 MiB aligned within the pool, is 2 MiB
    aligned within the device only when the pool starts on such a boundary.
    """
    if type(offset) is not int or offset < 0:
        raise ValueError(f"a pool offset is a non-negative whole number of bytes, got {offset!r}")
    if offset % DATA_ALIGN:
        below = offset - offset % DATA_ALIGN
        raise ValueError(
            f"pool offset {offset} is not a multiple of 2 MiB ({DATA_ALIGN} bytes), which DAX devices "
            f"map in: start the region at {below} or {below + DATA_ALIGN}"
        )


def _data_offset(num_pages: int) -> int:
    return align_up(HEADER_REGION + num_pages * SLOT_HEADER_BYTES, DATA_ALIGN)


def pages_that_fit(size: int, page_size: int) -> int:
    """The most pages a pool of ``size`` bytes holds (0 when not even one fits)."""
    check_page_size(page_size)
    n = max(0, (size - HEADER_REGION) // (page_size + SLOT_HEADER_BYTES))
    # Aligning the data area can cost up to DATA_ALIGN bytes: give back pages until it fits.
    while n > 0 and _data_offset(n) + n * page_size > size:
        n -= 1
    return n


def min_pool_size(page_size: int) -> int:
    """The smallest pool size that holds one page."""
    return _data_offset(1) + page_size


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """The layout of one pool, as its header records it.

    ``uuid`` identifies the pool (a new one on every ``Pool.create``);
    ``size`` is the whole pool (its mapping) in bytes; objects occupy runs of
    ``page_size``-byte pages; page *p* starts at byte
    ``data_offset + p * page_size`` and its slot header at
    ``table_offset + p * SLOT_HEADER_BYTES``.
    """

    uuid: str
    size: int
    page_size: int
    num_pages: int
    table_offset: int
    data_offset: int

    @classmethod
    def plan(cls, size: int, page_size: int = DEFAULT_PAGE_SIZE, uuid: str | None = None) -> "PoolGeometry":
        """The geometry ``Pool.create`` gives a pool of ``size`` bytes.

        Raises ``ValueError`` for a bad page size and when not even one page fits.
        """
        num_pages = pages_that_fit(size, page_size)
        if num_pages < 1:
            raise ValueError(
                f"a pool of {size} bytes holds no page of {page_size} bytes; "
                f"make it at least {min_pool_size(page_size)} bytes"
            )
        return cls(
            uuid=uuid or str(uuid_module.uuid4()),
            size=size,
            page_size=page_size,
            num_pages=num_pages,
            table_offset=HEADER_REGION,
            data_offset=_data_offset(num_pages),
        )

    def inconsistency(self) -> str | None:
        """Why this geometry is not one ``plan`` makes, or ``None`` when it is."""
        try:
            check_page_size(self.page_size)
        except ValueError as exc:
            return str(exc)
        if self.table_offset != HEADER_REGION:
            return f"table_offset is {self.table_offset}, expected {HEADER_REGION}"
        if self.num_pages != pages_that_fit(self.size, self.page_size):
            return (
                f"num_pages is {self.num_pages}, but a pool of {self.size} bytes with "
                f"{self.page_size}-byte pages holds {pages_that_fit(self.size, self.page_size)}"
            )
        if self.data_offset != _data_offset(self.num_pages):
            return f"data_offset is {self.data_offset}, expected {_data_offset(self.num_pages)}"
        return None

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the data area: what objects can occupy."""
        return self.num_pages * self.page_size

    def pages_for(self, length: int) -> int:
        """Pages an object of ``length`` bytes occupies."""
        return -(-length // self.page_size)

    def page_offset(self, page: int) -> int:
        """Byte offset (from the start of the mapping) of page ``page``'s data."""
        return self.data_offset + page * self.page_size

    def page_index(self, offset: int) -> int:
        """The page whose data starts at ``offset``; ``ValueError`` for any other offset."""
        rel = offset - self.data_offset
        if type(offset) is not int or rel < 0 or rel % self.page_size or rel // self.page_size >= self.num_pages:
            raise ValueError(
                f"offset {offset!r} is not the start of a page: pages start at "
                f"{self.data_offset} + k * {self.page_size} for k < {self.num_pages}"
            )
        return rel // self.page_size

    def slot_header_offset(self, page: int) -> int:
        return self.table_offset + page * SLOT_HEADER_BYTES

    def to_dict(self) -> dict[str, Any]:
        """Plain fields (``uuid`` as a string), e.g. for the ``hello`` reply."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "PoolGeometry":
        """Inverse of ``to_dict``; ``ValueError`` naming a missing, extra or ill-typed field."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in fields]
        extra = [n for n in fields if n not in names]
        if missing or extra:
            raise ValueError(f"pool geometry fields: missing {missing}, unknown {extra}")
        for name in names:
            expected = str if name == "uuid" else int
            if type(fields[name]) is not expected:
                raise ValueError(f"pool geometry field {name!r} must be {expected.__name__}")
        return cls(**{n: fields[n] for n in names})
