"""Where a pool lies in its file or device, and mapping exactly that region.

A pool is the region ``[offset, offset + size)`` of a regular file or a DAX
device; its header is at the region's start and its mapping covers only the
region, so two pools can share one device (the operator carves devices into
regions) without either mapping the other's bytes. The offset is a multiple
of 2 MiB (``geometry.check_region_offset``).

Before the whole region is mapped, its header is read through a small probe
mapping (at most 2 MiB, the unit device DAX maps in; a DAX device has no
``read``), so a pool whose size only its header knows can be attached.
"""

from __future__ import annotations

import mmap

from maru_core.pool.device import Backing, backing_size
from maru_core.pool.errors import PoolRegionError, PoolTooSmall
from maru_core.pool.geometry import DATA_ALIGN, HEADER_REGION
from maru_core.pool.header import PoolHeader, check_placement, parse_header


def map_region(fd: int, offset: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` from ``offset`` (a multiple of the page size), shared and writable."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)


def check_region(where: str, offset: int, size: int, backing_bytes: int, backing: Backing) -> None:
    """Raise ``PoolRegionError`` unless ``size`` bytes from ``offset`` lie inside
    the file or device of ``backing_bytes`` (and, on DAX, are whole 2 MiB units)."""
    if offset >= backing_bytes:
        raise PoolRegionError(
            f"offset {offset} is past the end of {where} ({backing_bytes} bytes): check the pool offset"
        )
    if offset + size > backing_bytes:
        raise PoolRegionError(
            f"{where} has {backing_bytes} bytes: a pool of {size} bytes from offset {offset} would end at "
            f"{offset + size}, past its end: make the pool smaller or start it earlier"
        )
    if backing is Backing.DAX and size % DATA_ALIGN:
        raise PoolRegionError(
            f"a pool of {size} bytes on the DAX device {where} is not a whole number of 2 MiB units, "
            f"which the device maps in: make its size a multiple of {DATA_ALIGN} bytes"
        )


def read_header_at(fd: int, where: str, offset: int, backing_bytes: int) -> PoolHeader:
    """Validate and decode the pool header at ``offset`` of ``fd`` without mapping the whole region."""
    room = backing_bytes - offset
    if room < HEADER_REGION:
        if offset == 0:
            raise PoolTooSmall(f"{where} is {backing_bytes} bytes, too small to hold a pool header; it is not a pool")
        raise PoolRegionError(
            f"offset {offset} leaves {max(room, 0)} of the {backing_bytes} bytes of {where}, no room for a "
            "pool header: check the pool offset"
        )
    probe = map_region(fd, offset, min(room, DATA_ALIGN))
    try:
        return parse_header(probe[:HEADER_REGION], where)
    finally:
        probe.close()


def locate(fd: int, where: str, offset: int, expected_size: int | None, sysfs_root: str) -> tuple[PoolHeader, Backing]:
    """The validated header of the pool at ``offset`` of ``fd``, and what backs it.

    The header must record this offset, the size must be ``expected_size``
    when given, and the pool must lie inside the file or device
    (``header.check_placement``).
    """
    backing_bytes, backing = backing_size(fd, where, sysfs_root)
    header = read_header_at(fd, where, offset, backing_bytes)
    check_placement(header, where, offset, backing_bytes, expected_size)
    return header, backing
