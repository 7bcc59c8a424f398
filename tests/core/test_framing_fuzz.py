"""Property-based checks of the receive buffer (a few seconds): frames cut
anywhere arrive whole and in order, memory follows the bytes received, and
limits hold whatever the header announces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maru_core.protocol import FrameError, FrameTooLarge, encode_frame
from maru_core.protocol.framing import HEADER, FrameBuffer

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
