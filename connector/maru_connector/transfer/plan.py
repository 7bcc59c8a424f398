"""What to copy: chunk requests checked against the format, and per-layer
runs of coalesced pool extents.

A *run* is ``rows`` layer extents (one per chunk, ``layer_bytes`` each) at a
constant ``stride`` in the pool: a plain copy when ``stride == layer_bytes``
(adjacent objects), otherwise one strided 2-D copy. Its destination is the
``rows * blocks_per_chunk`` block ids that follow ``first_block`` in the
request's concatenated block-id list.

A load may begin inside its first chunk: vLLM's own prefix cache already
holds that chunk's first blocks. It may also end inside its last chunk: a
block alias (``maru_core.keys.block_alias_keys``) found only that chunk's
first blocks. The block ids of the blocks left out are ``SKIP_BLOCK``: the
engine reads and verifies those bytes like any other (an object is checked
whole) but writes nothing for them (``check_chunks`` says where they may be).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from ..object_format import ObjectFormat

__all__ = [
    "SKIP_BLOCK",
    "ChunkLoad",
    "ChunkStore",
    "Run",
    "TransferRequestError",
    "check_chunks",
    "layer_pieces",
    "layer_runs",
    "split_runs",
]


# The block id of a loaded block that is verified but not written (vLLM holds it).
SKIP_BLOCK = -1


class TransferRequestError(ValueError):
    """A load or store request that does not fit the object format."""


class ChunkLoad(NamedTuple):
    """Load one chunk: ``sources`` are the pool data offsets of its objects
    (``ObjectFormat.objects_per_chunk`` of them: chunkwise ``(offset,)``;
    layerwise one per layer position)."""

    block_ids: tuple[int, ...]
    sources: tuple[int, ...]


class ChunkStore(NamedTuple):
    """Store one chunk into reserved slots at ``destinations`` (same shape
    as ``ChunkLoad.sources``)."""

    block_ids: tuple[int, ...]
    destinations: tuple[int, ...]


@dataclass(frozen=True)
class Run:
    offset: int       # pool offset of the first row
    stride: int       # pool bytes between rows
    rows: int         # chunks in the run
    first_block: int  # index into the request's concatenated block ids

    def end(self, row_bytes: int) -> int:
        return self.offset + (self.rows - 1) * self.stride + row_bytes


def check_chunks(fmt: ObjectFormat, chunks: Sequence, what: str, skip_ends: bool = False) -> list[int]:
    """Validate a request's shape; return its concatenated block ids.

    ``skip_ends``: the first chunk's leading block ids may be ``SKIP_BLOCK``
    (a load that begins inside it), and the last chunk's trailing ones (a
    load that ends inside it); nowhere else, and every chunk writes at least
    one block.
    """
    blocks: list[int] = []
    per_chunk = fmt.objects_per_chunk
    nb = fmt.layout.num_blocks
    for i, chunk in enumerate(chunks):
        ids, offsets = chunk[0], chunk[1]
        if len(ids) != fmt.blocks_per_chunk:
            raise TransferRequestError(
                f"{what} chunk {i} has {len(ids)} block ids; a chunk of "
                f"{fmt.chunk_tokens} tokens needs {fmt.blocks_per_chunk}"
            )
        if len(offsets) != per_chunk:
            raise TransferRequestError(
                f"{what} chunk {i} has {len(offsets)} pool offsets; the "
                f"{fmt.name} format has {per_chunk} object(s) per chunk"
            )
        head = skipped_head(ids) if i == 0 and skip_ends else 0
        if head == len(ids):
            raise TransferRequestError(f"{what} chunk 0 writes no block: load from the next chunk instead")
        tail = skipped_tail(ids) if i == len(chunks) - 1 and skip_ends else 0
        if head + tail >= len(ids):
            raise TransferRequestError(f"{what} chunk {i} writes no block: leave it out of the load")
        bad = [b for b in ids[head : len(ids) - tail] if not 0 <= b < nb]
        if bad:
            where = "" if skip_ends or SKIP_BLOCK not in bad else " (a store reads every block it names)"
            raise TransferRequestError(
                f"{what} chunk {i} names block ids {bad} outside the KV "
                f"cache's {nb} blocks{where}"
            )
        blocks.extend(ids)
    return blocks


def skipped_head(block_ids: Sequence[int]) -> int:
    """How many leading block ids are ``SKIP_BLOCK``."""
    n = 0
    while n < len(block_ids) and block_ids[n] == SKIP_BLOCK:
        n += 1
    return n


def skipped_tail(block_ids: Sequence[int]) -> int:
    """How many trailing block ids are ``SKIP_BLOCK``."""
    return skipped_head(block_ids[::-1])


def skipped_spans(block_ids: Sequence[int], start: int, stop: int) -> list[tuple[int, int, bool]]:
    """``block_ids[start:stop]`` cut into ``(first, end, skipped)`` spans of
    ``SKIP_BLOCK`` ids and of written ones, in order."""
    spans: list[tuple[int, int, bool]] = []
    for i in range(start, stop):
        skipped = block_ids[i] == SKIP_BLOCK
        if spans and spans[-1][2] == skipped:
            spans[-1] = (spans[-1][0], i + 1, skipped)
        else:
            spans.append((i, i + 1, skipped))
    return spans


def layer_runs(fmt: ObjectFormat, offsets: Sequence[Sequence[int]], layer: int) -> list[Run]:
    """Coalesce one layer's extents of consecutive chunks into runs."""
    runs: list[Run] = []
    bpc = fmt.blocks_per_chunk
    row_bytes = fmt.layer_bytes
    for c, chunk_offsets in enumerate(offsets):
        src = fmt.layer_source(tuple(chunk_offsets), layer)
        if runs:
            last = runs[-1]
            step = src - (last.offset + (last.rows - 1) * last.stride)
            stride = step if last.rows == 1 else last.stride
            if step == stride and step >= row_bytes:
                runs[-1] = Run(last.offset, stride, last.rows + 1, last.first_block)
                continue
        runs.append(Run(src, row_bytes, 1, c * bpc))
    return runs


def split_runs(runs: list[Run], max_rows: int, blocks_per_row: int) -> list[list[Run]]:
    """Group runs into pieces of at most ``max_rows`` rows (staging-sized)."""
    pieces: list[list[Run]] = [[]]
    room = max_rows
    for run in runs:
        done = 0
        while done < run.rows:
            if room == 0:
                pieces.append([])
                room = max_rows
            take = min(room, run.rows - done)
            pieces[-1].append(
                Run(
                    run.offset + done * run.stride,
                    run.stride,
                    take,
                    run.first_block + done * blocks_per_row,
                )
            )
            done += take
            room -= take
    return [p for p in pieces if p]


def _shifted(pieces: list[list[Run]], delta: int) -> list[list[Run]]:
    return [[Run(r.offset + delta, r.stride, r.rows, r.first_block) for r in piece]
            for piece in pieces]


def _layer_shifts(fmt: ObjectFormat, offsets: Sequence[Sequence[int]]) -> list[int] | None:
    """Per layer, how far its extents lie from layer 0's, when that is the
    same for every chunk (else None): then every layer's runs are layer 0's,
    shifted.

    A format of one object per chunk holds the layers at fixed offsets in
    it: always. Several objects per chunk (layerwise): when each chunk's
    objects were placed alike, as one store's reserve places them
    (chunk-major, side by side)."""
    places = fmt.layer_places
    if fmt.objects_per_chunk == 1:
        return [offset - places[0][1] for _, offset in places]
    table = np.asarray(offsets, dtype=np.int64).reshape(len(offsets), fmt.objects_per_chunk)
    objs = np.fromiter((obj for obj, _ in places), dtype=np.int64, count=len(places))
    within = np.fromiter((offset for _, offset in places), dtype=np.int64, count=len(places))
    sources = table[:, objs] + within
    shifts = sources - sources[:, :1]
    if len(table) and (shifts == shifts[0]).all():
        return shifts[0].tolist()  # type: ignore[no-any-return]
    return None


def layer_pieces(fmt: ObjectFormat, offsets: Sequence[Sequence[int]], max_rows: int):
    """Per layer, in layer order: its runs grouped into staging-sized pieces.

    Where every layer's runs are layer 0's shifted (``_layer_shifts``), they
    are planned once, not once per layer: a small load is bound by the copy
    thread's time per layer, and a layerwise 16k-token hit would plan 2,048
    extents one by one.
    """
    bpc = fmt.blocks_per_chunk
    shifts = _layer_shifts(fmt, offsets)
    if shifts is None:
        for layer in range(fmt.num_layers):
            yield split_runs(layer_runs(fmt, offsets, layer), max_rows, bpc)
        return
    first = split_runs(layer_runs(fmt, offsets, 0), max_rows, bpc)
    yield first
    for shift in shifts[1:]:
        yield _shifted(first, shift)
