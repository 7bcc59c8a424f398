"""What the index client is made of besides its connection: request builders,
reply checks, and the lease policy on reconnect.

Every reply is checked before it is handed out: a retrieve that answers a
different number of locations than keys were asked, or a reply of the wrong
shape, raises ``IndexRejected`` instead of being sliced by position. The
errors themselves are the seam's (``maru_core.index.api``).
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    from maru_core.pool.pool_identity import PoolIdentity

from maru_core.index.api import (
    IndexError_,
    IndexRejected,
    IndexTimeout,
    IndexUnavailable,
    Keys,
    MalformedReply,
    WrongPool,
)
from maru_core.protocol import (
    KEY_BYTES,
    PROTOCOL_VERSION,
    ErrorType,
    LocationList,
    MAX_BATCH_KEYS,
    MIN_PROTOCOL_VERSION,
    Message,
    Op,
    SlotList,
    pack_counts,
    pack_keys,
    pack_lengths,
)

DEFAULT_TIMEOUT_S = 5.0
#: After a failed connect, calls fail fast for this long instead of each
#: waiting for a connect timeout; the heartbeat keeps trying meanwhile.
DEFAULT_RECONNECT_BACKOFF_S = 0.5


def check_served_pool(expected: PoolIdentity, reply: Message, url: str) -> None:
    """Raise ``WrongPool`` unless the ``hello`` ``reply`` of the index at ``url``
    names the pool region ``expected`` (a ``PoolIdentity``) describes."""
    from maru_core.pool.pool_identity import PoolIdentity

    try:
        served = PoolIdentity.from_hello(reply)
    except ValueError as exc:
        raise _broken(Op.HELLO, f"the pool it serves: {exc}", reply) from exc
    differ = expected.mismatch(served)
    if differ is not None:
        raise WrongPool(
            f"the index at {url} serves {served.describe()}, but this process mapped {expected.describe()} "
            f"({differ} differ): refusing it, so nothing is read from or written to another region. "
            "The cache was probably moved or resized, or the index URL names another cache's index: "
            "re-create this pod (e.g. kubectl rollout restart) so it maps the cache's current region",
            expected,
            served,
        )


def while_backing_off(last_error: IndexError_) -> IndexError_:
    """What a call fails with while the client waits to reconnect after ``last_error``:
    the same refusal for a wrong pool (only another index or pod cures it), else ``IndexUnavailable``
    (``IndexTimeout`` after a timeout, so the caller counts it as one)."""
    if isinstance(last_error, WrongPool):
        return WrongPool(last_error.message, last_error.expected, last_error.served)
    kind = IndexTimeout if isinstance(last_error, IndexTimeout) else IndexUnavailable
    return kind(f"{last_error} (retrying in the background)")


def default_client_name() -> str:
    """A readable client name; identity comes from the lease, not from this."""
    return f"{socket.gethostname()}/{os.getpid()}"


def hello_request(client_name: str, token: str | None, lease_id: str | None) -> Message:
    return {
        "op": Op.HELLO,
        "protocol": PROTOCOL_VERSION,
        "client": client_name,
        "token": token,
        "lease_id": lease_id,
    }


def keys_request(op: Op, keys: Keys) -> Message:
    """A request carrying ``keys`` packed (see ``maru_core.protocol.messages``);
    ``keys`` may already be packed (one ``bytes`` of 16-byte keys end to end)."""
    return {"op": op, "keys": pack_keys(keys)}


def prefix_request(keys: Keys, group: int) -> Message:
    """A ``retrieve_prefix`` request: ``keys`` packed, pinned in whole groups of ``group``."""
    if type(group) is not int or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    return {"op": Op.RETRIEVE_PREFIX, "keys": pack_keys(keys), "group": group}


def prefixes_requests(key_lists: Sequence[Keys]) -> list[Message]:
    """``match_prefixes`` requests for ``key_lists``: one, or as many as keep
    each within ``MAX_BATCH_KEYS`` keys (a list alone larger than that is
    still sent alone: the index names the limit)."""
    requests: list[Message] = []
    packed: list[bytes] = []
    counts: list[int] = []
    total = 0
    for keys in key_lists:
        keys = pack_keys(keys)
        if counts and total + len(keys) // KEY_BYTES > MAX_BATCH_KEYS:
            requests.append({"op": Op.MATCH_PREFIXES, "keys": b"".join(packed), "counts": pack_counts(counts)})
            packed, counts, total = [], [], 0
        packed.append(keys)
        counts.append(len(keys) // KEY_BYTES)
        total += counts[-1]
    if counts:
        requests.append({"op": Op.MATCH_PREFIXES, "keys": b"".join(packed), "counts": pack_counts(counts)})
    return requests


def parse_prefixes(reply: Message, request: Message) -> list[int]:
    """A ``match_prefixes`` reply: one count per list asked, none above its list's length."""
    op = Op.MATCH_PREFIXES
    counts = np.frombuffer(request["counts"], dtype="<i8").tolist()
    matched = _field(op, reply, "matched", list)
    if len(matched) != len(counts) or any(type(m) is not int or not 0 <= m <= c for m, c in zip(matched, counts)):
        raise _broken(op, f"matched={str(matched)[:100]} for lists of {str(counts)[:100]} keys", reply)
    return matched


def reserve_request(items: Iterable[tuple[bytes, int]]) -> Message:
    """A reserve request with its keys and lengths packed."""
    items = list(items)
    keys = [k for k, _ in items]
    lengths = [n for _, n in items]
    return {"op": Op.RESERVE, "keys": pack_keys(keys), "lengths": pack_lengths(lengths)}


def request_size(request: Message) -> int:
    """How many keys a request built here carries."""
    return len(request["keys"]) // KEY_BYTES


def _broken(op: Op, what: str, reply: object = None) -> MalformedReply:
    return MalformedReply(f"malformed reply: {what}", op, reply)


def check_reply(op: Op, reply: Any) -> Message:
    """The reply map of a successful call; raise ``IndexRejected`` for an error reply
    (of type ``internal`` when it names a type this version does not know)."""
    if type(reply) is not dict or "ok" not in reply:
        raise _broken(op, "not a reply map", reply)
    if reply["ok"] is True:
        return reply
    error = reply.get("error")
    if type(error) is not dict:
        raise _broken(op, "error reply without an error map", reply)
    wire_type, message = error.get("type"), str(error.get("message"))
    error_type = ErrorType.of_reply(wire_type)
    if error_type.value != wire_type:
        message = f"{message} (error type {str(wire_type)[:64]!r}, unknown to this client)"
    raise IndexRejected(error_type, message, op)


def _field(op: Op, reply: Message, name: str, kind: type) -> Any:
    value = reply.get(name)
    if type(value) is not kind:
        raise _broken(op, f"field {name!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def parse_count(op: Op, reply: Message, name: str, at_most: int) -> int:
    value = _field(op, reply, name, int)
    if not 0 <= value <= at_most:
        raise _broken(op, f"{name}={value} for {at_most} keys")
    return value


def parse_locations(reply: Message, count: int) -> LocationList:
    try:
        locations = LocationList.from_wire(_field(Op.RETRIEVE, reply, "locations", bytes))
    except MalformedReply as exc:
        exc.reply = reply
        raise
    except ValueError as exc:
        raise _broken(Op.RETRIEVE, str(exc), reply) from exc
    if len(locations) != count:
        raise _broken(Op.RETRIEVE, f"{len(locations)} locations for {count} keys", reply)
    return locations


def parse_prefix(reply: Message, count: int, group: int) -> tuple[int, LocationList | None]:
    """A ``retrieve_prefix`` reply: ``(matched, locations)``, the locations
    (``None``: nothing pinned) exactly the pinned whole groups, none a miss."""
    op = Op.RETRIEVE_PREFIX
    try:
        matched = parse_count(op, reply, "matched", count)
        wire = _field(op, reply, "locations", bytes)
        if not wire:
            return matched, None
        locations = LocationList.from_wire(wire)
        pinned = matched - matched % group
        if len(locations) != pinned or None in locations:
            raise _broken(op, f"{len(locations)} locations (misses included) for {pinned} pinned keys "
                          f"of {matched} matched in groups of {group}")
    except MalformedReply as exc:
        exc.reply = reply
        raise
    except ValueError as exc:
        raise _broken(op, str(exc), reply) from exc
    return matched, locations


def rejected_prefix_pinned(exc: IndexRejected) -> bool | None:
    """Whether a ``retrieve_prefix`` that raised ``exc`` may have pinned anything.

    ``False``: a typed refusal, or a reply with no locations (the index pins
    only what it returns). ``None``: it cannot be told; the lease must end.
    Unlike a retrieve's, such a reply is never unpinned on its word: its
    count of pinned keys is what failed the check.
    """
    if not isinstance(exc, MalformedReply):
        return None if exc.error_type is ErrorType.INTERNAL else False
    reply = exc.reply
    if type(reply) is dict and reply.get("ok") is True and reply.get("locations") == b"":
        return False
    return None


def rejected_retrieve_pinned(exc: IndexRejected, count: int) -> bool | None:
    """Whether the index pinned the ``count`` keys of a retrieve that raised ``exc``.

    ``False``: a typed refusal (retrieve pins nothing before it can refuse).
    For a malformed reply marked ``ok`` whose locations decode to at least
    ``count`` entries, the first ``count`` are the index's answer: ``True``
    when none is a miss (every key hit, so every key was pinned), ``False``
    otherwise (all or nothing). ``None``: it cannot be told (an ``internal``
    error, no proper reply map, locations that do not decode, fewer entries
    than keys, the lost ones possibly misses); only ending the lease is safe
    then, because unpinning keys that this retrieve did not pin would drop
    pins that other retrieves on the same lease still hold.
    """
    if not isinstance(exc, MalformedReply):
        return None if exc.error_type is ErrorType.INTERNAL else False
    reply = exc.reply
    if type(reply) is not dict or reply.get("ok") is not True:
        return None
    wire = reply.get("locations")
    if not isinstance(wire, (bytes, bytearray, memoryview)):
        return None
    try:
        locations = LocationList.from_wire(wire)
    except (TypeError, ValueError):
        return None
    if len(locations) < count:
        return None
    return None not in locations[:count]


def parse_slots(reply: Message, count: int) -> SlotList:
    try:
        slots = SlotList.from_wire(_field(Op.RESERVE, reply, "slots", bytes))
    except ValueError as exc:
        raise _broken(Op.RESERVE, str(exc)) from exc
    if len(slots) != count:
        raise _broken(Op.RESERVE, f"{len(slots)} slots for {count} items")
    return slots


def parse_committed(reply: Message, count: int) -> list[bool]:
    committed = _field(Op.COMMIT, reply, "committed", list)
    if len(committed) != count or set(map(type, committed)) - {bool}:
        raise _broken(Op.COMMIT, f"'committed' must be {count} booleans")
    return committed


def parse_hello(reply: Message) -> tuple[str, float, Message]:
    lease_id = _field(Op.HELLO, reply, "lease_id", str)
    protocol = reply.get("protocol")
    if type(protocol) is not int or not MIN_PROTOCOL_VERSION <= protocol <= PROTOCOL_VERSION:
        raise _broken(Op.HELLO, f"the index answered protocol {protocol!r}; this client speaks "
                                f"{MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}: upgrade MaruCache one release "
                                "at a time, the index and the pods")
    ttl = reply.get("lease_ttl_s")
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl <= 0:
        raise _broken(Op.HELLO, "lease_ttl_s must be a positive number")
    return lease_id, float(ttl), _field(Op.HELLO, reply, "geometry", dict)
