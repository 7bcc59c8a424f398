"""Which pool region a process maps, and whether an index serves that same region.

An index hands out byte offsets into its pool. A client that maps another
region (a cache moved or resized while the pod kept its old mapping, a pod
pointed at the index of another cache, a pool re-created under a running
pod) would read and write at those offsets in the wrong memory. Every
client therefore compares the pool its index serves (the ``pool`` map of the
``hello`` reply) with the pool it mapped, and refuses the index when they
differ.

What is compared: the pool's UUID, its size and its offset in the file or
device. The UUID is written fresh by every ``Pool.create``, so a pool
re-created at the same place, or a region of another cache on the same
device, differs in it; offset and size also tell apart two copies of one
header (a pool file copied, a region cloned). The path is *not* compared:
the index and a pod may mount the same device or tmpfs file under
different paths; it is reported in messages only.

An older index sends no ``pool`` map: its identity is taken from the
``geometry`` map every index sends (UUID and size) and its offset is
unknown, so only UUID and size are compared. A pool's UUID is what its
header records at its own offset, so an equal UUID already names the same
pool header; the offset check is defence in depth.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class PoolIdentity:
    """One pool region: ``uuid`` and ``size`` from its header, ``offset`` where
    it starts in ``path`` (``None``: not known, e.g. from an older index)."""

    uuid: str
    size: int
    offset: int | None = 0
    path: str | None = None

    @classmethod
    def of_pool(cls, pool: Any) -> "PoolIdentity":
        """The identity of a mapped ``maru_core.pool.Pool``."""
        return cls(pool.geometry.uuid, pool.geometry.size, pool.offset, pool.where)

    @classmethod
    def read(cls, path: str, offset: int = 0) -> "PoolIdentity":
        """The identity of the pool at ``offset`` of ``path``, read from its
        header without mapping the pool (raises a ``PoolError`` naming the problem)."""
        from maru_core.pool.device import SYSFS_ROOT, open_rw
        from maru_core.pool.region import locate

        fd = open_rw(path)
        try:
            header, _ = locate(fd, path, offset, None, SYSFS_ROOT)
        finally:
            os.close(fd)
        return cls(header.geometry.uuid, header.geometry.size, header.region_offset, path)

    def to_wire(self) -> dict[str, Any]:
        """The ``pool`` map of the index's ``hello`` reply."""
        return {"uuid": self.uuid, "size": self.size, "offset": self.offset, "path": self.path}

    @classmethod
    def from_hello(cls, reply: Mapping[str, Any]) -> "PoolIdentity":
        """The pool an index's ``hello`` reply says it serves; ``ValueError`` for a malformed one."""
        served = reply.get("pool")
        if served is None:  # an older index: its geometry still names the pool's UUID and size
            served = {**(reply.get("geometry") or {}), "offset": None, "path": None}
        if type(served) is not dict:
            raise ValueError("'pool' must be a map")
        uuid, size, offset, path = (served.get(k) for k in ("uuid", "size", "offset", "path"))
        if type(uuid) is not str or type(size) is not int or size <= 0:
            raise ValueError(f"pool uuid {uuid!r} and size {size!r} must be a string and a positive int")
        if offset is not None and (type(offset) is not int or offset < 0):
            raise ValueError(f"pool offset {offset!r} must be a non-negative int")
        return cls(uuid, size, offset, path if type(path) is str else None)

    def describe(self) -> str:
        where = "unknown offset" if self.offset is None else f"offset {self.offset}"
        return f"pool {self.uuid} ({self.size} bytes at {where} of {self.path or 'an unnamed file'})"

    def mismatch(self, served: "PoolIdentity") -> str | None:
        """Which of UUID, size and offset differ between this (mapped) pool and
        ``served``; ``None`` when it is the same region. An offset one side does
        not know is not compared; paths never are (see the module docstring)."""
        differ = [name for name in ("uuid", "size") if getattr(self, name) != getattr(served, name)]
        if self.offset is not None and served.offset is not None and self.offset != served.offset:
            differ.append("offset")
        return ", ".join(differ) or None
