"""Frames of the index protocol: a 4-byte big-endian length, then a msgpack map.

A frame longer than ``MAX_FRAME_BYTES`` or a payload that is not msgpack
means the stream can no longer be trusted; the receiver raises
``FrameError`` and closes that connection.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from maru_core.protocol.errors import FrameError, FrameTooLarge

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size

#: Largest payload accepted in one frame. A retrieve of ``MAX_BATCH_KEYS``
#: keys is about 2.4 MB on the wire, its reply about 3.2 MB.
MAX_FRAME_BYTES = 16 * 1024 * 1024


def new_packer() -> msgpack.Packer:
    """A packer with the protocol's settings: ``bytes`` as bin, ``str`` as str.

    A packer is not thread-safe; keep one per connection or per thread.
    """
    return msgpack.Packer(use_bin_type=True, autoreset=True)


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


def payload_length(header: bytes) -> int:
    """The payload length announced by a 4-byte ``header``; checked against the limit."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame announces {length} bytes, above MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    if length == 0:
        raise FrameError("frame announces an empty payload")
    return length


def decode_payload(payload: bytes | bytearray | memoryview) -> Any:
    """Decode one msgpack payload. Anything that is not exactly one msgpack
    object raises ``FrameError``; what the object contains is checked later,
    by ``maru_core.protocol.messages``."""
    try:
        # Non-string map keys are decoded rather than refused, so that a map
        # with odd keys gets a typed ``bad_request`` reply, not a closed socket.
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise FrameError(f"payload is not one msgpack object: {exc}") from exc


class FrameDecoder:
    """Incremental decoder: ``feed`` it bytes as they arrive, get whole messages back."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER_BYTES:
            length = payload_length(bytes(self._buffer[:HEADER_BYTES]))
            end = HEADER_BYTES + length
            if len(self._buffer) < end:
                break
            messages.append(decode_payload(bytes(self._buffer[HEADER_BYTES:end])))
            del self._buffer[:end]
        return messages

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)


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
