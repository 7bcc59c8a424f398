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
a 4k-token layerwise hit 2-12 ms of issue time (bench/RESULTS.md). Once
``warm_up`` has compiled and checked a variant, that launch goes straight
to the CUDA driver (``direct_launch.py``), not through Triton's launcher.

The kernel is Triton's (one read of the bytes, at HBM speed); without Triton
a torch expression computes the same sums, several passes over the bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..log import get_logger
from .direct_launch import INT32, POINTER, DirectLaunch, direct_launch

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
    object of the load, like the sums; ``flags[flag_index]`` (a pinned host
    int32 tensor) is set to 1 on a mismatch, else 0; ``counter`` an int32
    device scalar, 0 between launches (the kernel resets it)."""

    expected: torch.Tensor
    verify: torch.Tensor
    flags: torch.Tensor
    flag_index: int
    counter: torch.Tensor
    rows: int
    stride: int
    first: int
    cols: int

    @property
    def flag(self) -> torch.Tensor:
        return self.flags[self.flag_index:self.flag_index + 1]


# Whether the kernel compares in the same launch (``warm_up`` turns it off
# where it disagrees with torch, e.g. a pinned flag it cannot write).
FUSED_COMPARE = True
# Whether a variant ``warm_up`` checked is launched through the CUDA driver
# directly (a benchmark turns it off to measure Triton's launch).
DIRECT_LAUNCH = True
# The kernel's parameters in order, constants left out (``direct_launch``).
_KERNEL_PARAMS = (POINTER, POINTER) + (INT32,) * 8 + (POINTER,) * 4 + (INT32,) * 5
# The direct launch of each variant warm_up checked, by (device index, chunk_major, layerwise,
# compare): a compiled kernel belongs to its device's context.
_DIRECT: dict[tuple[int | None, bool, bool, bool], DirectLaunch] = {}

if triton is not None:

    @triton.jit(do_not_specialize=["start_word", "row_words", "n_chunks", "n_layers", "first_chunk",
                                   "first_layer", "total_layers", "layer_words", "flag_index",
                                   "cmp_rows", "cmp_stride", "cmp_first", "cmp_cols"])
    def _row_sums_kernel(data_ptr, sums_ptr, start_word, row_words, n_chunks, n_layers, first_chunk,
                         first_layer, total_layers, layer_words,
                         counter_ptr, expected_ptr, verify_ptr, flags_ptr, flag_index, cmp_rows, cmp_stride,
                         cmp_first, cmp_cols, CHUNK_MAJOR: tl.constexpr, LAYERWISE: tl.constexpr,
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
                tl.store(flags_ptr + flag_index, tl.max(bad, axis=0))

    BACKEND = "triton"
else:  # pragma: no cover
    BACKEND = "torch"


def add_row_sums(sums: torch.Tensor, buffer: torch.Tensor, byte_offset: int, row_bytes: int, *,
                 first_chunk: int, n_chunks: int, first_layer: int, n_layers: int, chunk_major: bool,
                 layerwise: bool, total_layers: int, compare: Compare | None = None,
                 backend: str | None = None, stream: int | None = None) -> None:
    """Add the position sums of the ``n_chunks * n_layers`` rows of ``row_bytes``
    staged in ``buffer`` (uint8) from ``byte_offset`` to ``sums`` (int64, one
    per object of the load), on ``stream`` (a ``cudaStream_t`` as an int;
    default: the current stream).

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
            with _on_stream(stream, sums.device):
                _torch_compare(sums, compare)
        return
    row_words, start_word = row_bytes // 4, byte_offset // 4
    layer_words = 0 if layerwise else row_words
    if backend is None:
        backend = "triton" if BACKEND == "triton" and buffer.is_cuda else "torch"
    if backend == "triton":
        c = compare if FUSED_COMPARE else None
        grid = (n_rows, max(1, min(_MAX_PARTS, -(-row_words // (4 * _BLOCK)))))
        rows = (start_word, row_words, n_chunks, n_layers, first_chunk, first_layer, total_layers, layer_words)
        cmp = (0, 0, 0, 0, 1) if c is None else (c.flag_index, c.rows, c.stride, c.first, c.cols)
        direct = _DIRECT.get((buffer.device.index, chunk_major, layerwise, c is not None)) if DIRECT_LAUNCH else None
        if direct is None or not direct(
                grid, torch.cuda.current_stream(buffer.device).cuda_stream if stream is None else stream,
                (buffer.data_ptr(), sums.data_ptr(), *rows,
                 *((sums.data_ptr(),) * 4 if c is None else
                   (c.counter.data_ptr(), c.expected.data_ptr(), c.verify.data_ptr(), c.flags.data_ptr())),
                 *cmp)):
            with _on_stream(stream, buffer.device):
                _jit_launch(grid, buffer, sums, rows, c, cmp, chunk_major, layerwise)
        if compare is not None and c is None:
            with _on_stream(stream, sums.device):
                _torch_compare(sums, compare)
        return
    words = buffer[: buffer.numel() // 4 * 4].view(torch.int32)
    with _on_stream(stream, sums.device):
        _torch_row_sums(sums, words, start_word, row_words, n_chunks, n_layers, first_chunk, first_layer,
                        total_layers, layer_words, chunk_major, layerwise)
        if compare is not None:
            _torch_compare(sums, compare)


def _on_stream(stream: int | None, device: torch.device):
    """A context that makes ``stream`` (a handle; None: leave it) current."""
    if stream is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))


def _jit_launch(grid, buffer: torch.Tensor, sums: torch.Tensor, rows: tuple, c: Compare | None, cmp: tuple,
                chunk_major: bool, layerwise: bool):
    """The kernel launched through Triton on the current stream: the variant it compiled."""
    words = buffer[: buffer.numel() // 4 * 4].view(torch.int32)
    unused = sums  # a pointer the variant without a comparison never reads
    return _row_sums_kernel[grid](
        words, sums, *rows, unused if c is None else c.counter, unused if c is None else c.expected,
        unused if c is None else c.verify, unused if c is None else c.flags, *cmp,
        CHUNK_MAJOR=chunk_major, LAYERWISE=layerwise, COMPARE=c is not None, BLOCK=_BLOCK)


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
    warning. Then the variants are launched through the driver directly
    where that can be checked and agrees (``direct_launch.py``)."""
    global BACKEND, FUSED_COMPARE
    if BACKEND != "triton":  # pragma: no cover
        return
    data = torch.arange(256, dtype=torch.int64, device=device).mul_(2654435761).to(torch.uint8)
    try:
        want = _check_sums(device, data, layerwise)
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
    _enable_direct_launch(device, data, want, layerwise)


def _check_sums(device: torch.device, data: torch.Tensor, layerwise: bool) -> torch.Tensor:
    """The warm-up rows summed by the kernel, both orders, equal torch's: torch's sums."""
    for chunk_major in (False, True):
        got, want = (torch.zeros(4, dtype=torch.int64, device=device) for _ in range(2))
        for sums, backend in ((got, "triton"), (want, "torch")):
            _add_warm_up_rows(sums, data, layerwise, chunk_major, backend)
        if not torch.equal(got, want):
            raise RuntimeError(f"the kernel's sums {got.tolist()} differ from torch's {want.tolist()}")
    return want


def _enable_direct_launch(device: torch.device, data: torch.Tensor, want: torch.Tensor, layerwise: bool) -> None:
    """Launch this format's variants through the driver from now on, once
    each can be (``direct_launch``) and the launches agree with torch."""
    made: dict[tuple[int | None, bool, bool, bool], DirectLaunch] = {}
    compares = (False, True) if FUSED_COMPARE else (False,)
    for chunk_major in (False, True):
        for compare in compares:
            c = _warm_up_compare(device, want, 0) if compare else None
            rows = (4, 12, 2, 2, 0, 0, 2, 0 if layerwise else 12)  # as _add_warm_up_rows
            cmp = (0, 0, 0, 0, 1) if c is None else (c.flag_index, c.rows, c.stride, c.first, c.cols)
            compiled = _jit_launch((4, 1), data, torch.zeros(4, dtype=torch.int64, device=device), rows, c, cmp,
                                   chunk_major, layerwise)
            launch, why = direct_launch(compiled, _KERNEL_PARAMS)
            if launch is None:
                logger.info("the checksum kernel is launched through Triton: %s", why)
                return
            made[(data.device.index, chunk_major, layerwise, compare)] = launch
    _DIRECT.update(made)
    try:
        _check_sums(device, data, layerwise)
        if FUSED_COMPARE:
            _check_fused_compare(device, data, want, layerwise)
    except Exception as exc:  # pragma: no cover - depends on the machine
        for key in made:
            _DIRECT.pop(key, None)
        logger.warning("the checksum kernel is launched through Triton: its direct launch disagreed (%s)", exc)


def _add_warm_up_rows(sums: torch.Tensor, data: torch.Tensor, layerwise: bool, chunk_major: bool, backend: str,
                      compare: Compare | None = None) -> None:
    """The rows ``warm_up`` sums: 2 chunks of 2 layers, 48-byte rows from byte 16 of ``data``."""
    add_row_sums(sums, data, 16, 48, first_chunk=0, n_chunks=2, first_layer=0, n_layers=2, chunk_major=chunk_major,
                 layerwise=layerwise, total_layers=2, compare=compare, backend=backend)


def _warm_up_compare(device: torch.device, expected: torch.Tensor, flag_index: int,
                     flags: torch.Tensor | None = None, counter: torch.Tensor | None = None) -> Compare:
    """A comparison of the warm-up rows' 4 objects (2 chunks of 2 layers) against ``expected``."""
    return Compare(expected=expected, verify=torch.ones(4, dtype=torch.int64, device=device),
                   flags=torch.zeros(2, dtype=torch.int32, pin_memory=True) if flags is None else flags,
                   flag_index=flag_index,
                   counter=torch.zeros(1, dtype=torch.int32, device=device) if counter is None else counter,
                   rows=2, stride=2, first=0, cols=2)


def _check_fused_compare(device: torch.device, data: torch.Tensor, want: torch.Tensor, layerwise: bool) -> None:
    """The fused comparison flags a wrong total and only that (both variants)."""
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    flags = torch.full((2,), 7, dtype=torch.int32, pin_memory=True)
    for index, expected in ((0, want), (1, want + torch.tensor([0, 0, 0, 1], device=device))):
        compare = _warm_up_compare(device, expected, index, flags, counter)
        _add_warm_up_rows(torch.zeros(4, dtype=torch.int64, device=device), data, layerwise, True, "triton", compare)
    torch.cuda.synchronize(device)
    if flags.tolist() != [0, 1] or int(counter.item()) != 0:
        raise RuntimeError(f"flags {flags.tolist()} (want [0, 1]), counter {int(counter.item())} (want 0)")
