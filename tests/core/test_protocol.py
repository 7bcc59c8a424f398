"""The index protocol: golden framing bytes, request validation, packed
locations, addresses."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

from maru_core.protocol import (
    KEY_BYTES,
    MAX_BATCH_KEYS,
    MAX_FRAME_BYTES,
    ErrorType,
    FrameDecoder,
    FrameError,
    Location,
    LocationList,
    ProtocolError,
    Slot,
    SlotList,
    TcpAddress,
    UnixAddress,
    decode_payload,
    encode_frame,
    error_reply,
    ok_reply,
    parse_request,
    parse_url,
    read_frame,
    pack_keys,
    pack_lengths,
    request_id,
    unpack_keys,
)

KEY_A = bytes(range(16))
KEY_B = bytes(range(16, 32))


# -- framing: golden bytes ---------------------------------------------------

def test_golden_stats_request():
    assert encode_frame({"id": 1, "op": "stats"}) == (
        b"\x00\x00\x00\x0e" b"\x82" b"\xa2id\x01" b"\xa2op\xa5stats"
    )


def test_golden_retrieve_request_keys_are_bins():
    frame = encode_frame({"id": 7, "op": "retrieve", "keys": [KEY_A]})
    payload = b"\x83\xa2id\x07\xa2op\xa8retrieve\xa4keys\x91\xc4\x10" + KEY_A
    assert frame == len(payload).to_bytes(4, "big") + payload


def test_golden_retrieve_request_with_packed_keys():
    frame = encode_frame({"id": 7, "op": "retrieve", "keys": pack_keys([KEY_A, KEY_B])})
    payload = b"\x83\xa2id\x07\xa2op\xa8retrieve\xa4keys\xc4\x20" + KEY_A + KEY_B
    assert frame == len(payload).to_bytes(4, "big") + payload


def test_golden_error_reply():
    reply = error_reply(3, ProtocolError(ErrorType.NO_LEASE, "x"))
    assert encode_frame(reply) == (
        b"\x00\x00\x00\x28\x83\xa2id\x03\xa2ok\xc2\xa5error\x82"
        b"\xa4type\xa8no_lease\xa7message\xa1x"
    )


def test_golden_packed_locations_little_endian():
    wire = LocationList.from_items([Location(0x200000, 5, 1), None]).to_wire()
    assert wire == (
        (0x200000).to_bytes(8, "little") + (5).to_bytes(8, "little") + (1).to_bytes(8, "little")
        + bytes(24)
    )


def test_decoder_reassembles_split_and_joined_frames():
    frames = encode_frame({"id": 1, "op": "stats"}) + encode_frame({"id": 2, "op": "heartbeat"})
    decoder = FrameDecoder()
    got = []
    for i in range(len(frames)):  # one byte at a time
        got += decoder.feed(frames[i : i + 1])
    assert got == [{"id": 1, "op": "stats"}, {"id": 2, "op": "heartbeat"}]
    assert decoder.pending_bytes == 0
    assert FrameDecoder().feed(frames) == got


def test_decoder_refuses_oversized_and_empty_frames():
    with pytest.raises(FrameError, match="MAX_FRAME_BYTES"):
        FrameDecoder().feed((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(FrameError, match="empty"):
        FrameDecoder().feed(b"\x00\x00\x00\x00")


def test_garbage_payload_is_a_frame_error():
    with pytest.raises(FrameError):
        decode_payload(b"\xc1")  # never used in msgpack
    with pytest.raises(FrameError):
        decode_payload(b"\x92\x01")  # array announces 2 items, holds 1
    with pytest.raises(FrameError):
        decode_payload(b"\x01\x02")  # two objects in one payload


def test_encode_refuses_a_frame_the_peer_would_drop():
    with pytest.raises(FrameError, match="split the batch"):
        encode_frame({"blob": b"x" * (MAX_FRAME_BYTES + 1)})


def test_read_frame_from_a_stream():
    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame({"id": 5, "op": "stats"}))
        reader.feed_eof()
        first = await read_frame(reader)
        second = await read_frame(reader)
        return first, second

    assert asyncio.run(main()) == ({"id": 5, "op": "stats"}, None)


def test_read_frame_truncated_inside_a_frame():
    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame({"id": 5, "op": "stats"})[:-2])
        reader.feed_eof()
        await read_frame(reader)

    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(main())


# -- validation --------------------------------------------------------------

def _error(message) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_request(message)
    return info.value


def test_valid_requests_parse_with_defaults():
    req = parse_request({"id": 9, "op": "hello", "protocol": 1, "client": "w"})
    assert (req.id, req.op) == (9, "hello")
    assert req.args == {"protocol": 1, "client": "w", "token": None, "lease_id": None}
    req = parse_request({"id": 1, "op": "reserve", "keys": [KEY_A, KEY_B], "lengths": [1, 2]})
    assert req.args["keys"] == KEY_A + KEY_B  # handed on packed, whichever form they came in
    assert req.args["lengths"].dtype == np.int64 and req.args["lengths"].tolist() == [1, 2]
    assert parse_request({"id": 0, "op": "retrieve", "keys": []}).args == {"keys": b""}


def test_packed_lengths_parse_like_an_array():
    packed = parse_request({"id": 1, "op": "reserve", "keys": KEY_A + KEY_B, "lengths": pack_lengths([7, 2**40])})
    assert packed.args["lengths"].tolist() == [7, 2**40]
    assert pack_lengths([7, 2**40]) == (7).to_bytes(8, "little") + (2**40).to_bytes(8, "little")
    assert parse_request({"id": 1, "op": "reserve", "keys": b"", "lengths": b""}).args["lengths"].tolist() == []
    with pytest.raises(ValueError, match="from 1"):
        pack_lengths([0])


@pytest.mark.parametrize(
    "lengths, words",
    [
        (b"\x01" * 9, "multiple of 8"),
        ((0).to_bytes(8, "little"), "lengths"),
        ((2**63).to_bytes(8, "little"), "lengths"),  # read as signed: negative, refused
        ((5).to_bytes(8, "little") * 2, "2 lengths"),
    ],
)
def test_bad_packed_lengths_get_typed_errors(lengths, words):
    error = _error({"id": 1, "op": "reserve", "keys": KEY_A, "lengths": lengths})
    assert error.error_type is ErrorType.BAD_REQUEST and words in error.message


def test_too_many_packed_lengths():
    error = _error({"id": 1, "op": "reserve", "keys": KEY_A, "lengths": bytes(8 * (MAX_BATCH_KEYS + 1))})
    assert error.error_type is ErrorType.TOO_LARGE


@pytest.mark.parametrize(
    "message, error_type, words",
    [
        ([1, 2], ErrorType.BAD_REQUEST, "must be a map"),
        ({"op": "stats"}, ErrorType.BAD_REQUEST, "'id'"),
        ({"id": True, "op": "stats"}, ErrorType.BAD_REQUEST, "'id'"),
        ({"id": -1, "op": "stats"}, ErrorType.BAD_REQUEST, "'id'"),
        ({"id": 1}, ErrorType.BAD_REQUEST, "'op'"),
        ({"id": 1, "op": "drop_tables"}, ErrorType.UNKNOWN_OP, "unknown op"),
        ({"id": 1, "op": "retrieve"}, ErrorType.BAD_REQUEST, "needs field 'keys'"),
        ({"id": 1, "op": "retrieve", "keys": 5}, ErrorType.BAD_REQUEST, "array"),
        ({"id": 1, "op": "retrieve", "keys": ["abc"]}, ErrorType.BAD_REQUEST, "found str"),
        ({"id": 1, "op": "retrieve", "keys": [b"short"]}, ErrorType.BAD_REQUEST, "found 5 bytes"),
        ({"id": 1, "op": "retrieve", "keys": [KEY_A], "extra": 1}, ErrorType.BAD_REQUEST, "'extra'"),
        ({"id": 1, "op": "reserve", "keys": [KEY_A], "lengths": [0]}, ErrorType.BAD_REQUEST, "lengths"),
        ({"id": 1, "op": "reserve", "keys": [KEY_A], "lengths": [1.5]}, ErrorType.BAD_REQUEST, "lengths"),
        ({"id": 1, "op": "reserve", "keys": [KEY_A], "lengths": [1, 2]}, ErrorType.BAD_REQUEST, "2 lengths"),
        ({"id": 1, "op": "hello", "protocol": "1", "client": "c"}, ErrorType.BAD_REQUEST, "'protocol'"),
        ({"id": 1, "op": "hello", "protocol": 1, "client": ""}, ErrorType.BAD_REQUEST, "'client'"),
        ({"id": 1, "op": "hello", "protocol": 1, "client": "c", "token": 5}, ErrorType.BAD_REQUEST, "'token'"),
        ({"id": 1, "op": "stats", 5: 1}, ErrorType.BAD_REQUEST, "takes no field"),
    ],
)
def test_invalid_requests_get_typed_errors(message, error_type, words):
    error = _error(message)
    assert error.error_type is error_type
    assert words in error.message


def test_packed_and_array_keys_parse_alike():
    zeros = bytes(16)  # trailing NULs must survive unpacking
    keys = [KEY_A, zeros, KEY_B]
    packed = parse_request({"id": 1, "op": "retrieve", "keys": pack_keys(keys)})
    listed = parse_request({"id": 1, "op": "retrieve", "keys": keys})
    assert packed.args["keys"] == listed.args["keys"] == b"".join(keys)
    assert unpack_keys(packed.args["keys"]) == keys
    assert all(type(k) is bytes for k in unpack_keys(packed.args["keys"]))
    assert parse_request({"id": 1, "op": "commit", "keys": b""}).args["keys"] == b""
    assert pack_keys(b"".join(keys)) == b"".join(keys)  # already packed: handed back as is
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_keys(KEY_A[:5])


def test_packed_keys_of_a_wrong_length():
    error = _error({"id": 1, "op": "retrieve", "keys": KEY_A + b"x"})
    assert error.error_type is ErrorType.BAD_REQUEST and "multiple of 16" in error.message
    with pytest.raises(ValueError, match="16 bytes each"):
        pack_keys([KEY_A, b"short"])
    with pytest.raises(TypeError):
        pack_keys([KEY_A, "text"])


def test_oversized_batch_is_too_large():
    packed = bytes(16 * (MAX_BATCH_KEYS + 1))
    assert _error({"id": 1, "op": "retrieve", "keys": packed}).error_type is ErrorType.TOO_LARGE
    keys = [KEY_A] * (MAX_BATCH_KEYS + 1)
    assert _error({"id": 1, "op": "match_prefix", "keys": keys}).error_type is ErrorType.TOO_LARGE


def test_request_id_survives_a_bad_request():
    assert request_id({"id": 4, "op": 5}) == 4
    assert request_id({"id": "4"}) is None
    assert request_id("nope") is None


def test_replies():
    assert ok_reply(2, matched=3) == {"id": 2, "ok": True, "matched": 3}
    err = error_reply(None, ProtocolError(ErrorType.AUTH, "bad token"))
    assert err == {"id": None, "ok": False, "error": {"type": "auth", "message": "bad token"}}
    assert msgpack.unpackb(msgpack.packb(err)) == err


# -- packed locations and slots ----------------------------------------------

def test_location_list_behaves_like_a_list():
    items = [Location(4096 * 512, 10, 1), None, Location(8192 * 512, 5, 2)]
    locs = LocationList.from_wire(LocationList.from_items(items).to_wire())
    assert len(locs) == 3 and locs == items and list(locs) == items
    assert locs[0] == items[0] and locs[1] is None and locs[-1] == items[2]
    assert locs[0:2] == items[:2]
    assert None in locs and locs.count(None) == 1 and locs.misses() == 1
    assert list(locs.offsets()) == [4096 * 512, 0, 8192 * 512]
    assert list(locs.lengths()) == [10, 0, 5] and list(locs.generations()) == [1, 0, 2]
    assert isinstance(locs[2], Location) and locs[2].generation == 2
    with pytest.raises(IndexError):
        locs[3]


def test_location_list_refuses_what_it_cannot_encode():
    with pytest.raises(ValueError, match="offset 0"):
        LocationList.from_items([Location(0, 1, 1)])
    with pytest.raises(ValueError, match="multiple of 24"):
        LocationList.from_wire(b"\x00" * 23)
    with pytest.raises(ValueError, match="3 fields"):
        LocationList.from_items([(1, 2)])


def test_slot_list_round_trip():
    items = [None, Slot(2 << 20, 7)]
    slots = SlotList.from_wire(SlotList.from_items(items).to_wire())
    assert slots == items and slots[1].offset == 2 << 20 and list(slots.generations()) == [0, 7]
    assert SlotList.from_items([]) == [] and len(SlotList.from_wire(b"")) == 0


# -- addresses ---------------------------------------------------------------

def test_parse_urls():
    assert parse_url("tcp://127.0.0.1:5555") == TcpAddress("127.0.0.1", 5555)
    assert parse_url("tcp://index.ns.svc:80") == TcpAddress("index.ns.svc", 80)
    assert parse_url("tcp://[::1]:0") == TcpAddress("::1", 0)
    assert parse_url("unix:///run/maru/index.sock") == UnixAddress("/run/maru/index.sock")
    assert str(TcpAddress("::1", 9)) == "tcp://[::1]:9"
    assert str(parse_url("unix:///a/b")) == "unix:///a/b"


@pytest.mark.parametrize(
    "url, words",
    [
        ("127.0.0.1:5555", "no scheme"),
        ("http://h:1", "not supported"),
        ("tcp://h", "host and a port"),
        ("tcp://:5", "host and a port"),
        ("tcp://h:99999", "port"),
        ("tcp://h:1/x", "nothing after the port"),
        ("unix://relative.sock", "absolute path"),
    ],
)
def test_bad_urls_say_what_to_write(url, words):
    with pytest.raises(ValueError, match=words):
        parse_url(url)


def test_key_size_matches_keys_module():
    assert KEY_BYTES == 16
