"""The shared-memory pool: one ``mmap(MAP_SHARED)`` of a DAX device or a tmpfs file.

Layout: a 4 KiB header (``header``), a table of 64-byte slot headers, one per
page (``slots``), then the 2 MiB-aligned data area (``geometry``). A pool is
a whole file or a 2 MiB-aligned region of a device shared with other pools
(``region``).
"""

from maru_core.pool.device import Backing
from maru_core.pool.errors import (
    PoolCorrupt,
    PoolError,
    PoolExists,
    PoolForeign,
    PoolFormatError,
    PoolGeometryError,
    PoolNoSpace,
    PoolNotFound,
    PoolOffsetMismatch,
    PoolPermissionError,
    PoolRegionError,
    PoolSizeError,
    PoolSizeMismatch,
    PoolTooSmall,
    PoolVersionError,
)
from maru_core.pool.geometry import DEFAULT_PAGE_SIZE, PoolGeometry, check_region_offset
from maru_core.pool.header import PoolHeader
from maru_core.pool.pool import Pool
from maru_core.pool.slots import ChecksumKind, SlotFormat, SlotHeader, SlotState

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "Backing",
    "Pool",
    "ChecksumKind",
    "PoolCorrupt",
    "PoolError",
    "PoolExists",
    "PoolForeign",
    "PoolFormatError",
    "PoolGeometry",
    "PoolGeometryError",
    "PoolHeader",
    "PoolNoSpace",
    "PoolNotFound",
    "PoolOffsetMismatch",
    "PoolPermissionError",
    "PoolRegionError",
    "PoolSizeError",
    "PoolSizeMismatch",
    "PoolTooSmall",
    "PoolVersionError",
    "SlotFormat",
    "SlotHeader",
    "SlotState",
    "check_region_offset",
]
