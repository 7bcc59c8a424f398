"""Payload checksums: what a reader checks before it trusts an object's bytes.

The slot header's CRC covers the header only; a flipped or overwritten byte
of the payload would be served as valid. So the writer computes a checksum of
the payload it copied out, the header carries it (with its kind, a
``ChecksumKind``), and the reader computes it again over the bytes it
received, before the KV may be used: a mismatch is a failed load
(recompute), never used KV.

The function (``ChecksumKind.POSITION_SUM``): the object's bytes read as
little-endian 32-bit words ``w_0 .. w_{n-1}`` (the last one padded with zero
bytes), the checksum is

    S = sum_j (j + 1) * w_j   (mod 2**64)

It is exact integer arithmetic, so numpy here and a kernel on the GPU
(``maru_connector.transfer.device_checksum``) give the same bits, and it
splits over any cut of the object: a piece of words starting at word ``o``
contributes ``sum_j (o + j + 1) * w_j``, and the pieces add up (mod 2**64).
That is what lets a reader sum an object from the blocks it scattered, or a
chunkwise object layer by layer. Any change of one word is caught (a word
differs by ``d``, ``0 < |d| < 2**32``, and ``(j + 1) * d`` is not ``0`` mod
2**64 for objects under 16 GiB); it is not cryptographic (a writer of the
pool could write a matching header as well): it guards against accidents and
late writers. 0 is a valid value of this kind (the kind byte says whether a
checksum is there).

On the CPU the words are read as a matrix ``[rows, C]`` (1024 columns, or
one row per block of a KV cache), for which only the row sums and the column
sums are needed: ``S = sum_r (o + C r) * rowsum_r + sum_c (c + 1) *
colsum_c`` (``o`` the first word). Where numba is installed (vLLM brings it)
and ``warm_up`` has compiled it, one pass does that at memory speed (about 22 GB/s on one core of
the development VM, faster than XXH3's 11 GB/s there), without the GIL;
otherwise numpy does it in blocks of 1 MiB through a reused 64-bit buffer
that stays in the cache (about 4-6 GB/s).

Entries written by older writers carry ``ChecksumKind.XXH3_64`` (XXH3-64 of
the payload as it lay in the pool); they are still checked, over the pool,
with ``xxh3_checksum`` (``xxhash`` is imported only then).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "CHECKSUM_NAME",
    "CPU_BACKEND",
    "checksum_threads",
    "payload_checksum",
    "payload_checksums",
    "position_sum",
    "position_sum_rows",
    "warm_up",
    "xxh3_checksum",
]

#: The checksum function writers record now, as the docs and metrics name it.
CHECKSUM_NAME = "position_sum_32x64"

_MASK = (1 << 64) - 1
_COLS = 1024  # words per matrix row
_BLOCK_ROWS = 256  # rows per block: 1 MiB of words, 2 MiB as uint64
_COL_WEIGHTS = np.arange(1, _COLS + 1, dtype=np.uint64)
_ROW_INDEX = np.arange(_BLOCK_ROWS, dtype=np.uint64)
_scratch = threading.local()


def _buffer(rows: int, cols: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * cols:
        buf = _scratch.buf = np.empty(max(rows * cols, _BLOCK_ROWS * _COLS), dtype=np.uint64)
    return buf[: rows * cols].reshape(rows, cols)


def _words(data) -> np.ndarray:
    """``data`` (bytes-like or a numpy array) as little-endian uint32 words, zero-padded."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    raw = raw.reshape(-1) if raw.flags.c_contiguous else np.ascontiguousarray(raw).reshape(-1)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, dtype=np.uint8)])
    return raw.view("<u4")




def _matrix_sum_loops(m, base):  # pragma: no cover - compiled by numba
    rows, cols = m.shape
    col = np.zeros(cols, dtype=np.uint64)
    weighted = np.uint64(0)
    total = np.uint64(0)
    for r in range(rows):
        row_sum = np.uint64(0)
        for c in range(cols):
            x = np.uint64(m[r, c])
            col[c] += x
            row_sum += x
        weighted += np.uint64(r) * row_sum
        total += row_sum
    acc = np.uint64(cols) * weighted + base * total
    for c in range(cols):
        acc += np.uint64(c + 1) * col[c]
    return acc


#: What computes the sums on the CPU: "numba" or "numpy". numba is imported
#: only by :func:`warm_up`, never with this module: vLLM's CPU worker scans
#: every loaded module's globals when it starts (its Triton kernel overrides)
#: and fails on objects of numba's, so an engine must not load numba before
#: its worker has started (the engines warm up at ``register_kv_caches``).
CPU_BACKEND = "numba" if importlib.util.find_spec("numba") is not None else "numpy"
# (matrix, base) -> the sum, as a numba-compiled function.
_MatrixSumFn = Callable[[np.ndarray, np.uint64], int]
_compiled: dict[bool, _MatrixSumFn] = {}
_compile_lock = threading.Lock()


def _compile(contiguous: bool) -> _MatrixSumFn:
    """The compiled pass for C-contiguous matrices or any with contiguous rows: one
    signature each (read-only arrays, which writable ones convert to)."""
    with _compile_lock:
        fn = _compiled.get(contiguous)
        if fn is None:
            import numba

            t = numba.types
            array = t.Array(t.uint32, 2, "C" if contiguous else "A", readonly=True)
            fn = numba.njit(t.uint64(array, t.uint64), nogil=True, boundscheck=False)(_matrix_sum_loops)
            _compiled[contiguous] = fn
    return fn


def warm_up() -> None:
    """Compile the CPU pass now (about a second, once per process). Until a process
    has called it, sums run on numpy: a first checksum never waits for a compiler
    (the engines call it when they start)."""
    if CPU_BACKEND == "numba":
        _compile(True)
        _compile(False)


def _matrix_sum(m: np.ndarray, base: int) -> int:
    """``sum_{r,c} (base + r*C + c + 1) * m[r, c]`` mod 2**64 for a uint32 matrix
    ``[rows, C]`` (rows contiguous, any row stride)."""
    fn = _compiled.get(bool(m.flags.c_contiguous)) if CPU_BACKEND == "numba" else None
    if fn is not None:
        return int(fn(m, np.uint64(base & _MASK)))
    return _matrix_sum_numpy(m, base)


def _matrix_sum_numpy(m: np.ndarray, base: int) -> int:
    """``_matrix_sum`` with numpy, block by block through the scratch buffer."""
    rows, cols = m.shape
    total = 0
    step = max(1, (_BLOCK_ROWS * _COLS) // max(cols, 1))
    col_weights = _COL_WEIGHTS[:cols] if cols <= _COLS else np.arange(1, cols + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            buf = _buffer(n, cols)
            np.copyto(buf, m[r0 : r0 + n], casting="unsafe")
            row_sums = np.add.reduce(buf, axis=1)
            col_sums = np.add.reduce(buf, axis=0)
            row_index = _ROW_INDEX[:n] if n <= _BLOCK_ROWS else np.arange(n, dtype=np.uint64)
            weighted_rows = int(np.dot(row_index, row_sums)) * cols
            first = base + r0 * cols  # word index of this block's first word
            total += first * int(np.add.reduce(row_sums)) + weighted_rows + int(np.dot(col_weights, col_sums))
    return total & _MASK


def position_sum(data, base_words: int = 0) -> int:
    """``sum_j (base_words + j + 1) * w_j`` mod 2**64 over ``data``'s little-endian
    32-bit words (zero-padded): the checksum of an object when ``base_words`` is
    0, else the share of a piece of one that starts at word ``base_words``."""
    words = _words(data)
    n = words.size
    full = n - n % _COLS
    total = _matrix_sum(words[:full].reshape(-1, _COLS), base_words) if full else 0
    if full < n:
        total += _matrix_sum(words[full:].reshape(1, -1), base_words + full)
    return total & _MASK


def position_sum_rows(rows: np.ndarray, base_words: int = 0) -> int:
    """``position_sum`` of the rows of a 2-D uint8 array taken end to end (each row
    contiguous, a multiple of 4 bytes, rows at any stride: blocks of a KV cache)."""
    if rows.ndim != 2 or rows.shape[1] % 4 or rows.strides[1] != 1:
        raise ValueError(f"rows must be [n, 4k] uint8 with contiguous rows, got {rows.shape} {rows.strides}")
    if rows.flags.c_contiguous:
        return position_sum(rows, base_words)
    return _matrix_sum(rows.view("<u4"), base_words)


def payload_checksum(data) -> int:
    """The checksum (``ChecksumKind.POSITION_SUM``) of an object's bytes ``data``."""
    return position_sum(data)


def xxh3_checksum(data) -> int:
    """The checksum of ``ChecksumKind.XXH3_64`` entries (older writers): XXH3-64, never 0."""
    import xxhash  # only for entries of older writers

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


def payload_checksums(views: Sequence, threads: int | None = None, function=None) -> list[int]:
    """``function`` (default ``payload_checksum``) of each view, in order, on up to
    ``threads`` threads (default ``checksum_threads()``; one for small objects)."""
    function = function or payload_checksum
    threads = checksum_threads() if threads is None else threads
    if threads <= 1 or len(views) < 2 or min(memoryview(v).nbytes for v in views) < _PARALLEL_MIN_BYTES:
        return [function(v) for v in views]
    return list(_pool(threads).map(function, views))


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
