"""A load's scatter from device staging into vLLM's paged blocks as one
Triton kernel, which can also sum the payload as it copies it and compare
the objects the fill completes: a verified fill then costs its load no
launch beyond the scatter an unverified one issues too.

Before, a verified fill was summed by its own launch (``device_checksum``)
and scattered by torch's ``index_copy_``: two host calls, 12 us and 50-65 us
of the engine thread's time, and batches of fills summed together to keep
the sums' launches few made a batch's layers wait for its last copy. What
a verified 4k-token hit still paid, about 2-3 % on an H100 (bench/RESULTS.md,
"Verified loads", rounds 10-12), was that host time before its forward.

One program copies part of one segment of one block of one layer (a
segment: ``block_segments`` contiguous runs per block, ``kv_layout.py``),
reading each 32-bit word once: it stores the word in the block vLLM
allocated and, with ``SUM``, adds ``(position + 1) * word`` to its object's
total, the weights of ``maru_core.pool.checksum`` that ``device_checksum``
uses, so the totals equal that kernel's and numpy's bit for bit. Blocks a
load leaves out (``write_from``/``write_to``: vLLM's own at the head of the
first chunk, those past a block alias at the end) are summed, not written.
With ``COMPARE``, the launch's last program compares the due objects
(``device_checksum.compare_when_last``).

Once ``warm_up`` has compiled and checked a variant against torch (the
scatter against ``index_copy_``, the sums against ``device_checksum``'s),
it is launched through the CUDA driver (``direct_launch.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..log import get_logger
from . import device_checksum
from .direct_launch import INT32, POINTER, DirectLaunch, direct_launch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

__all__ = ["Fill", "ScatterTarget", "available", "scatter", "warm_up"]

logger = get_logger(__name__)

_BLOCK = 1024  # words per step of one program
_MAX_PARTS = 16  # programs per segment at most
# The kernel's parameters in order, constants left out (``direct_launch``).
_KERNEL_PARAMS = (POINTER,) * 8 + (INT32,) * 22
# The direct launch of each variant warm_up checked, by (device index, sum, compare, layerwise, unit).
_DIRECT: dict[tuple[int | None, bool, bool, bool, int], DirectLaunch] = {}
# Devices (index) where warm_up found the kernel agrees with torch.
_READY: set[int | None] = set()

if triton is not None:

    @triton.jit(do_not_specialize=["start_word", "blocks", "count", "interleaved", "first_block", "write_from",
                                   "write_to", "first_chunk", "first_layer", "total_layers", "bpc",
                                   "block_words", "segments", "segment_words", "segment_stride",
                                   "block_stride", "layer_stride", "flag_index", "cmp_rows", "cmp_stride",
                                   "cmp_first", "cmp_cols"])
    def _scatter_kernel(src_ptr, dst_ptr, ids_ptr, sums_ptr, counter_ptr, expected_ptr, verify_ptr, flags_ptr,
                        start_word, blocks, count, interleaved, first_block, write_from, write_to,
                        first_chunk, first_layer, total_layers, bpc, block_words, segments, segment_words,
                        segment_stride, block_stride, layer_stride, flag_index, cmp_rows, cmp_stride,
                        cmp_first, cmp_cols, SUM: tl.constexpr, COMPARE: tl.constexpr,
                        LAYERWISE: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr):
        # Offsets and strides come in units of UNIT words: with UNIT 4 the
        # compiler knows every run starts on 16 bytes and copies 16 bytes an
        # instruction (4 words one at a time ran at 0.6 of torch's index_copy_).
        start_word = start_word.to(tl.int64) * UNIT
        block_words = block_words * UNIT
        segment_words = segment_words * UNIT
        segment_stride = segment_stride.to(tl.int64) * UNIT
        block_stride = block_stride.to(tl.int64) * UNIT
        layer_stride = layer_stride.to(tl.int64) * UNIT
        row = tl.program_id(0)  # (layer k of the fill, block b of the fill, segment s), s fastest
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        s = row % segments
        b = (row // segments) % blocks
        k = row // segments // blocks
        if interleaved > 0:  # staged [chunk][layer][block of the chunk]
            per = blocks // interleaved
            staged = (b // per * count + k) * per + b % per
        else:  # staged [layer][block]
            staged = k * blocks + b
        src = start_word + staged.to(tl.int64) * block_words + s.to(tl.int64) * segment_words
        block_id = tl.load(ids_ptr + first_block + b).to(tl.int64)
        dst = k.to(tl.int64) * layer_stride + block_id * block_stride + s.to(tl.int64) * segment_stride
        write = (b >= write_from) & (b < write_to)
        j = (b % bpc).to(tl.int64)  # the block's place in its chunk
        if LAYERWISE:
            obj = (first_chunk + b // bpc).to(tl.int64) * total_layers + first_layer + k
            base = j * block_words + s.to(tl.int64) * segment_words
        else:
            obj = (first_chunk + b // bpc).to(tl.int64)
            base = ((first_layer + k).to(tl.int64) * bpc + j) * block_words + s.to(tl.int64) * segment_words
        offsets = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for step in range(part * BLOCK, segment_words, parts * BLOCK):
            idx = step + offsets
            inside = idx < segment_words
            words = tl.load(src_ptr + src + idx, mask=inside, other=0)
            tl.store(dst_ptr + dst + idx, words, mask=inside & write)
            if SUM:
                acc += (base + idx.to(tl.int64) + 1) * words.to(tl.uint32, bitcast=True).to(tl.int64)
        if SUM:
            tl.atomic_add(sums_ptr + obj, tl.sum(acc, axis=0))
            if COMPARE:
                device_checksum.compare_when_last(sums_ptr, counter_ptr, expected_ptr, verify_ptr, flags_ptr,
                                                  flag_index, cmp_rows, cmp_stride, cmp_first, cmp_cols, BLOCK)


@dataclass(frozen=True)
class ScatterTarget:
    """vLLM's paged KV cache as the kernel addresses it, in 32-bit words:
    ``layers[i]`` is layer ``i``'s tensor as words from its block 0;
    ``layer_stride`` the words between consecutive layers when they are
    evenly spaced in one buffer (a fill of several layers needs it), else 0."""

    layers: tuple[torch.Tensor, ...]
    layer_stride: int
    block_stride: int
    segments: int
    segment_words: int
    segment_stride: int
    blocks_per_chunk: int

    @property
    def block_words(self) -> int:
        return self.segments * self.segment_words

    @property
    def aligned(self) -> bool:
        """Whether every block's segments start on 16 bytes (each layer's
        tensor does: ``of`` and ``direct_launch`` check it)."""
        return all(n % 4 == 0 for n in (self.segment_words, self.segment_stride, self.block_stride,
                                        self.layer_stride))

    @classmethod
    def of(cls, block_views: list[torch.Tensor], layout, blocks_per_chunk: int,
           evenly_spaced: bool) -> "ScatterTarget | None":
        """The target of ``block_views`` (``kv_layout.KVCacheLayout.block_view``
        of each layer), or None where a block's segments or strides are not
        whole words (then torch scatters)."""
        sizes = (layout.segment_bytes, layout.segment_stride_bytes, layout.block_stride_bytes,
                 layout.layer_stride_bytes or 0, *(v.data_ptr() for v in block_views))
        if triton is None or not block_views or any(n % 4 for n in sizes):
            return None
        layers = tuple(v.view(torch.int32) for v in block_views)
        stride = layout.layer_stride_bytes // 4 if evenly_spaced and layout.layer_stride_bytes else 0
        return cls(layers, stride, layout.block_stride_bytes // 4, layout.block_segments,
                   layout.segment_bytes // 4, layout.segment_stride_bytes // 4, blocks_per_chunk)


@dataclass(frozen=True)
class Fill:
    """One staging fill as the kernel reads it: ``count`` consecutive layers
    from ``first_layer`` of ``blocks`` consecutive blocks of the load (from
    its ``first_block``, in whole chunks from ``first_chunk``), at
    ``byte_offset`` of ``staging``, layer-major or, with ``interleaved``
    chunks, chunk-major; blocks ``write_from <= b < write_to`` of the fill
    are written."""

    staging: torch.Tensor
    byte_offset: int
    first_layer: int
    count: int
    first_block: int
    blocks: int
    interleaved: int
    write_from: int
    write_to: int


def available(device: torch.device) -> bool:
    """Whether ``warm_up`` found the kernel sound on ``device``."""
    return device.index in _READY


def scatter(target: ScatterTarget, fill: Fill, ids: torch.Tensor, *, sums: torch.Tensor | None = None,
            layerwise: bool = False, total_layers: int = 0, compare: "device_checksum.Compare | None" = None,
            stream: int | None = None) -> None:
    """Copy ``fill`` into the blocks ``ids`` (int64 on the device, the load's
    block ids) name, on ``stream`` (a ``cudaStream_t``; default: the current
    stream); with ``sums`` (int64, one per object of the load) add the
    fill's position sums to them, and with ``compare`` then compare the
    objects it names into its flag, all in one launch."""
    if fill.count > 1 and not target.layer_stride:
        raise ValueError("a fill of several layers needs evenly spaced layers (ScatterTarget.layer_stride)")
    if fill.byte_offset % 4:
        raise ValueError(f"a fill must start on a 32-bit word, not at byte {fill.byte_offset}")
    with_sum = sums is not None
    c = compare if with_sum else None
    staging = fill.staging
    start_word = fill.byte_offset // 4
    unit = 4 if target.aligned and start_word % 4 == 0 else 1
    grid = (fill.count * fill.blocks * target.segments,
            max(1, min(_MAX_PARTS, -(-target.segment_words // (4 * _BLOCK)))))
    dst = target.layers[fill.first_layer]
    spare = staging if sums is None else sums  # for the pointers a variant never reads
    pointers = (spare,) + ((spare,) * 4 if c is None else (c.counter, c.expected, c.verify, c.flags))
    ints = (start_word // unit, fill.blocks, fill.count, fill.interleaved, fill.first_block, fill.write_from,
            fill.write_to, fill.first_block // target.blocks_per_chunk, fill.first_layer, total_layers,
            target.blocks_per_chunk, target.block_words // unit, target.segments, target.segment_words // unit,
            target.segment_stride // unit, target.block_stride // unit, target.layer_stride // unit,
            *((0, 0, 0, 0, 1) if c is None else (c.flag_index, c.rows, c.stride, c.first, c.cols)))
    key = (staging.device.index, with_sum, c is not None, layerwise and with_sum, unit)
    handle = torch.cuda.current_stream(staging.device).cuda_stream if stream is None and staging.is_cuda else stream
    direct = _DIRECT.get(key) if handle is not None else None
    args = (staging.data_ptr(), dst.data_ptr(), ids.data_ptr(), *(p.data_ptr() for p in pointers), *ints)
    if direct is None or handle is None or not direct(grid, handle, args):
        with _on_stream(stream, staging.device):
            _jit_launch(grid, staging, dst, ids, pointers, ints, key[1:])


def _on_stream(stream: int | None, device: torch.device):
    if stream is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device))


def _jit_launch(grid, staging: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, pointers: tuple, ints: tuple,
                variant: tuple[bool, bool, bool, int]):
    """The kernel launched through Triton on the current stream: the variant it compiled."""
    words = staging[: staging.numel() // 4 * 4].view(torch.int32)
    with_sum, compare, layerwise, unit = variant
    return _scatter_kernel[grid](words, dst, ids, *pointers, *ints, SUM=with_sum, COMPARE=compare,
                                 LAYERWISE=layerwise, UNIT=unit, BLOCK=_BLOCK)


def warm_up(device: torch.device, layerwise: bool) -> bool:
    """Compile this format's variants now, not in the first hit, and check
    them against torch on a small cache of two evenly spaced layers (scatter,
    sums, a comparison that must flag one wrong object and only it); then
    launch them through the driver where that can be checked and agrees.
    False, with a warning, where Triton cannot compile here or disagrees:
    torch scatters then."""
    if triton is None:  # pragma: no cover
        return False
    try:
        _check_variants(device, layerwise)
    except Exception as exc:  # pragma: no cover - depends on the machine
        logger.warning("loads scatter with torch, not the fused Triton kernel (%s)", exc)
        return False
    _READY.add(device.index)
    if device.type == "cuda":
        _enable_direct_launch(device, layerwise)
    return True


class _WarmUp:
    """A small cache (2 layers of 6 blocks, each of 2 segments of ``words``
    words that sit apart, as K and V do; the layers evenly spaced; 40 words:
    every segment on 16 bytes, 42: not), a fill of both
    layers' blocks 2-5 of the load (chunks 1 and 2 of 2 blocks) of which
    the middle two are written, and what torch makes of it."""

    def __init__(self, device: torch.device, layerwise: bool, interleaved: bool, words: int = 40) -> None:
        gen = torch.Generator().manual_seed(7)
        self.layerwise = layerwise
        layers, blocks, segments = 2, 6, 2
        self.segment_words = words
        self.cache = torch.zeros(layers, segments, blocks, words, dtype=torch.int32, device=device).transpose(1, 2)
        self.target = ScatterTarget(tuple(self.cache[i] for i in range(layers)), self.cache.stride(0),
                                    self.cache.stride(1), segments, words, self.cache.stride(2), 2)
        by_layer = torch.randint(-(1 << 31), 1 << 31, (layers, 4, segments * words), generator=gen,
                                 dtype=torch.int64).to(torch.int32)  # [layer][block of the fill]
        staged = by_layer.view(layers, 2, 2, -1).transpose(0, 1) if interleaved else by_layer
        self.staging = torch.cat([torch.zeros(4, dtype=torch.int32), staged.reshape(-1)]).view(torch.uint8).to(device)
        self.ids = torch.tensor([9, 9, 4, 0, 5, 2], dtype=torch.int64, device=device)
        self.fill = Fill(self.staging, 16, 0, layers, 2, 4, 2 if interleaved else 0, 1, 3)
        self.want_cache = torch.zeros(layers, blocks, segments, words, dtype=torch.int32)
        for k in range(layers):
            for b in (1, 2):
                self.want_cache[k, int(self.ids[2 + b])] = by_layer[k, b].view(segments, words)
        self.want_sums = torch.zeros(3 * layers if layerwise else 3, dtype=torch.int64)
        device_checksum.add_row_sums(self.want_sums, by_layer.reshape(-1).view(torch.uint8), 0,
                                     2 * segments * words * 4, first_chunk=1, n_chunks=2, first_layer=0,
                                     n_layers=layers, chunk_major=False, layerwise=layerwise, total_layers=layers,
                                     backend="torch")

    def run(self, with_sum: bool, flags: torch.Tensor | None = None, wrong: bool = False, flag_index: int = 0,
            counter: torch.Tensor | None = None) -> torch.Tensor | None:
        """Scatter (and sum; with ``flags``, compare every object, the last
        one's expected total made ``wrong``) once; the sums."""
        device = self.cache.device
        self.cache.zero_()
        sums = torch.zeros(len(self.want_sums), dtype=torch.int64, device=device) if with_sum else None
        compare = None
        if flags is not None:
            assert counter is not None, "a comparison needs its ticket counter"
            expected = self.want_sums.clone()
            expected[-1] += wrong
            compare = device_checksum.Compare(
                expected=expected.to(device), verify=torch.ones_like(expected, device=device), flags=flags,
                flag_index=flag_index, counter=counter, rows=len(expected), stride=1, first=0, cols=1)
        scatter(self.target, self.fill, self.ids, sums=sums, layerwise=self.layerwise, total_layers=2,
                compare=compare)
        return sums

    def check(self, sums: torch.Tensor | None) -> None:
        if not torch.equal(self.cache.cpu(), self.want_cache):
            raise RuntimeError("the kernel's scatter differs from torch's")
        if sums is not None and not torch.equal(sums.cpu(), self.want_sums):
            raise RuntimeError(f"the kernel's sums {sums.tolist()} differ from torch's {self.want_sums.tolist()}")


def _check_variants(device: torch.device, layerwise: bool) -> None:
    """Each variant scatters and sums as torch, both staging orders, segments
    on 16 bytes and not, and the comparison flags a wrong total and only that."""
    for interleaved, words in ((False, 40), (True, 40), (False, 42), (True, 42)):
        w = _WarmUp(device, layerwise, interleaved, words)
        for with_sum in (False, True):
            w.check(w.run(with_sum))
        flags = torch.full((2,), 7, dtype=torch.int32, pin_memory=device.type == "cuda")
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        for index, wrong in ((0, False), (1, True)):
            w.check(w.run(True, flags, wrong, index, counter))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if flags.tolist() != [0, 1] or int(counter.item()) != 0:
            raise RuntimeError(f"flags {flags.tolist()} (want [0, 1]), counter {int(counter.item())} (want 0)")


def _enable_direct_launch(device: torch.device, layerwise: bool) -> None:
    """Launch this format's variants through the driver from now on, once each
    can be (``direct_launch``) and the launches agree with torch."""
    made: dict[tuple[int | None, bool, bool, bool, int], DirectLaunch] = {}
    for words, unit in ((40, 4), (42, 1)):
        w = _WarmUp(device, layerwise, False, words)
        t = w.target
        for with_sum, compare in ((False, False), (True, False), (True, True)):
            variant = (with_sum, compare, layerwise and with_sum, unit)
            sums = torch.zeros(len(w.want_sums), dtype=torch.int64, device=device) if with_sum else w.staging
            c = None if not compare else device_checksum.Compare(
                expected=torch.zeros_like(sums), verify=torch.zeros_like(sums),
                flags=torch.zeros(1, dtype=torch.int32, pin_memory=True), flag_index=0,
                counter=torch.zeros(1, dtype=torch.int32, device=device), rows=1, stride=1, first=0, cols=1)
            pointers = (sums,) + ((sums,) * 4 if c is None else (c.counter, c.expected, c.verify, c.flags))
            ints = (4 // unit, 1, 1, 0, 2, 0, 1, 1, 0, 2, 2, t.block_words // unit, 2, t.segment_words // unit,
                    t.segment_stride // unit, t.block_stride // unit, t.layer_stride // unit, 0, 1, 1, 0, 1)
            compiled = _jit_launch((1, 1), w.staging, t.layers[0], w.ids, pointers, ints, variant)  # one block
            launch, why = direct_launch(compiled, _KERNEL_PARAMS)
            if launch is None:
                logger.info("the scatter kernel is launched through Triton: %s", why)
                return
            made[(device.index, with_sum, compare, variant[2], unit)] = launch
    torch.cuda.synchronize(device)
    _DIRECT.update(made)
    try:
        _check_variants(device, layerwise)
    except Exception as exc:  # pragma: no cover - depends on the machine
        for key in made:
            _DIRECT.pop(key, None)
        logger.warning("the scatter kernel is launched through Triton: its direct launch disagreed (%s)", exc)
