"""Requests and replies of the index protocol, and their validation.

A request is a msgpack map ``{"id": int, "op": str, ...args}``; a reply is
``{"id": int, "ok": True, ...result}`` or
``{"id": int, "ok": False, "error": {"type": str, "message": str}}``.
``parse_request`` checks every field's type and range before the server acts,
so a wrong request gets a typed error naming the field, never a crash.

Keys travel either as one msgpack array of 16-byte bins or, packed, as one
bin of ``16 * n`` bytes (the keys end to end). Both mean the same, and
``parse_request`` hands either on packed, as one ``bytes``: the registry
reads the bin as numpy words, so no per-key object is ever built on the
server. The clients send the packed form: it costs no per-key object to
encode or decode and no per-key check, which is most of a large batch's
round trip. Reserve lengths likewise travel as an array of integers or
packed, one bin of little-endian u64 words (``pack_lengths``), and are handed
on as an int64 numpy array. Locations and slots travel back packed (see
``maru_core.protocol.locations``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from maru_core.keys import KEY_BYTES, Key, split_keys
from maru_core.protocol.errors import ErrorType, ProtocolError
from maru_core.protocol.ops import OPS, Op

PROTOCOL_VERSION = 1
#: The oldest protocol this release still speaks. The rule that makes rolling
#: upgrades work: a release speaks its own protocol and the one before, so an
#: index answers a ``hello`` of its own version or of the next (the release
#: after it, whose pods may start before the index is upgraded) and the
#: connection speaks the lower of the two (``negotiate``); clients of a
#: release accept an index that answers a version from this one to theirs.
MIN_PROTOCOL_VERSION = 1


def negotiate(offered: int) -> int:
    """The protocol a connection speaks when a client offers ``offered`` to
    an index of this release; ``ProtocolError`` (saying what to run) when
    the two releases are more than one apart."""
    if MIN_PROTOCOL_VERSION <= offered <= PROTOCOL_VERSION + 1:
        return min(offered, PROTOCOL_VERSION)
    raise ProtocolError(
        ErrorType.BAD_REQUEST,
        f"client speaks protocol {offered}; this index speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION} "
        f"and answers clients of protocol {PROTOCOL_VERSION + 1} in {PROTOCOL_VERSION}: "
        "upgrade MaruCache one release at a time, the index and the pods",
    )

#: Most keys (or items) in one request. A 64k-token prompt stored layerwise
#: with 16-token chunks on an 80-layer model is 327,680 keys: send it in
#: several requests.
MAX_BATCH_KEYS = 131072
#: Longest client name and token accepted by ``hello``.
MAX_NAME_CHARS = 256
MAX_TOKEN_CHARS = 4096
_U63 = (1 << 63) - 1
_U64 = (1 << 64) - 1
#: Most record rows one ``list_objects`` or ``flush`` request scans (it runs in
#: slices of a few thousand rows, other connections answered in between).
MAX_SCAN_ROWS = 65536
#: The ``format`` names of ``list_objects`` groups and of ``flush``'s filter:
#: the slot header's format byte (``maru_core.pool.slots.SlotFormat``) in lower
#: case, and ``unknown`` for an object whose head entry no longer reads as its own.
OBJECT_FORMATS = ("unspecified", "chunkwise", "layerwise", "unknown")
#: Most aliases one ``put_aliases`` request stores (a 64k-token prompt in
#: 256-token chunks of 16-token blocks registers 3,840).
MAX_ALIAS_ITEMS = 16384
#: Most candidate alias keys one ``match_alias`` request names (a chunk of
#: 4,096 tokens has 255 block boundaries of 16 tokens inside it).
MAX_ALIAS_CANDIDATES = 256
#: Most layers one ``match_alias`` request names: with the candidates' cap,
#: at most ``MAX_BATCH_KEYS`` object keys looked up per request.
MAX_ALIAS_LAYERS = 512
_U32 = (1 << 32) - 1


class Request(NamedTuple):
    """A validated request: ``args`` holds exactly the fields of ``op``;
    ``keys`` always packed (one ``bytes``, or a read-only ``memoryview`` of a large
    frame's receive buffer: read it, never keep it), ``lengths`` an int64 array."""

    id: int
    op: Op
    args: dict[str, Any]


def _bad(field: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(
        ErrorType.BAD_REQUEST, f"field {field!r} must be {expected}, got {type(value).__name__}"
    )


def pack_keys(keys: Any) -> bytes:
    """Keys end to end: the packed wire form of ``keys`` (returned as is when already packed).

    ``ValueError`` when the result is not ``16 * len(keys)`` bytes (a key of
    the wrong size); ``TypeError`` for an item that is not bytes-like.
    """
    if type(keys) is bytes:
        if len(keys) % KEY_BYTES:
            raise ValueError(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {len(keys)}")
        return keys
    packed = b"".join(keys)
    if len(packed) != KEY_BYTES * len(keys):
        raise ValueError(f"keys must be {KEY_BYTES} bytes each (maru_core.keys.Key)")
    return packed


def unpack_keys(packed: bytes) -> list[Key]:
    """The list of keys in a packed bin (its length a multiple of 16)."""
    return split_keys(packed)


def pack_lengths(lengths: Any) -> bytes:
    """Reserve lengths as one bin of little-endian u64 words (their packed wire form).

    ``ValueError`` for a length that is not an integer from 1 to 2**63-1.
    """
    try:
        words = np.asarray(lengths, dtype="<i8")
    except (OverflowError, TypeError, ValueError):
        raise ValueError("reserve lengths must be integers from 1 to 2**63-1") from None
    if words.ndim != 1 or (len(words) and words.min() < 1):
        raise ValueError("reserve lengths must be integers from 1 to 2**63-1")
    return words.tobytes()


def _too_many(count: int) -> ProtocolError:
    return ProtocolError(
        ErrorType.TOO_LARGE,
        f"{count} keys in one request, more than MAX_BATCH_KEYS={MAX_BATCH_KEYS}; split the batch",
    )


#: The types a packed bin arrives as: ``bytes``, or a read-only ``memoryview`` of the
#: receive buffer for a large frame (``maru_core.protocol.framing.decode_with_views``).
_PACKED = (bytes, memoryview)


def _check_keys(field: str, value: Any) -> bytes | memoryview:
    """The keys packed, whichever form they came in (a view as it came, else ``bytes``)."""
    if type(value) in _PACKED:
        if len(value) % KEY_BYTES:
            raise ProtocolError(
                ErrorType.BAD_REQUEST,
                f"field {field!r} as one bin must hold {KEY_BYTES}-byte keys end to end; "
                f"{len(value)} bytes is not a multiple of {KEY_BYTES}",
            )
        if len(value) > KEY_BYTES * MAX_BATCH_KEYS:
            raise _too_many(len(value) // KEY_BYTES)
        return value
    if type(value) is not list:
        raise _bad(field, f"an array of {KEY_BYTES}-byte bins or one bin of keys end to end", value)
    if len(value) > MAX_BATCH_KEYS:
        raise _too_many(len(value))
    # set(map(...)) walks the list in C: a few microseconds per thousand keys.
    if value and (set(map(type, value)) != {bytes} or set(map(len, value)) != {KEY_BYTES}):
        bad = next(k for k in value if type(k) is not bytes or len(k) != KEY_BYTES)
        shown = f"{len(bad)} bytes" if type(bad) is bytes else type(bad).__name__
        raise ProtocolError(
            ErrorType.BAD_REQUEST,
            f"field {field!r} must hold {KEY_BYTES}-byte bins only; found {shown}",
        )
    return b"".join(value)


def _bad_lengths(field: str) -> ProtocolError:
    return ProtocolError(
        ErrorType.BAD_REQUEST,
        f"field {field!r} must hold object lengths in bytes, integers from 1 to 2**63-1 "
        "(an array, or one bin of little-endian u64 words)",
    )


def _check_lengths(field: str, value: Any) -> np.ndarray:
    """The lengths as an int64 array, whichever form they came in."""
    if type(value) in _PACKED:
        if len(value) % 8:
            raise ProtocolError(
                ErrorType.BAD_REQUEST,
                f"field {field!r} as one bin must hold u64 words; {len(value)} bytes is not a multiple of 8",
            )
        if len(value) > 8 * MAX_BATCH_KEYS:
            raise ProtocolError(
                ErrorType.TOO_LARGE, f"{len(value) // 8} items in one request, more than {MAX_BATCH_KEYS}"
            )
        # Read as signed: a word of 2**63 or more turns negative and is refused below.
        lengths = np.frombuffer(value, dtype="<i8")
        if len(lengths) and lengths.min() < 1:
            raise _bad_lengths(field)
        return lengths
    if type(value) is not list:
        raise _bad(field, "an array of positive integers or one bin of u64 words", value)
    if len(value) > MAX_BATCH_KEYS:
        raise ProtocolError(
            ErrorType.TOO_LARGE, f"{len(value)} items in one request, more than {MAX_BATCH_KEYS}"
        )
    if value and (set(map(type, value)) != {int} or min(value) < 1 or max(value) > _U63):
        raise _bad_lengths(field)
    return np.array(value, dtype=np.int64)


def pack_counts(counts: Any) -> bytes:
    """Key counts (``match_prefixes``: keys per list) as one bin of little-endian u64 words."""
    try:
        words = np.asarray(counts, dtype="<i8")
    except (OverflowError, TypeError, ValueError):
        raise ValueError("key counts must be integers from 0 to 2**63-1") from None
    if words.ndim != 1 or (len(words) and words.min() < 0):
        raise ValueError("key counts must be integers from 0 to 2**63-1")
    return words.tobytes()


def _check_counts(field: str, value: Any) -> list[int]:
    """Keys per list (``match_prefixes``), one bin of u64 words or an array of ints."""
    if type(value) in _PACKED and len(value) % 8 == 0:
        counts = np.frombuffer(value, dtype="<i8").tolist()  # read as signed: >= 2**63 turns negative
    elif type(value) is list and set(map(type, value)) <= {int}:
        counts = value
    else:
        raise _bad(field, "an array of key counts or one bin of u64 words", value)
    if len(counts) > MAX_BATCH_KEYS:
        raise _too_many(len(counts))
    if counts and (min(counts) < 0 or max(counts) > MAX_BATCH_KEYS):
        raise ProtocolError(ErrorType.BAD_REQUEST, f"field {field!r} must hold key counts from 0 to {MAX_BATCH_KEYS}")
    return counts


def _keys_at_most(most: int, what: str, advice: str) -> Callable[[str, Any], bytes]:
    """A checker of keys (as ``_check_keys``) of which at most ``most`` (``what`` they are
    and ``advice``, what to do instead, for the error)."""

    def check(field: str, value: Any) -> bytes:
        keys = _check_keys(field, value)
        if len(keys) > KEY_BYTES * most:
            raise ProtocolError(
                ErrorType.TOO_LARGE,
                f"{len(keys) // KEY_BYTES} {what} in one request, more than {most}; {advice}",
            )
        return bytes(keys)  # kept by the alias table: never a view of a receive buffer

    return check


def _optional_layers(field: str, value: Any) -> tuple[int, ...] | None:
    """``nil`` (the chunkwise format: a target is one object) or the layer indices of the
    layerwise format's objects: 1 to ``MAX_ALIAS_LAYERS`` distinct integers from 0 to 2**32-1."""
    if value is None:
        return None
    if (type(value) is not list or not 1 <= len(value) <= MAX_ALIAS_LAYERS
            or set(map(type, value)) != {int} or min(value) < 0 or max(value) > _U32
            or len(set(value)) != len(value)):  # fmt: skip
        raise ProtocolError(
            ErrorType.BAD_REQUEST,
            f"field {field!r} must be nil (chunkwise objects) or an array of 1 to {MAX_ALIAS_LAYERS} distinct "
            f"layer indices from 0 to 2**32-1 (the layerwise objects' layers), got {str(value)[:80]}",
        )
    return tuple(value)


def _check_int(field: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value <= _U63:
        raise _bad(field, "a non-negative integer", value)
    return value


def _int_from_1(most: int, what: str) -> Callable[[str, Any], int]:
    """A checker of an integer from 1 to ``most`` (``what`` it counts, for the error)."""

    def check(field: str, value: Any) -> int:
        if type(value) is not int or not 1 <= value <= most:
            raise ProtocolError(
                ErrorType.BAD_REQUEST,
                f"field {field!r} must be an integer from 1 to {most} ({what}), got {value!r}"[:200],
            )
        return value

    return check


_check_group = _int_from_1(MAX_BATCH_KEYS, "keys per pinned group")
_check_scan_rows = _int_from_1(MAX_SCAN_ROWS, "rows scanned per request")


def _optional_layout(field: str, value: Any) -> int | None:
    if value is not None and (type(value) is not int or not 0 <= value <= _U64):
        raise _bad(field, "a layout fingerprint (an integer from 0 to 2**64-1) or nil", value)
    return value


def _optional_format(field: str, value: Any) -> str | None:
    if value is not None and value not in OBJECT_FORMATS:
        raise ProtocolError(
            ErrorType.BAD_REQUEST, f"field {field!r} must be one of {', '.join(OBJECT_FORMATS)} or nil, "
            f"got {value!r}"[:200],
        )
    return value


def _optional_str(limit: int) -> Callable[[str, Any], str | None]:
    def check(field: str, value: Any) -> str | None:
        if value is None:
            return None
        if type(value) is not str:
            raise _bad(field, "a string or nil", value)
        if len(value) > limit:
            raise ProtocolError(
                ErrorType.BAD_REQUEST, f"field {field!r} is longer than {limit} characters"
            )
        return value

    return check


def _check_name(field: str, value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_NAME_CHARS:
        raise ProtocolError(
            ErrorType.BAD_REQUEST,
            f"field {field!r} must be a non-empty string of at most {MAX_NAME_CHARS} characters",
        )
    return value


_Field = tuple[Callable[[str, Any], Any], bool]  # (checker, required)
_KEYS: dict[str, _Field] = {"keys": (_check_keys, True)}
SCHEMAS: dict[Op, dict[str, _Field]] = {
    Op.HELLO: {
        "protocol": (_check_int, True),
        "client": (_check_name, True),
        "token": (_optional_str(MAX_TOKEN_CHARS), False),
        "lease_id": (_optional_str(MAX_NAME_CHARS), False),
    },
    Op.HEARTBEAT: {},
    Op.MATCH_PREFIX: _KEYS,
    Op.MATCH_PREFIXES: {"keys": (_check_keys, True), "counts": (_check_counts, True)},
    Op.RETRIEVE: _KEYS,
    Op.RETRIEVE_PREFIX: {"keys": (_check_keys, True), "group": (_check_group, True)},
    Op.UNPIN: _KEYS,
    Op.RESERVE: {"keys": (_check_keys, True), "lengths": (_check_lengths, True)},
    Op.COMMIT: _KEYS,
    Op.ABORT: _KEYS,
    Op.STATS: {},
    Op.BYE: {},
    Op.LIST_OBJECTS: {"cursor": (_check_int, True), "limit": (_check_scan_rows, True)},
    Op.FLUSH: {
        "cursor": (_check_int, True),
        "limit": (_check_scan_rows, True),
        "layout": (_optional_layout, False),
        "format": (_optional_format, False),
    },
    Op.PUT_ALIASES: {
        "aliases": (_keys_at_most(MAX_ALIAS_ITEMS, "aliases", "split the batch"), True),
        "targets": (_keys_at_most(MAX_ALIAS_ITEMS, "targets", "split the batch"), True),
    },
    Op.MATCH_ALIAS: {
        "candidates": (_keys_at_most(MAX_ALIAS_CANDIDATES, "candidates", "send the preferred ones"), True),
        "layers": (_optional_layers, False),
    },
}


def request_id(message: Any) -> int | None:
    """The request's id if it has a valid one, else ``None`` (used to address
    the error reply of a request that fails validation)."""
    if type(message) is dict:
        rid = message.get("id")
        if type(rid) is int and 0 <= rid <= _U63:
            return rid
    return None


def parse_request(message: Any) -> Request:
    """Validate a decoded payload into a ``Request``; raise ``ProtocolError``.

    Unknown fields are refused (a misspelt field would otherwise be ignored
    silently); optional fields that are absent are set to ``None``.
    """
    if type(message) is not dict:
        raise _bad("<request>", "a map", message)
    rid = request_id(message)
    if rid is None:
        raise _bad("id", "an integer from 0 to 2**63-1", message.get("id"))
    name = message.get("op")
    if type(name) is not str:
        raise _bad("op", "a string", name)
    try:
        op = Op(name)
    except ValueError:
        raise ProtocolError(
            ErrorType.UNKNOWN_OP,
            f"unknown op {name[:64]!r}; protocol {PROTOCOL_VERSION} knows {', '.join(OPS)}",
        ) from None
    schema = SCHEMAS[op]
    unknown = [k for k in message if k not in schema and k != "id" and k != "op"]
    if unknown:
        raise ProtocolError(
            ErrorType.BAD_REQUEST, f"op {name!r} takes no field(s) {sorted(map(repr, unknown))}"
        )
    args: dict[str, Any] = {}
    for field, (check, required) in schema.items():
        if field not in message:
            if required:
                raise ProtocolError(ErrorType.BAD_REQUEST, f"op {name!r} needs field {field!r}")
            args[field] = None
            continue
        args[field] = check(field, message[field])
    if op is Op.RESERVE and len(args["keys"]) != KEY_BYTES * len(args["lengths"]):
        raise ProtocolError(
            ErrorType.BAD_REQUEST,
            f"reserve got {len(args['keys']) // KEY_BYTES} keys but {len(args['lengths'])} lengths",
        )
    if op is Op.MATCH_PREFIXES and len(args["keys"]) != KEY_BYTES * sum(args["counts"]):
        raise ProtocolError(
            ErrorType.BAD_REQUEST,
            f"match_prefixes got {len(args['keys']) // KEY_BYTES} keys but counts adding up to {sum(args['counts'])}",
        )
    if op is Op.PUT_ALIASES and len(args["aliases"]) != len(args["targets"]):
        raise ProtocolError(
            ErrorType.BAD_REQUEST,
            f"put_aliases got {len(args['aliases']) // KEY_BYTES} aliases but {len(args['targets']) // KEY_BYTES} "
            "targets: send one target chunk key per alias key, in the same order",
        )
    return Request(rid, op, args)


def ok_reply(rid: int, **result: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, **result}


def error_reply(rid: int | None, error: ProtocolError) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": error.to_wire()}
