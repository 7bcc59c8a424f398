"""Payload checksums: what a reader checks before it trusts an object's bytes.

The slot header's CRC covers the header only; a flipped or overwritten byte
of the payload would be served as valid. So the writer computes a checksum of
the payload as it lies in the pool, after its copy completed and before it
writes the slot header, and the header carries it. A reader recomputes it
over the pinned slot before it copies (``verify_payload``): a mismatch is a
failed load (recompute), never used KV.

The function is XXH3-64 (xxHash): non-cryptographic (it guards against
accidents and late writers, not against someone who can write the pool,
who could write a matching header as well) and fast: about 10 GB/s on one
core of the development VM (``bench/payload_checksum.py``), with the GIL
released while it runs. A value of 0 is stored as 1, so
0 can mean "no checksum" in the header.

A batch of objects (a store's, a verified load's) is checksummed on several
threads where the machine has cores to spare: on one core XXH3 takes about
280 ms for the 2 GiB of a 16k-token Llama-8B prefix, which is the time from
a prefill's first token to its objects' commit. Small machines keep one
thread: there the cores belong to the forward.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

__all__ = ["CHECKSUM_NAME", "checksum_threads", "payload_checksum", "payload_checksums"]

#: The checksum function, as the docs and metrics name it.
CHECKSUM_NAME = "xxh3_64"


def payload_checksum(data: bytes | bytearray | memoryview) -> int:
    """The XXH3-64 of ``data``, never 0 (0 marks a header without a checksum)."""
    return xxhash.xxh3_64_intdigest(data) or 1


# Below this many bytes per object a thread hand-off costs more than it saves.
_PARALLEL_MIN_BYTES = 1 << 20
_executor: ThreadPoolExecutor | None = None
_executor_threads = 0
_executor_lock = threading.Lock()


def checksum_threads() -> int:
    """Threads a batch is checksummed on: a quarter of this process's cores, 1 to 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 4))


def payload_checksums(views: Sequence[bytes | bytearray | memoryview], threads: int | None = None) -> list[int]:
    """``payload_checksum`` of each view, in order, on up to ``threads`` threads
    (default ``checksum_threads()``; one for small objects)."""
    threads = checksum_threads() if threads is None else threads
    if threads <= 1 or len(views) < 2 or min(memoryview(v).nbytes for v in views) < _PARALLEL_MIN_BYTES:
        return [payload_checksum(v) for v in views]
    return list(_pool(threads).map(payload_checksum, views))


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's checksum threads, grown to ``threads`` when asked for more."""
    global _executor, _executor_threads
    with _executor_lock:
        if _executor is None or _executor_threads < threads:
            if _executor is not None:
                _executor.shutdown(wait=False)  # its queued work still runs
            _executor = ThreadPoolExecutor(threads, thread_name_prefix="maru-checksum")
            _executor_threads = threads
        return _executor
