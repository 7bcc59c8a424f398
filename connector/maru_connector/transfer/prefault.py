"""Map the pool's pages into this process before a hit reads them.

A process that maps the pool has no page-table entries for it yet: the first
read of each 4 KiB page takes a page fault (the kernel maps 16 neighbours
with it), the first write one fault per page, even though the page sits in
memory (a tmpfs file, or CXL memory). A hit reading objects that another
engine stored is such a first read, and a store into slots this worker never
wrote such a first write: on a 2-core VM a hit's load took 1.2-1.4 x and a
store's copy 3.1-3.6 x as long on a cold mapping (bench/RESULTS.md, "Pool
pages mapped before the first hit"). The CUDA backend gets the mapping
filled by ``cudaHostRegister``; the CPU backend fills it here, once, on a
thread of its own at the lowest scheduling priority, with
``madvise(MADV_POPULATE_READ)`` (Linux 5.14 and later), one slice at a time
without the interpreter lock. On a shared mapping of a tmpfs file (the
embedded pool) the entries it makes are writable too, so stores take no
fault either (a test checks it; not measured on a DAX device).

Cost: about 0.1 s of a core per GiB of pool on that VM, and 2 MiB of page
tables per GiB (so, unset, the connector's knob maps pools up to 64 GiB
only: ``MaruConfig.prefault_pool``). The pool is preallocated when it is
created, so this commits no new memory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

from ..log import get_logger
from .copy_cpus import pin_this_thread

logger = get_logger(__name__)

MADV_POPULATE_READ = 22  # linux/mman.h, since 5.14
SLICE_BYTES = 64 << 20  # one call: 7-13 ms of kernel time on a 2-core VM
_LOWEST_PRIORITY = 19

_libc = ctypes.CDLL(None, use_errno=True)  # CDLL: each call runs without the GIL
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


def populate(address: int, nbytes: int) -> None:
    """Fill this process's page tables for ``[address, address + nbytes)``
    of a mapping (page-aligned), reading nothing; raises ``OSError``."""
    while _madvise(address, nbytes, MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


class PoolPrefaulter:
    """Populates the whole pages of ``[address, address + nbytes)`` slice by
    slice on a thread.

    ``stop`` ends it between slices and waits for it: call it before the
    mapping goes away. A kernel without ``MADV_POPULATE_READ`` (or a mapping
    it refuses) ends it at the first slice; loads are as correct either way.
    """

    def __init__(self, address: int, nbytes: int, slice_bytes: int = SLICE_BYTES,
                 cpus: frozenset[int] | None = None) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        start = -(-address // page) * page  # the whole pages inside the range
        self.address = start
        self.nbytes = max(0, (address + nbytes) // page * page - start)
        self.slice_bytes = max(page, slice_bytes - slice_bytes % page)
        self.populated = 0  # bytes done so far
        self.error: OSError | None = None
        self._cpus = cpus  # the copy threads' cores, away from the forward's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maru-prefault", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.done

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:  # this thread only: on Linux a thread is a task of its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
        except OSError:
            pass
        pin_this_thread(self._cpus)
        while self.populated < self.nbytes and not self._stop.is_set():
            n = min(self.slice_bytes, self.nbytes - self.populated)
            try:
                populate(self.address + self.populated, n)
            except OSError as exc:
                self.error = exc
                logger.info("pool pages not mapped ahead (%s); hits fault them in as they read",
                            exc)
                return
            self.populated += n
