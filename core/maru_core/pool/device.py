"""Opening what backs a pool: a DAX character device or a regular file.

A DAX device (``/dev/daxX.Y``) has no file size: its size is read from sysfs,
``/sys/dev/char/MAJ:MIN/size`` (or the ``size`` attribute of the device's
parent). It supports ``mmap`` only (no ``read``/``write``), and only of the
whole device, so a pool on it spans the whole device. A regular file (tmpfs
under ``/dev/shm``) has its own size.
"""

from __future__ import annotations

import enum
import os
import stat

from maru_core.pool.errors import PoolError, PoolForeign, PoolNotFound, PoolPermissionError

SYSFS_ROOT = "/sys"


class Backing(str, enum.Enum):
    FILE = "file"
    DAX = "dax"


def open_rw(path: str) -> int:
    """Open ``path`` read-write (never creating it) and return the descriptor."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PoolNotFound(
            f"no pool at {path}: check the path, or create the pool (Pool.create) first"
        ) from None
    except IsADirectoryError:
        raise PoolNotFound(f"{path} is a directory; a pool is a file or a DAX device") from None
    except PermissionError:
        raise PoolPermissionError(
            f"no permission to open {path} read-write (uid {os.getuid()}): give this user "
            "read-write access to it (chmod/chown, or the device's group), or receive the "
            "pool's descriptor from the sidecar"
        ) from None


def char_device_size(rdev: int, where: str, sysfs_root: str = SYSFS_ROOT) -> int:
    """Size in bytes of the character device ``rdev`` from sysfs."""
    base = os.path.join(sysfs_root, "dev", "char", f"{os.major(rdev)}:{os.minor(rdev)}")
    candidates = [os.path.join(base, "size"), os.path.join(base, "device", "size"), os.path.join(base, "..", "size")]
    for candidate in candidates:
        try:
            with open(candidate, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        try:
            size = int(text, 0)
        except ValueError:
            raise PoolError(f"{where}: {candidate} holds {text!r}, not a size in bytes") from None
        if size > 0:
            return size
    raise PoolForeign(
        f"{where} is a character device without a size in sysfs (looked in {', '.join(candidates)}); "
        "a pool needs a DAX device (/dev/daxX.Y) or a regular file"
    )


def backing_size(fd: int, where: str, sysfs_root: str = SYSFS_ROOT) -> tuple[int, Backing]:
    """``(size, backing)`` of the open file or device ``fd``."""
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode):
        return st.st_size, Backing.FILE
    if stat.S_ISCHR(st.st_mode):
        return char_device_size(st.st_rdev, where, sysfs_root), Backing.DAX
    raise PoolForeign(f"{where} is neither a regular file nor a DAX character device")
