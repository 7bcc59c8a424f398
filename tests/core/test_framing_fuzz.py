"""Property-based checks of the receive buffer (a few seconds): frames cut
anywhere arrive whole and in order, memory follows the bytes received,
limits hold whatever the header announces, and a large payload decoded with
its bins as views of the buffer equals msgpack's decoding."""

from __future__ import annotations

import os
from unittest import mock

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maru_core.protocol import FrameError, FrameTooLarge, encode_frame, framing
from maru_core.protocol.framing import HEADER, FrameBuffer, decode_payload, decode_with_views

messages = st.lists(
    st.dictionaries(st.sampled_from(["id", "op", "keys", "x"]),
                    st.integers(0, 2**32) | st.binary(max_size=3000) | st.text(max_size=20), max_size=4),
    min_size=1, max_size=6,
)  # fmt: skip
FAST = settings(max_examples=40, deadline=None)


def feed(buffer: FrameBuffer, data: bytes, cuts: list[int]) -> list:
    out, at = [], 0
    for cut in sorted({c for c in cuts if c < len(data)} | {len(data)}):
        while at < cut:
            space = buffer.writable()
            n = min(len(space), cut - at)
            space[:n] = data[at : at + n]
            buffer.advance(n)
            at += n
            while buffer.complete():
                out.append(buffer.pop())
    return out


@FAST
@given(batch=messages, cuts=st.lists(st.integers(0, 20_000), max_size=12))
def test_frames_cut_anywhere_arrive_whole_and_in_order(batch, cuts):
    stream = b"".join(encode_frame(m) for m in batch)
    assert feed(FrameBuffer(4096, 4096), stream, cuts) == batch


@FAST
@given(announced=st.integers(64 * 1024 + 1, 16 * 1024 * 1024), sent=st.binary(min_size=1, max_size=5000))
def test_memory_follows_what_arrived_not_what_was_announced(announced, sent):
    buffer = FrameBuffer(4096, 4096)
    data = HEADER.pack(announced) + b"\x81" + sent  # a map, as a large payload must be
    feed(buffer, data[: min(len(data), announced + 4 - 1)], [])
    assert buffer.capacity <= 4 * (len(data) + 4096)


@FAST
@given(announced=st.integers(16 * 1024 + 1, 2**32 - 1), tail=st.binary(max_size=64))
def test_a_frame_above_the_limit_before_hello_is_refused_from_its_header(announced, tail):
    buffer = FrameBuffer(4096, 4096, max_frame=16 * 1024)
    with pytest.raises(FrameTooLarge):
        feed(buffer, HEADER.pack(announced) + tail, [])
    assert buffer.capacity <= 8192


@FAST
@given(first=st.integers(0, 255).filter(lambda b: not (0x80 <= b <= 0x8F or b in (0xDE, 0xDF))))
def test_a_large_payload_that_is_no_map_is_refused_at_its_first_byte(first):
    with pytest.raises(FrameError, match="not a msgpack map"):
        feed(FrameBuffer(4096, 4096), HEADER.pack(1024 * 1024) + bytes([first]), [])


# -- large payloads decoded with their bins as views of the buffer ---------------------------

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=40)
values = st.recursive(scalars | st.binary(max_size=600),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                      max_leaves=12)  # fmt: skip
flat_maps = st.dictionaries(st.text(max_size=12), scalars | st.binary(max_size=3000), max_size=16)


def as_bytes(message):
    """``message`` with its views read into ``bytes`` (to compare with msgpack's decoding)."""
    if isinstance(message, dict):
        return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in message.items()}
    return message


@FAST
@given(message=flat_maps)
def test_a_request_shaped_payload_decodes_with_views_as_msgpack_decodes_it(message):
    payload = msgpack.packb(message, use_bin_type=True)
    decoded = decode_with_views(memoryview(payload))
    assert decoded is not None
    assert as_bytes(decoded) == msgpack.unpackb(payload, raw=False)
    assert all(v.readonly for v in decoded.values() if isinstance(v, memoryview))


@settings(max_examples=200, deadline=None)
@given(value=values, cut=st.integers(0, 5000), flip=st.tuples(st.integers(0, 5000), st.integers(0, 255)))
def test_any_payload_decodes_with_views_as_msgpack_does_or_is_left_to_it(value, cut, flip):
    """Whatever the bytes (other shapes, cut short, a byte changed), a payload is either decoded
    exactly as msgpack decodes it or left to msgpack (``None``); it never raises."""
    payload = bytearray(msgpack.packb(value, use_bin_type=True))
    at, byte = flip
    if at < len(payload):
        payload[at] = byte
    payload = payload[: max(1, len(payload) - cut % len(payload))]
    decoded = decode_with_views(memoryview(payload))
    if decoded is not None:
        assert as_bytes(decoded) == decode_payload(bytes(payload))


@FAST
@given(batch=st.lists(flat_maps, min_size=1, max_size=6), cuts=st.lists(st.integers(0, 20_000), max_size=12))
def test_frames_with_views_cut_anywhere_arrive_whole_and_in_order(batch, cuts):
    stream = b"".join(encode_frame(m) for m in batch)
    with mock.patch.object(framing, "VIEW_BINS_FROM", 1):  # every payload with views
        received = feed(FrameBuffer(4096, 4096, views=True), stream, cuts)
    assert [as_bytes(m) for m in received] == batch


def test_a_buffer_left_to_views_is_not_written_while_one_lives_and_is_received_into_again_after():
    frames = [encode_frame({"id": i, "op": "reserve", "keys": os.urandom(framing.VIEW_BINS_FROM)}) for i in range(4)]
    buffer = FrameBuffer(4096, 4096, keep_bytes=1 << 24, views=True)
    [kept] = feed(buffer, frames[0], [])
    expected = msgpack.unpackb(frames[0][4:])["keys"]
    for frame in frames[1:3]:  # more large frames while a view of the first one lives
        feed(buffer, frame, [])
    assert bytes(kept["keys"]) == expected
    lent = id(buffer._lent)
    del kept
    [last] = feed(buffer, frames[3], [1000, 5000])
    assert id(last["keys"].obj) == lent, "the next large frame was received into the buffer no view held"
    assert buffer.capacity < 4 * framing.VIEW_BINS_FROM


replies = st.dictionaries(st.sampled_from(["id", "ok", "locations", "slots", "matched"]),
                          st.integers(0, 2**32) | st.binary(max_size=3000)
                          | st.binary(min_size=framing.INLINE_BIN_BYTES + 1, max_size=40_000), max_size=5)  # fmt: skip


@FAST
@given(reply=replies, size=st.integers(1, 70_000))
def test_a_reply_s_parts_cut_into_pieces_are_its_frame(reply, size):
    """A large reply goes out as ``FrameWriter.parts``, its bins not copied, cut into pieces of
    ``size`` bytes a turn: joined, they are the frame ``frame()`` and ``encode_frame`` build."""
    from maru_core.index.connection import _pieces

    writer = framing.FrameWriter()
    parts = writer.parts(reply)
    frame = bytes(writer.frame(reply))
    assert b"".join(parts) == frame
    assert feed(FrameBuffer(4096, 4096), frame, []) == [reply]
    pieces = [b"".join(piece) for piece in _pieces(parts, size)]
    assert b"".join(pieces) == frame
    assert all(len(p) == size for p in pieces[:-1]) and 0 < len(pieces[-1]) <= size
    large = [v for v in reply.values() if isinstance(v, bytes) and len(v) > framing.INLINE_BIN_BYTES]
    assert [bytes(p) for p in parts[2::2]] == large  # each large bin is a part of its own, uncopied
    assert all(isinstance(p, memoryview) and p.obj is v for p, v in zip(parts[2::2], large))
