"""Frames of the index protocol: a 4-byte big-endian length, then a msgpack map.

A frame longer than ``MAX_FRAME_BYTES`` or a payload that is not msgpack
means the stream can no longer be trusted; the receiver raises
``FrameError`` and closes that connection.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from collections.abc import Callable
from typing import Any

import msgpack

from maru_core.protocol.errors import FrameError, FrameTooLarge
from maru_core.protocol.messages import MAX_BATCH_KEYS

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size

#: Largest payload accepted in one frame. A retrieve of ``MAX_BATCH_KEYS``
#: keys is about 2.4 MB on the wire, its reply about 3.2 MB.
MAX_FRAME_BYTES = 16 * 1024 * 1024


#: A packer's first buffer; it grows as a message needs. msgpack's default (256 KiB) made every
#: connection of the index, whose ``FrameWriter`` keeps a packer, cost a quarter of a MiB.
PACKER_BUFFER_BYTES = 8 * 1024


def new_packer() -> msgpack.Packer:
    """A packer with the protocol's settings: ``bytes`` as bin, ``str`` as str.

    A packer is not thread-safe; keep one per connection or per thread.
    """
    return msgpack.Packer(use_bin_type=True, autoreset=True, buf_size=PACKER_BUFFER_BYTES)


#: A request or a reply as it travels: a msgpack map (see ``maru_core.protocol.messages``).
Message = dict[str, Any]


def encode_frame(message: Message, packer: msgpack.Packer | None = None) -> bytes:
    """Serialise ``message`` into one frame (header and payload).

    Raises ``FrameError`` if the payload would exceed ``MAX_FRAME_BYTES``:
    the peer would close the connection, so it is refused here first.
    """
    payload = (packer or new_packer()).pack(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(
            f"frame of {len(payload)} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}; "
            "split the batch into smaller requests"
        )
    return HEADER.pack(len(payload)) + payload


#: A bin value longer than this is copied once, straight into the frame, by ``FrameWriter``.
INLINE_BIN_BYTES = 16 * 1024


def _bin_header(length: int) -> bytes:
    if length < 1 << 8:
        return b"\xc4" + length.to_bytes(1, "big")
    if length < 1 << 16:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


class FrameWriter:
    """Encodes the frames of one connection; a frame carrying a large bin
    (packed keys, locations, slots) is built in one reused buffer.

    ``encode_frame`` packs the bin into msgpack's buffer, copies it out into
    a new ``bytes`` and copies that again behind the header: three copies and
    two fresh allocations of the largest part of the frame. Here the bin
    values longer than ``INLINE_BIN_BYTES`` go last in the map (a msgpack map
    may list its pairs in any order), the rest is packed as usual, and the
    frame is assembled with one copy of the bin into a buffer that is kept.

    ``frame()`` returns a view of that buffer, valid until the next call;
    call ``release()`` when the view was handed to something that may still
    hold it (an asyncio transport with unsent data), so the next frame gets a
    buffer of its own.
    """

    def __init__(self, packer: msgpack.Packer | None = None) -> None:
        self._packer = packer or new_packer()
        self._out = bytearray(0)

    def frame(self, message: Message) -> bytes | memoryview:
        """The frame of ``message`` (``FrameError`` above ``MAX_FRAME_BYTES``)."""
        parts = self.parts(message)
        if len(parts) == 1:
            return parts[0]
        length = sum(map(len, parts))
        if len(self._out) < length:
            self._out = bytearray(max(length, 2 * len(self._out)))
        out = memoryview(self._out)
        at = 0
        for part in parts:
            out[at : at + len(part)] = part
            at += len(part)
        return out[:at]

    def parts(self, message: Message) -> list[bytes | memoryview]:
        """The frame of ``message`` as consecutive parts, its bins longer than
        ``INLINE_BIN_BYTES`` not copied at all: the header with the other
        fields, then each such bin's name and length, and the bin itself (a
        view of the message's value: leave that unchanged until written).
        ``FrameError`` above ``MAX_FRAME_BYTES``."""
        large = [k for k, v in message.items() if isinstance(v, (bytes, memoryview)) and len(v) > INLINE_BIN_BYTES]
        if not large:
            return [encode_frame(message, self._packer)]
        pack = self._packer.pack
        fields = [self._packer.pack_map_header(len(message))]
        fields += [pack(k) + pack(v) for k, v in message.items() if k not in large]
        bins = [memoryview(message[k]).cast("B") for k in large]
        heads = [pack(k) + _bin_header(len(b)) for k, b in zip(large, bins)]
        small = b"".join(fields)
        length = len(small) + sum(map(len, heads)) + sum(map(len, bins))
        if length > MAX_FRAME_BYTES:
            raise FrameError(
                f"frame of {length} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}; "
                "split the batch into smaller requests"
            )
        parts: list[bytes | memoryview] = [HEADER.pack(length) + small]
        for head, data in zip(heads, bins):
            parts += [head, data]
        return parts

    def release(self) -> None:
        """Give up the buffer of the last frame (someone else may still read it)."""
        self._out = bytearray(0)


def payload_length(header: bytes | bytearray | memoryview, offset: int = 0, limit: int = MAX_FRAME_BYTES) -> int:
    """The payload length announced by the 4-byte header at ``offset`` of ``header``;
    checked against ``limit`` (``MAX_FRAME_BYTES`` unless a reader sets a smaller one)."""
    (length,) = HEADER.unpack_from(header, offset)
    if length > limit:
        name = "MAX_FRAME_BYTES" if limit == MAX_FRAME_BYTES else "the limit before hello"
        raise FrameTooLarge(f"frame announces {length} bytes, above {name}={limit}")
    if length == 0:
        raise FrameError("frame announces an empty payload")
    return length


_DECODE_LIMITS = {
    "max_array_len": 2 * MAX_BATCH_KEYS,
    "max_map_len": 1024,
    "max_str_len": 1024 * 1024,
    "max_ext_len": 0,  # the protocol has no extension types
}


def decode_payload(payload: bytes | bytearray | memoryview) -> Any:
    """Decode one msgpack payload. Anything that is not exactly one msgpack
    object raises ``FrameError``; what the object contains is checked later,
    by ``maru_core.protocol.messages``."""
    try:
        # Non-string map keys are decoded rather than refused, so that a map
        # with odd keys gets a typed ``bad_request`` reply, not a closed socket.
        # Container limits refuse, from its header alone, an array or map no
        # message has (a frame of 16 million nils would take a third of a
        # second to build); an array a little over the batch limit still
        # decodes, to be answered ``too_large``.
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, **_DECODE_LIMITS)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise FrameError(f"payload is not one msgpack object: {exc}") from exc


#: A payload of at least this many bytes has its bins decoded as read-only views of the
#: receive buffer rather than copied: copying a reserve's 3 MiB of keys and lengths took
#: 0.3 ms of the index's loop, for a request that may be refused at once.
VIEW_BINS_FROM = 256 * 1024
#: Most fields of a payload decoded with views (every request has a few; more are decoded as usual).
_VIEW_MAX_FIELDS = 16
#: Byte counts after a msgpack type byte: of a str or bin's length, or of a scalar's value.
_LENGTH_BYTES = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
_SCALAR_BYTES = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
                 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}  # fmt: skip


def _item_extent(payload: memoryview, at: int) -> tuple[int, int] | None:
    """Where the data of the scalar, str or bin starting at ``at`` starts (after its
    type and length bytes) and where it ends; ``None`` for any other type (an array, a
    map, an extension) or an item cut short."""
    first = payload[at]
    if first <= 0x7F or first >= 0xE0:  # a fixint
        start = end = at + 1
    elif 0xA0 <= first <= 0xBF:  # a fixstr
        start, end = at + 1, at + 1 + (first & 0x1F)
    elif first in _SCALAR_BYTES:
        start, end = at + 1, at + 1 + _SCALAR_BYTES[first]
    elif first in _LENGTH_BYTES:
        start = at + 1 + _LENGTH_BYTES[first]
        end = start + int.from_bytes(payload[at + 1 : start], "big")
    else:
        return None
    return (start, end) if end <= len(payload) else None


#: A field's value in a payload decoded with views: a msgpack scalar or str, or a bin's view.
ViewedValue = None | bool | int | float | str | memoryview


def decode_with_views(payload: memoryview) -> dict[str, ViewedValue] | None:
    """``payload`` decoded as ``decode_payload`` would, but each bin a read-only view of
    ``payload`` (no copy), when it is one map of at most ``_VIEW_MAX_FIELDS`` fields whose
    names are strs and whose values are scalars, strs or bins (every request of the
    protocol); ``None`` for any other payload (decode it with ``decode_payload``).

    msgpack cannot decode a bin without copying it; this reads only the map's few
    headers by hand and leaves every other value to msgpack."""
    first, at = payload[0], 1
    if 0x80 <= first <= 0x8F:
        fields = first & 0x0F
    elif first == 0xDE and len(payload) >= 3:
        fields, at = int.from_bytes(payload[1:3], "big"), 3
    else:
        return None  # no request is a map 32, nor anything but a map
    if fields > _VIEW_MAX_FIELDS:
        return None
    message: dict[str, ViewedValue] = {}
    for _ in range(fields):
        if at >= len(payload) or (name := _item_extent(payload, at)) is None:
            return None
        value_at = name[1]
        if value_at >= len(payload) or (value := _item_extent(payload, value_at)) is None:
            return None
        try:
            key = decode_payload(payload[at:value_at])
            if 0xC4 <= payload[value_at] <= 0xC6:
                message[key] = payload[value[0] : value[1]].toreadonly()
            else:
                message[key] = decode_payload(payload[value_at : value[1]])
        except (FrameError, TypeError):  # not UTF-8, or a name msgpack decodes to no dict key
            return None  # decoded as usual, to raise or be answered as usual
        if type(key) is not str:
            return None
        at = value[1]
    return message if at == len(payload) else None


#: A payload above this must start as a map to be received at all (smaller ones
#: that are no map are decoded, to be answered ``bad_request``).
_SMALL_PAYLOAD = 64 * 1024


def _starts_a_map(first_byte: int) -> bool:
    """Whether a msgpack object starting with this byte is a map (fixmap, map 16, map 32)."""
    return 0x80 <= first_byte <= 0x8F or first_byte in (0xDE, 0xDF)


class FrameBuffer:
    """A receive buffer that frames are read into in place and decoded from.

    The reader asks ``writable()`` for free space, lets the socket fill it
    (``recv_into``, or asyncio's ``BufferedProtocol``) and reports the byte
    count to ``advance``; then, while ``complete()``, ``pop()`` decodes the
    next frame straight from the buffer. A frame's bytes are thus copied
    once, by the kernel, and a payload is decoded without being sliced out
    first. The buffer grows with the bytes that actually arrived (at most
    doubling what is held), never by what a header announces: a peer that
    announces 16 MiB and sends 6 bytes costs nothing more than 6 bytes, and
    a large frame still arrives in few system calls. The buffer shrinks
    back once a large frame has been consumed.

    ``max_frame`` is the largest payload accepted; a server lowers it for a
    connection that has not said ``hello`` yet (see ``set_max_frame``).
    ``may_grow(current, wanted)`` is asked before the buffer grows and may
    refuse by raising ``FrameError`` (a server's cap on all its buffers).
    With ``views``, a large payload's bins are not copied (see ``pop``).
    """

    def __init__(self, initial_bytes: int = 256 * 1024, min_free: int = 64 * 1024,
                 max_frame: int = MAX_FRAME_BYTES, keep_bytes: int | None = None,
                 may_grow: Callable[[int, int], None] | None = None, views: bool = False) -> None:  # fmt: skip
        self._initial = initial_bytes
        self._views = views  # large payloads' bins as views (``pop``)
        self._may_grow = may_grow  # (current, wanted bytes): raises FrameError to refuse
        self._keep = 4 * initial_bytes if keep_bytes is None else keep_bytes
        self._min_free = min_free
        self._buf = bytearray(initial_bytes)
        # The buffer last left to a frame's views (``pop``): taken back to receive into
        # once no view of it is left, so a stream of large frames reuses one buffer.
        self._lent: bytearray | None = None
        self._start = 0  # first byte not consumed yet
        self._end = 0  # end of the bytes received
        self.max_frame = max_frame

    def set_max_frame(self, limit: int) -> None:
        """Accept payloads up to ``limit`` bytes from now on (checked again for a frame under way)."""
        self.max_frame = min(limit, MAX_FRAME_BYTES)

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds room for, with the one left to views (what this connection costs in memory)."""
        return len(self._buf) + (len(self._lent) if self._lent is not None else 0)

    @property
    def pending_bytes(self) -> int:
        return self._end - self._start

    def writable(self) -> memoryview:
        """Free space after the bytes received (at least ``min_free`` bytes, or
        what the frame under way still needs)."""
        held = self._end - self._start
        need = self._min_free
        if held >= HEADER_BYTES:
            missing = HEADER_BYTES + payload_length(self._buf, self._start, self.max_frame) - held
            need = max(need, min(missing, held))  # grow with what arrived, not with what was announced
        if len(self._buf) - self._end < need:
            if held + need <= len(self._buf):
                self._buf[:held] = self._buf[self._start : self._end]  # same size: never a resize
            else:
                # A new bytearray, never a resize: the caller may still hold a view of the old one.
                fresh = self._take_back_lent(held + need)
                if fresh is None:
                    size = max(held + need, 2 * len(self._buf))
                    if self._may_grow is not None:
                        self._may_grow(len(self._buf), size)
                    fresh = bytearray(size)
                fresh[:held] = self._buf[self._start : self._end]
                self._buf = fresh
            self._start, self._end = 0, held
        return memoryview(self._buf)[self._end :]

    def advance(self, count: int) -> None:
        """``count`` bytes were written at the start of the last ``writable()`` view."""
        self._end += count

    def complete(self) -> bool:
        """Whether a whole frame is buffered; ``FrameError`` for a header no frame may have,
        or for a large frame whose payload does not start as a map (refused before the rest arrives)."""
        held = self._end - self._start
        if held < HEADER_BYTES:
            return False
        length = payload_length(self._buf, self._start, self.max_frame)
        if length > _SMALL_PAYLOAD and held > HEADER_BYTES and not _starts_a_map(self._buf[self._start + HEADER_BYTES]):
            raise FrameError(f"a frame of {length} bytes whose payload is not a msgpack map: every message is one")
        return held >= HEADER_BYTES + length

    def pop(self) -> Any:
        """Decode and consume the next frame (``complete()`` must be true); ``FrameError`` if undecodable.

        With ``views``, a payload of ``VIEW_BINS_FROM`` bytes or more has its bins decoded
        as views of this buffer (``decode_with_views``); the buffer is then left to them,
        not written again while one lives, and the bytes after the frame move into a fresh one."""
        start = self._start + HEADER_BYTES
        end = start + payload_length(self._buf, self._start, self.max_frame)
        if self._views and end - start >= VIEW_BINS_FROM:
            with memoryview(self._buf) as view:
                message = decode_with_views(view[start:end])
            if message is not None:
                self._leave_to_views(end)
                return message
        with memoryview(self._buf) as view:
            try:
                message = decode_payload(view[start:end])
            finally:
                self._start = end
        if self._start == self._end:
            self._start = self._end = 0
            self.shrink(self._keep)
        return message

    def _leave_to_views(self, end: int) -> None:
        """Leave the buffer to the views of the frame that ends at ``end``: the bytes
        received after it go to a fresh buffer (of the initial size, or what they need)."""
        rest = self._end - end
        fresh = bytearray(max(self._initial, rest + self._min_free))
        fresh[:rest] = self._buf[end : self._end]
        self._lent = self._buf
        self._buf, self._start, self._end = fresh, 0, rest

    def _take_back_lent(self, least: int) -> bytearray | None:
        """The buffer left to views, when it holds ``least`` bytes and no view of it is left."""
        lent = self._lent
        # In CPython a view holds its bytearray through its buffer export: beyond ``self._lent``,
        # this local and getrefcount's own argument, any reference means a view may still read it.
        if lent is None or len(lent) < least or sys.getrefcount(lent) > 3:
            return None
        self._lent = None
        return lent

    def discard(self) -> None:
        """Drop what is buffered and give a grown buffer back at once (its connection is closing)."""
        self._start = self._end = 0
        self.shrink(self._initial)

    def shrink(self, keep_bytes: int) -> bool:
        """Give back a buffer larger than ``keep_bytes`` while it holds nothing, and one
        left to views larger than that; whether it did."""
        gave = self._lent is not None and len(self._lent) > keep_bytes
        if gave:
            self._lent = None  # freed with its last view
        if self._start != self._end or len(self._buf) <= keep_bytes:
            return gave
        self._buf = bytearray(self._initial)
        self._start = self._end = 0
        return True


class FrameDecoder:
    """Incremental decoder: ``feed`` it bytes as they arrive, get whole messages back."""

    def __init__(self) -> None:
        self._frames = FrameBuffer()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        messages = []
        with memoryview(data) as rest:
            while True:
                while self._frames.complete():
                    messages.append(self._frames.pop())
                if not rest:
                    return messages
                space = self._frames.writable()
                count = min(len(space), len(rest))
                space[:count] = rest[:count]
                self._frames.advance(count)
                rest = rest[count:]

    @property
    def pending_bytes(self) -> int:
        return self._frames.pending_bytes


async def read_frame(reader: asyncio.StreamReader) -> Any | None:
    """Read and decode one frame; ``None`` on a clean end of stream.

    Raises ``FrameError`` for an oversized or undecodable frame and
    ``asyncio.IncompleteReadError`` when the stream ends inside a frame.
    """
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    payload = await reader.readexactly(payload_length(header))
    return decode_payload(payload)
