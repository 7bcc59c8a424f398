"""The payload checksum (``maru_core.pool.checksum``: ``sum_j (j + 1) * w_j``
mod 2**64 over an object's little-endian 32-bit words) summed on the GPU,
over the bytes a load received in its device staging or a store gathered
into its own, bit for bit what numpy computes on the CPU.

A staging fill holds rows of ``layer_bytes``: each the extent of one layer
of one chunk, that is a piece of one object starting at a known word of it
(``checks.piece_of``). The rows of one fill are regular: ``n_chunks``
consecutive chunks times ``n_layers`` consecutive layers, chunk-major (a
group of layers copied as wide rows) or layer-major. So one launch per fill
sums every row into its object's 64-bit total (two's complement int64, whose
additions and products wrap exactly as uint64 ones do), with atomics: the
order of integer additions does not change the result.

The kernel is Triton's (one read of the bytes, at HBM speed); without Triton
a torch expression computes the same sums, several passes over the bytes.
"""

from __future__ import annotations

import logging

import torch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["BACKEND", "add_row_sums", "as_uint64", "warm_up"]

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_BLOCK = 1024  # words per step of one program
_MAX_PARTS = 64  # programs per row at most (a 1 MiB row: 64 programs of 4 steps)
_TORCH_WORDS = 1 << 22  # words per torch pass: bounds its int64 temporaries to 32 MiB each

if triton is not None:

    @triton.jit(do_not_specialize=["start_word", "row_words", "n_chunks", "n_layers", "first_chunk",
                                   "first_layer", "total_layers", "layer_words"])
    def _row_sums_kernel(data_ptr, sums_ptr, start_word, row_words, n_chunks, n_layers, first_chunk,
                         first_layer, total_layers, layer_words,
                         CHUNK_MAJOR: tl.constexpr, LAYERWISE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        if CHUNK_MAJOR:
            r = row // n_layers
            k = row % n_layers
        else:
            k = row // n_chunks
            r = row % n_chunks
        chunk = (first_chunk + r).to(tl.int64)
        layer = (first_layer + k).to(tl.int64)
        if LAYERWISE:
            obj = chunk * total_layers + layer
            base = layer * 0
        else:
            obj = chunk
            base = layer * layer_words
        row_start = start_word + row.to(tl.int64) * row_words
        offsets = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for step in range(part * BLOCK, row_words, parts * BLOCK):
            idx = step + offsets
            inside = idx < row_words
            words = tl.load(data_ptr + row_start + idx, mask=inside, other=0)
            words = words.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended
            acc += (base + idx.to(tl.int64) + 1) * words
        tl.atomic_add(sums_ptr + obj, tl.sum(acc, axis=0))

    BACKEND = "triton"
else:  # pragma: no cover
    BACKEND = "torch"


def add_row_sums(sums: torch.Tensor, buffer: torch.Tensor, byte_offset: int, row_bytes: int, *,
                 first_chunk: int, n_chunks: int, first_layer: int, n_layers: int, chunk_major: bool,
                 layerwise: bool, total_layers: int, backend: str | None = None) -> None:
    """Add the position sums of the ``n_chunks * n_layers`` rows of ``row_bytes``
    staged in ``buffer`` (uint8) from ``byte_offset`` to ``sums`` (int64, one
    per object of the load), on the current stream.

    Row ``i`` is chunk ``first_chunk + r`` and layer ``first_layer + k``, with
    ``(r, k) = divmod(i, n_layers)`` when ``chunk_major``, else
    ``(k, r) = divmod(i, n_chunks)``; its object and first word are those of
    ``checks.piece_of``. ``backend``: ``"triton"`` or ``"torch"`` (default:
    Triton where it is installed and the buffer is on a GPU).
    """
    if byte_offset % 4 or row_bytes % 4:
        raise ValueError(f"rows must be whole 32-bit words: offset {byte_offset}, row {row_bytes} bytes")
    n_rows = n_chunks * n_layers
    if n_rows == 0:
        return
    words = buffer[: buffer.numel() // 4 * 4].view(torch.int32)
    row_words, start_word = row_bytes // 4, byte_offset // 4
    layer_words = 0 if layerwise else row_words
    if backend is None:
        backend = "triton" if BACKEND == "triton" and buffer.is_cuda else "torch"
    if backend == "triton":
        parts = max(1, min(_MAX_PARTS, -(-row_words // (4 * _BLOCK))))
        _row_sums_kernel[(n_rows, parts)](
            words, sums, start_word, row_words, n_chunks, n_layers, first_chunk, first_layer, total_layers,
            layer_words, CHUNK_MAJOR=chunk_major, LAYERWISE=layerwise, BLOCK=_BLOCK)
        return
    _torch_row_sums(sums, words, start_word, row_words, n_chunks, n_layers, first_chunk, first_layer,
                    total_layers, layer_words, chunk_major, layerwise)


def _torch_row_sums(sums, words, start_word, row_words, n_chunks, n_layers, first_chunk, first_layer,
                    total_layers, layer_words, chunk_major, layerwise) -> None:
    """The same sums as the kernel, with torch int64 operations (which wrap as it does)."""
    device = words.device
    rows = torch.arange(n_chunks * n_layers, device=device, dtype=torch.int64)
    r, k = (rows // n_layers, rows % n_layers) if chunk_major else (rows % n_chunks, rows // n_chunks)
    chunk, layer = first_chunk + r, first_layer + k
    objs = chunk * total_layers + layer if layerwise else chunk
    bases = layer * layer_words  # 0 for layerwise (layer_words is 0 then)
    step = max(1, _TORCH_WORDS // row_words)
    index = torch.arange(1, row_words + 1, device=device, dtype=torch.int64)
    for first in range(0, len(rows), step):
        n = min(step, len(rows) - first)
        start = start_word + first * row_words
        block = words[start : start + n * row_words].view(n, row_words).to(torch.int64) & 0xFFFFFFFF
        weighted = block * (bases[first : first + n, None] + index)
        sums.index_add_(0, objs[first : first + n], weighted.sum(dim=1))


def as_uint64(values: torch.Tensor) -> list[int]:
    """int64 sums as the uint64 checksums they stand for."""
    return [v & _MASK for v in values.tolist()]


def warm_up(device: torch.device, layerwise: bool) -> None:
    """Compile the kernel's variants for this format now, not in the first hit,
    and check them against torch's sums; a Triton that cannot compile here (no
    toolchain) or disagrees leaves every sum to torch, with a warning."""
    global BACKEND
    if BACKEND != "triton":  # pragma: no cover
        return
    data = torch.arange(256, dtype=torch.int64, device=device).mul_(2654435761).to(torch.uint8)
    try:
        for chunk_major in (False, True):
            got, want = (torch.zeros(4, dtype=torch.int64, device=device) for _ in range(2))
            for sums, backend in ((got, "triton"), (want, "torch")):
                add_row_sums(sums, data, 16, 48, first_chunk=0, n_chunks=2, first_layer=0, n_layers=2,
                             chunk_major=chunk_major, layerwise=layerwise, total_layers=2, backend=backend)
            if not torch.equal(got, want):
                raise RuntimeError(f"the kernel's sums {got.tolist()} differ from torch's {want.tolist()}")
        torch.cuda.synchronize(device)
    except Exception as exc:  # pragma: no cover - depends on the machine
        logger.warning("payload checksums on the GPU use torch, not Triton (%s)", exc)
        BACKEND = "torch"
