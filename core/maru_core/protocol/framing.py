"""Frames of the index protocol: a 4-byte big-endian length, then a msgpack map.

A frame longer than ``MAX_FRAME_BYTES`` or a payload that is not msgpack
means the stream can no longer be trusted; the receiver raises
``FrameError`` and closes that connection.
"""

from __future__ import annotations

import asyncio
import struct
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


def encode_frame(message: dict[str, Any], packer: msgpack.Packer | None = None) -> bytes:
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

    def frame(self, message: dict[str, Any]) -> bytes | memoryview:
        """The frame of ``message`` (``FrameError`` above ``MAX_FRAME_BYTES``)."""
        large = [k for k, v in message.items() if isinstance(v, (bytes, memoryview)) and len(v) > INLINE_BIN_BYTES]
        if not large:
            return encode_frame(message, self._packer)
        pack = self._packer.pack
        parts = [self._packer.pack_map_header(len(message))]
        parts += [pack(k) + pack(v) for k, v in message.items() if k not in large]
        bins = [memoryview(message[k]).cast("B") for k in large]
        heads = [pack(k) + _bin_header(len(b)) for k, b in zip(large, bins)]
        small = b"".join(parts)
        length = len(small) + sum(map(len, heads)) + sum(map(len, bins))
        if length > MAX_FRAME_BYTES:
            raise FrameError(
                f"frame of {length} bytes exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}; "
                "split the batch into smaller requests"
            )
        if len(self._out) < HEADER_BYTES + length:
            self._out = bytearray(max(HEADER_BYTES + length, 2 * len(self._out)))
        out = memoryview(self._out)
        HEADER.pack_into(out, 0, length)
        at = HEADER_BYTES + len(small)
        out[HEADER_BYTES:at] = small
        for head, data in zip(heads, bins):
            out[at : at + len(head)] = head
            at += len(head)
            out[at : at + len(data)] = data
            at += len(data)
        return out[:at]

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
    """

    def __init__(self, initial_bytes: int = 256 * 1024, min_free: int = 64 * 1024,
                 max_frame: int = MAX_FRAME_BYTES, keep_bytes: int | None = None,
                 may_grow: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        self._initial = initial_bytes
        self._may_grow = may_grow  # (current, wanted bytes): raises FrameError to refuse
        self._keep = 4 * initial_bytes if keep_bytes is None else keep_bytes
        self._min_free = min_free
        self._buf = bytearray(initial_bytes)
        self._start = 0  # first byte not consumed yet
        self._end = 0  # end of the bytes received
        self.max_frame = max_frame

    def set_max_frame(self, limit: int) -> None:
        """Accept payloads up to ``limit`` bytes from now on (checked again for a frame under way)."""
        self.max_frame = min(limit, MAX_FRAME_BYTES)

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds room for (what this connection costs in memory)."""
        return len(self._buf)

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
        """Decode and consume the next frame (``complete()`` must be true); ``FrameError`` if undecodable."""
        start = self._start + HEADER_BYTES
        end = start + payload_length(self._buf, self._start, self.max_frame)
        with memoryview(self._buf) as view:
            try:
                message = decode_payload(view[start:end])
            finally:
                self._start = end
        if self._start == self._end:
            self._start = self._end = 0
            self.shrink(self._keep)
        return message

    def discard(self) -> None:
        """Drop what is buffered and give a grown buffer back at once (its connection is closing)."""
        self._start = self._end = 0
        self.shrink(self._initial)

    def shrink(self, keep_bytes: int) -> bool:
        """Give back a buffer larger than ``keep_bytes`` while it holds nothing; whether it did."""
        if self._start != self._end or len(self._buf) <= keep_bytes:
            return False
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
