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

A fill that completes objects can also compare them (``Compare``): the
last of the launch's programs to finish (a ticket counter, as CUDA's
threadfence reduction does it) compares the due objects' totals with the
checksums their writers recorded and writes one flag into pinned host
memory. A verified fill then costs its load one launch on the issuing
thread, where a sum launch and a compare of several torch operations cost
a 4k-token layerwise hit 2-12 ms of issue time (bench/RESULTS.md).

The kernel is Triton's (one read of the bytes, at HBM speed); without Triton
a torch expression computes the same sums, several passes over the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..log import get_logger

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["BACKEND", "Compare", "add_row_sums", "as_uint64", "warm_up"]

logger = get_logger(__name__)

_MASK = (1 << 64) - 1
_BLOCK = 1024  # words per step of one program
_MAX_PARTS = 64  # programs per row at most (a 1 MiB row: 64 programs of 4 steps)
_TORCH_WORDS = 1 << 22  # words per torch pass: bounds its int64 temporaries to 32 MiB each



@dataclass(frozen=True)
class Compare:
    """The objects a fill completes, compared once its sums are in: objects
    ``r * stride + first + c`` for ``r < rows``, ``c < cols`` (every chunk of
    a chunkwise load: ``rows`` objects, stride 1, one column; the layers a
    layerwise fill completes: every chunk's objects of those layers).
    ``expected`` (int64) and ``verify`` (int64, 0: not checked here) are per
    object of the load, like the sums; ``flag`` is a pinned host int32
    tensor of one element, set to 1 on a mismatch, else 0; ``counter`` an
    int32 device scalar, 0 between launches (the kernel resets it)."""

    expected: torch.Tensor
    verify: torch.Tensor
    flag: torch.Tensor
    counter: torch.Tensor
    rows: int
    stride: int
    first: int
    cols: int


# Whether the kernel compares in the same launch (``warm_up`` turns it off
# where it disagrees with torch, e.g. a pinned flag it cannot write).
FUSED_COMPARE = True

if triton is not None:

    @triton.jit(do_not_specialize=["start_word", "row_words", "n_chunks", "n_layers", "first_chunk",
                                   "first_layer", "total_layers", "layer_words", "cmp_rows",
                                   "cmp_stride", "cmp_first", "cmp_cols"])
    def _row_sums_kernel(data_ptr, sums_ptr, start_word, row_words, n_chunks, n_layers, first_chunk,
                         first_layer, total_layers, layer_words,
                         counter_ptr, expected_ptr, verify_ptr, flag_ptr, cmp_rows, cmp_stride, cmp_first,
                         cmp_cols, CHUNK_MAJOR: tl.constexpr, LAYERWISE: tl.constexpr,
                         COMPARE: tl.constexpr, BLOCK: tl.constexpr):
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
        if COMPARE:
            # acq_rel: the program that draws the last ticket sees every
            # other program's sums, which each added before drawing its own.
            ticket = tl.atomic_add(counter_ptr, 1)
            if ticket == tl.num_programs(0) * parts - 1:
                tl.store(counter_ptr, 0)  # ready for the next fill's launch
                n = cmp_rows * cmp_cols
                bad = tl.zeros([BLOCK], dtype=tl.int32)
                for first in range(0, n, BLOCK):
                    i = first + offsets
                    inside = i < n
                    o = (i // cmp_cols).to(tl.int64) * cmp_stride + cmp_first + i % cmp_cols
                    got = tl.load(sums_ptr + o, mask=inside, other=0, volatile=True)  # not an L1 copy
                    want = tl.load(expected_ptr + o, mask=inside, other=0)
                    checked = tl.load(verify_ptr + o, mask=inside, other=0)
                    bad = bad | ((got != want) & (checked != 0) & inside).to(tl.int32)
                tl.store(flag_ptr, tl.max(bad, axis=0))

    BACKEND = "triton"
else:  # pragma: no cover
    BACKEND = "torch"


def add_row_sums(sums: torch.Tensor, buffer: torch.Tensor, byte_offset: int, row_bytes: int, *,
                 first_chunk: int, n_chunks: int, first_layer: int, n_layers: int, chunk_major: bool,
                 layerwise: bool, total_layers: int, compare: Compare | None = None,
                 backend: str | None = None) -> None:
    """Add the position sums of the ``n_chunks * n_layers`` rows of ``row_bytes``
    staged in ``buffer`` (uint8) from ``byte_offset`` to ``sums`` (int64, one
    per object of the load), on the current stream.

    Row ``i`` is chunk ``first_chunk + r`` and layer ``first_layer + k``, with
    ``(r, k) = divmod(i, n_layers)`` when ``chunk_major``, else
    ``(k, r) = divmod(i, n_chunks)``; its object and first word are those of
    ``checks.piece_of``. With ``compare``, then compare the objects it
    names into its flag (in the same launch with Triton). ``backend``:
    ``"triton"`` or ``"torch"`` (default: Triton where it is installed and
    the buffer is on a GPU).
    """
    if byte_offset % 4 or row_bytes % 4:
        raise ValueError(f"rows must be whole 32-bit words: offset {byte_offset}, row {row_bytes} bytes")
    n_rows = n_chunks * n_layers
    if n_rows == 0:
        if compare is not None:
            _torch_compare(sums, compare)
        return
    words = buffer[: buffer.numel() // 4 * 4].view(torch.int32)
    row_words, start_word = row_bytes // 4, byte_offset // 4
    layer_words = 0 if layerwise else row_words
    if backend is None:
        backend = "triton" if BACKEND == "triton" and buffer.is_cuda else "torch"
    if backend == "triton":
        parts = max(1, min(_MAX_PARTS, -(-row_words // (4 * _BLOCK))))
        c = compare if FUSED_COMPARE else None
        _row_sums_kernel[(n_rows, parts)](
            words, sums, start_word, row_words, n_chunks, n_layers, first_chunk, first_layer, total_layers,
            layer_words, sums if c is None else c.counter, sums if c is None else c.expected,
            sums if c is None else c.verify, sums if c is None else c.flag, 0 if c is None else c.rows,
            0 if c is None else c.stride, 0 if c is None else c.first, 1 if c is None else c.cols,
            CHUNK_MAJOR=chunk_major, LAYERWISE=layerwise, COMPARE=c is not None, BLOCK=_BLOCK)
        if compare is not None and c is None:
            _torch_compare(sums, compare)
        return
    _torch_row_sums(sums, words, start_word, row_words, n_chunks, n_layers, first_chunk, first_layer,
                    total_layers, layer_words, chunk_major, layerwise)
    if compare is not None:
        _torch_compare(sums, compare)


def _torch_compare(sums: torch.Tensor, c: Compare) -> None:
    """The kernel's comparison with torch operations, on the current stream."""
    objs = (torch.arange(c.rows, device=sums.device, dtype=torch.int64)[:, None] * c.stride
            + c.first + torch.arange(c.cols, device=sums.device, dtype=torch.int64)).view(-1)
    bad = ((sums[objs] != c.expected[objs]) & (c.verify[objs] != 0)).any().to(torch.int32).view(1)
    c.flag.copy_(bad, non_blocking=True)  # pinned: no host wait here


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
    and check them against torch's sums and comparisons; a Triton that cannot
    compile here (no toolchain) or disagrees leaves every sum to torch, and a
    fused comparison that disagrees leaves the comparisons to torch, with a
    warning."""
    global BACKEND, FUSED_COMPARE
    if BACKEND != "triton":  # pragma: no cover
        return
    data = torch.arange(256, dtype=torch.int64, device=device).mul_(2654435761).to(torch.uint8)
    try:
        for chunk_major in (False, True):
            got, want = (torch.zeros(4, dtype=torch.int64, device=device) for _ in range(2))
            for sums, backend in ((got, "triton"), (want, "torch")):
                _add_warm_up_rows(sums, data, layerwise, chunk_major, backend)
            if not torch.equal(got, want):
                raise RuntimeError(f"the kernel's sums {got.tolist()} differ from torch's {want.tolist()}")
        torch.cuda.synchronize(device)
    except Exception as exc:  # pragma: no cover - depends on the machine
        logger.warning("payload checksums on the GPU use torch, not Triton (%s)", exc)
        BACKEND = "torch"
        return
    try:
        _check_fused_compare(device, data, want, layerwise)
    except Exception as exc:  # pragma: no cover - depends on the machine
        logger.warning("payload checksums on the GPU are compared by torch, not in the kernel (%s)", exc)
        FUSED_COMPARE = False


def _add_warm_up_rows(sums: torch.Tensor, data: torch.Tensor, layerwise: bool, chunk_major: bool, backend: str,
                      compare: Compare | None = None) -> None:
    """The rows ``warm_up`` sums: 2 chunks of 2 layers, 48-byte rows from byte 16 of ``data``."""
    add_row_sums(sums, data, 16, 48, first_chunk=0, n_chunks=2, first_layer=0, n_layers=2, chunk_major=chunk_major,
                 layerwise=layerwise, total_layers=2, compare=compare, backend=backend)


def _check_fused_compare(device: torch.device, data: torch.Tensor, want: torch.Tensor, layerwise: bool) -> None:
    """The fused comparison flags a wrong total and only that (both variants)."""
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    flags = torch.full((2,), 7, dtype=torch.int32, pin_memory=True)
    verify = torch.ones(4, dtype=torch.int64, device=device)
    for flag, expected in ((flags[0:1], want), (flags[1:2], want + torch.tensor([0, 0, 0, 1], device=device))):
        compare = Compare(expected=expected, verify=verify, flag=flag, counter=counter, rows=2, stride=2,
                          first=0, cols=2)
        _add_warm_up_rows(torch.zeros(4, dtype=torch.int64, device=device), data, layerwise, True, "triton", compare)
    torch.cuda.synchronize(device)
    if flags.tolist() != [0, 1] or int(counter.item()) != 0:
        raise RuntimeError(f"flags {flags.tolist()} (want [0, 1]), counter {int(counter.item())} (want 0)")
